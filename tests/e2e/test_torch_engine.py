"""The torch engine speaks SGLang's HTTP protocol: every test talks to a real engine subprocess over HTTP.

Correctness is checked against plain transformers on the same checkpoint: greedy outputs equal
`model.generate`, returned logprobs equal log_softmax(logits / T) of one forward pass, whatever the
batching. Weight updates are checked through /get_weights_by_name after sending new weights the way a
trainer does (a rank-0 gloo group, a serialized tensor payload, a checkpoint directory).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from slime.backends.torch_engine.launcher import command_line
from slime.backends.torch_engine.weights import serialize_named_tensors
from slime.utils.http import free_port
from slime.weight_sync.process_group import create_weight_update_group
from tests.support.engines import (
    DIST_TIMEOUT_S,
    HEALTH_TIMEOUT_S,
    _start_engine,
    engine_state,
    forward_logprobs,
    generate,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MAX_RUNNING = 4


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> Path:
    return tiny_models["qwen2"]


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory) -> Iterator[str]:
    server = _start_engine(
        model_dir,
        tmp_path_factory.mktemp("engine") / "engine.log",
        "--max-running-requests",
        str(MAX_RUNNING),
        "--random-seed",
        "0",
        "--mem-fraction-static",
        "0.5",
    )
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def restore_weights(engine, model_dir) -> Iterator[None]:
    """Tests that change the engine's weights put the original checkpoint back afterwards."""
    yield
    reply = requests.post(f"{engine}/update_weights_from_disk", json={"model_path": str(model_dir)}).json()
    assert reply["success"], reply


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation with EOS suppressed (engine side: min_new_tokens == n)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


# ---- generation -----------------------------------------------------------------------------------


def test_text_and_input_ids_give_the_same_sglang_shaped_reply(engine, hf):
    _, tokenizer = hf
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    by_text = generate(engine, text="sort 3 1 2", sampling_params=params)
    by_ids = generate(engine, input_ids=tokenizer("sort 3 1 2")["input_ids"], sampling_params=params)
    assert by_text["output_ids"] == by_ids["output_ids"] and len(by_text["output_ids"]) == 6
    assert by_text["text"] == tokenizer.decode(by_text["output_ids"], skip_special_tokens=True)
    meta = by_text["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 10 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default" and isinstance(meta["id"], str) and meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta
    batch = generate(engine, input_ids=[by_ids["output_ids"], [5, 6]], sampling_params=params)
    assert isinstance(batch, list) and [len(r["output_ids"]) for r in batch] == [6, 6]


def test_greedy_output_equals_transformers_generate(engine, hf):
    model, tokenizer = hf
    for prompt in ("hello", "12+30="):
        ids = tokenizer(prompt)["input_ids"]
        reply = generate(
            engine,
            input_ids=ids,
            sampling_params={"max_new_tokens": 12, "min_new_tokens": 12, "temperature": 0},
        )
        assert reply["output_ids"] == hf_greedy(model, ids, 12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_forward_pass(engine, hf, temperature):
    model, tokenizer = hf
    ids = tokenizer("abc def")["input_ids"]
    reply = generate(
        engine,
        input_ids=ids,
        sampling_params={"max_new_tokens": 16, "temperature": temperature, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )
    out = reply["output_ids"]
    triples = reply["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == out and all(t[2] is None for t in triples)
    expected = forward_logprobs(model, ids + out, len(ids), temperature)
    assert torch.allclose(torch.tensor([t[0] for t in triples]), expected, atol=1e-4)
    # Prompt logprobs (raw logits, as SGLang): first entry None, then log p(ids[i] | ids[:i]).
    prompt = reply["meta_info"]["input_token_logprobs"]
    assert prompt[0][0] is None and [t[1] for t in prompt] == ids
    assert torch.allclose(
        torch.tensor([t[0] for t in prompt[1:]]), forward_logprobs(model, ids, 1, 1.0), atol=1e-4
    )


def test_greedy_logprob_is_taken_at_temperature_one(engine, hf):
    model, tokenizer = hf
    ids = tokenizer("xyz")["input_ids"]
    reply = generate(
        engine,
        input_ids=ids,
        sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )
    got = torch.tensor([t[0] for t in reply["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, forward_logprobs(model, ids + reply["output_ids"], len(ids), 1.0), atol=1e-4)


def test_stop_token_ids_stop_strings_and_trimming(engine, hf):
    _, tokenizer = hf
    ids = tokenizer("q: ")["input_ids"]
    base = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    free = generate(engine, input_ids=ids, sampling_params=base)["output_ids"]
    stop_id = free[2]
    first = free.index(stop_id)
    by_token = generate(
        engine, input_ids=ids, sampling_params={**base, "ignore_eos": False, "stop_token_ids": [stop_id]}
    )
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_token["output_ids"] == free[: first + 1]  # the matched token stays in output_ids ...
    assert by_token["text"] == tokenizer.decode(free[:first])  # ... but not in the text
    kept = generate(
        engine,
        input_ids=ids,
        sampling_params={**base, "ignore_eos": False, "stop_token_ids": [stop_id], "no_stop_trim": True},
    )
    assert kept["text"] == tokenizer.decode(free[: first + 1])
    # ignore_eos disables stop_token_ids too (SGLang)
    ignored = generate(engine, input_ids=ids, sampling_params={**base, "stop_token_ids": [stop_id]})
    assert ignored["output_ids"] == free

    full_text = tokenizer.decode(free)
    stop_str = full_text[3:5]
    cut = full_text.find(stop_str)
    by_str = generate(engine, input_ids=ids, sampling_params={**base, "stop": [stop_str, "never"]})
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert by_str["text"] == full_text[:cut]
    by_str_kept = generate(
        engine, input_ids=ids, sampling_params={**base, "stop": stop_str, "no_stop_trim": True}
    )
    assert by_str_kept["text"] == full_text[: cut + len(stop_str)]


def test_finish_reason_precedence_at_the_last_token_as_sglang(engine, hf):
    """``Req.update_finish_state`` in ``srt/managers/schedule_batch.py``, the same in 0.5.19-0.5.23:
    stop string, then stop token / EOS, then length. The token that fills ``max_new_tokens`` and
    also matches a stop token, or completes a stop string, ends the request as ``stop``."""
    _, tokenizer = hf
    ids = tokenizer("q: ")["input_ids"]
    base = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    free = generate(engine, input_ids=ids, sampling_params=base)["output_ids"]
    n = next(i for i in range(1, 9) if free[i - 1] not in free[: i - 1])  # first occurrence at index n-1
    last = free[n - 1]
    at_limit = {**base, "max_new_tokens": n, "ignore_eos": False, "stop_token_ids": [last]}
    by_token = generate(engine, input_ids=ids, sampling_params=at_limit)
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": last}
    assert by_token["output_ids"] == free[:n]
    text = tokenizer.decode(free[:n])
    tail = text[-1:]
    if tail not in text[:-1]:  # the string completes only with the last token
        by_str = generate(
            engine, input_ids=ids, sampling_params={**base, "max_new_tokens": n, "stop": [tail]}
        )
        assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": tail}
    plain = generate(engine, input_ids=ids, sampling_params={**base, "max_new_tokens": n})
    assert plain["meta_info"]["finish_reason"] == {"type": "length", "length": n}


def test_min_new_tokens_suppresses_stop_tokens(engine, hf):
    _, tokenizer = hf
    ids = tokenizer("q: ")["input_ids"]
    free = generate(engine, input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0})[
        "output_ids"
    ]
    stop_id = free[0]
    early = generate(
        engine,
        input_ids=ids,
        sampling_params={"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id]},
    )
    assert early["output_ids"] == [stop_id]
    late = generate(
        engine,
        input_ids=ids,
        sampling_params={
            "max_new_tokens": 8,
            "temperature": 0,
            "stop_token_ids": [stop_id],
            "min_new_tokens": 3,
        },
    )
    assert stop_id not in late["output_ids"][:3] and len(late["output_ids"]) >= 3


def test_seeded_sampling_is_reproducible(engine):
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = generate(engine, text="seed", sampling_params={**params, "sampling_seed": 7})["output_ids"]
    b = generate(engine, text="seed", sampling_params={**params, "sampling_seed": 7})["output_ids"]
    c = generate(engine, text="seed", sampling_params={**params, "sampling_seed": 8})["output_ids"]
    assert a == b and a != c
    top = generate(
        engine,
        text="seed",
        sampling_params={**params, "sampling_seed": 7, "top_k": 3, "top_p": 0.9, "min_p": 0.05},
    )
    assert len(top["output_ids"]) == 16


def test_sixteen_concurrent_requests_queue_and_join_a_running_batch(engine, hf):
    model, tokenizer = hf
    before = engine_state(engine)
    prompts = [tokenizer("x" * (1 + i % 5) + str(i))["input_ids"] for i in range(16)]
    lengths = [3 + (7 * i) % 17 for i in range(16)]

    def one(i: int) -> dict:
        params = {"max_new_tokens": lengths[i], "min_new_tokens": lengths[i], "temperature": 0}
        return generate(engine, input_ids=prompts[i], sampling_params=params, return_logprob=True)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(one, range(16)))
    for i, reply in enumerate(replies):
        assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": lengths[i]}
        # Batching changed nothing: each token is the argmax (EOS excluded: min_new_tokens) of one plain
        # forward pass over the prompt and the tokens before it.
        ids = prompts[i] + reply["output_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(prompts[i]) - 1 : -1]
        logits[:, tokenizer.eos_token_id] = float("-inf")
        assert reply["output_ids"] == logits.argmax(-1).tolist(), i
        # The log-probs see every earlier key: a request moved to another slot took its own along.
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(reply["output_ids"])[:, None])[:, 0]
        got = torch.tensor([value for value, _, _ in reply["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    after = engine_state(engine)
    assert after["max_running_seen"] == MAX_RUNNING  # the limit held, the rest queued
    assert after["joined_running_batch"] > before["joined_running_batch"]  # late requests joined decoding
    assert after["num_running_reqs"] == 0 and after["num_waiting_reqs"] == 0


def test_bad_requests_are_400_with_sglang_error_shape(engine):
    too_long = requests.post(f"{engine}/generate", json={"input_ids": [5] * 600})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
    over = requests.post(
        f"{engine}/generate", json={"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 50}}
    )
    assert over.status_code == 400 and "maximum context length" in over.json()["error"]["message"]
    assert (
        requests.post(f"{engine}/generate", json={"text": "a", "sampling_params": {"top_k": 0}}).status_code
        == 400
    )
    streamed = requests.post(f"{engine}/generate", json={"text": "a", "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


# ---- abort, pause ---------------------------------------------------------------------------------


def _start_long(url: str, rid: str, pool: concurrent.futures.Executor) -> concurrent.futures.Future:
    future = pool.submit(
        generate,
        url,
        rid=rid,
        text="long",
        sampling_params={"max_new_tokens": 480, "temperature": 0, "ignore_eos": True},
    )
    deadline = time.monotonic() + 30
    while num_scheduled(url) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return future


def num_scheduled(url: str) -> int:
    """Running + waiting requests of the scheduler, from ``GET /v1/loads`` (SGLang 0.5.19-0.5.23)."""
    (load,) = requests.get(f"{url}/v1/loads").json()["loads"]
    return load["num_running_reqs"] + load["num_waiting_reqs"]


def _decode_steps(url: str) -> int:
    return engine_state(url)["decode_steps"]


def test_pause_in_place_stops_decoding_and_abort_returns_partial_output(engine):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        future = _start_long(engine, "long-in-place", pool)
        assert requests.post(f"{engine}/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
        steps = _decode_steps(engine)
        time.sleep(0.3)
        assert _decode_steps(engine) == steps  # no decode step while paused
        # SGLang (one tokenizer worker) acts only on a rid it knows, exactly: a prefix is dropped.
        assert requests.post(f"{engine}/abort_request", json={"rid": "long-in"}).status_code == 200
        time.sleep(0.2)
        assert not future.done()
        assert requests.post(f"{engine}/abort_request", json={"rid": "long-in-place"}).status_code == 200
        reply = future.result(30)
        requests.post(f"{engine}/continue_generation", json={})
    meta = reply["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"] == "Aborted"
    assert 0 < meta["completion_tokens"] == len(reply["output_ids"]) < 480


def test_pause_abort_mode_aborts_running_and_holds_new_requests_out_of_abort_alls_reach(engine):
    """SGLang 0.5.19-0.5.23 (``tokenizer_manager.generate_request``): a request that arrives while
    paused waits before the scheduler; ``abort_all`` and a repeated abort of its rid (0.5.20+: only
    the first is sent on) do not reach it, and it runs in full after ``/continue_generation``."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = _start_long(engine, "long-abort-mode", pool)
        requests.post(f"{engine}/pause_generation", json={"mode": "abort"})
        assert running.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        params = {"max_new_tokens": 3, "ignore_eos": True}
        waiting = pool.submit(generate, engine, rid="held", text="later", sampling_params=params)
        time.sleep(0.3)
        requests.post(f"{engine}/abort_request", json={"abort_all": True})
        requests.post(f"{engine}/abort_request", json={"rid": "held"})
        time.sleep(0.3)
        assert not waiting.done() and num_scheduled(engine) == 0  # held: not even counted as load
        requests.post(f"{engine}/continue_generation", json={})
        requests.post(f"{engine}/abort_request", json={"rid": "held"})  # already sent once: dropped
        reply = waiting.result(30)
    assert reply["meta_info"]["completion_tokens"] == 3
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_pause_retract_then_continue_gives_the_uninterrupted_output(engine):
    params = {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
    reference = generate(engine, text="retract me", sampling_params=params)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(generate, engine, text="retract me", sampling_params=params)
        while num_scheduled(engine) == 0:
            time.sleep(0.002)
        requests.post(f"{engine}/pause_generation", json={"mode": "retract"})
        requests.post(f"{engine}/continue_generation", json={})
        reply = future.result(30)
    assert reply["output_ids"] == reference["output_ids"]
    assert reply["meta_info"]["num_retractions"] in (0, 1)  # 0 only if it finished before the pause


def test_abort_of_a_queued_request_answers_as_sglangs_tokenizer_manager(engine):
    """SGLang 0.5.19-0.5.23, ``TokenizerManager._handle_abort_req``: a request taken from the
    waiting queue is answered with ``{"type": "abort", "message": "Abort in waiting queue"}``, no
    ``prompt_tokens``, empty log-prob lists and ``completion_tokens`` = 0; running ones keep what
    they produced and FINISH_ABORT's four-key form."""
    params = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(MAX_RUNNING + 1) as pool:
        running = [_start_long(engine, f"busy-{i}", pool) for i in range(MAX_RUNNING)]
        deadline = time.monotonic() + 30
        while requests.get(f"{engine}/v1/loads").json()["loads"][0]["num_running_reqs"] < MAX_RUNNING:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        queued = pool.submit(
            generate, engine, rid="queued", text="wait", sampling_params=params, return_logprob=True
        )
        deadline = time.monotonic() + 30
        while requests.get(f"{engine}/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        requests.post(f"{engine}/abort_request", json={"abort_all": True})
        reply = queued.result(30)
        others = [future.result(30) for future in running]
    meta = reply["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert reply["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == [] and "prompt_tokens" not in meta
    assert {"id", "weight_version", "e2e_latency"} <= set(meta)
    for other in others:
        reason = other["meta_info"]["finish_reason"]
        assert reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert other["meta_info"]["completion_tokens"] == len(other["output_ids"])


def test_abort_of_one_running_request_leaves_the_others_generating(engine):
    """Aborting a request whose slot is not the last moves another request's KV row into it. Before,
    that in-place write ran outside inference mode, raised, and ended the scheduler thread: every
    request in flight then waited forever (found by the rollout's aborts by rid)."""
    params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = _start_long(engine, "first-of-three", pool)
        others = [
            pool.submit(generate, engine, rid=f"other-{i}", text="long", sampling_params=params)
            for i in range(2)
        ]
        deadline = time.monotonic() + 30
        while requests.get(f"{engine}/v1/loads").json()["loads"][0]["num_running_reqs"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        requests.post(f"{engine}/abort_request", json={"rid": "first-of-three"})  # slot 0 of 3
        assert first.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        for other in others:
            reply = other.result(30)
            assert reply["meta_info"]["finish_reason"]["type"] == "length" and len(reply["output_ids"]) == 64
    assert requests.get(f"{engine}/health").status_code == 200


def test_abort_all_and_flush_cache(engine):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = _start_long(engine, "long-abort-all", pool)
        assert requests.get(f"{engine}/flush_cache").status_code == 400  # a request is in flight
        requests.post(f"{engine}/abort_request", json={"abort_all": True})
        assert future.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
    assert requests.post(f"{engine}/flush_cache").status_code == 200
    assert requests.get(f"{engine}/health_generate").status_code == 200


def _kv_cache_bytes(url: str) -> int:
    return engine_state(url)["kv_cache_bytes"]


def test_a_flush_keeps_the_kv_buffers_and_what_they_held_changes_no_output(engine, hf):
    """As SGLang keeps its KV pool on flush_cache (``Scheduler.flush_cache``, srt/managers/scheduler.py,
    0.5.19 and 0.5.23: the radix tree and the slot allocators are reset, the pool stays), the engine
    keeps its buffers (allocating them again after every weight push cost a quickstart rollout 5-7 ms);
    a shorter request in a row a longer one filled must still equal transformers, and releasing the
    kv_cache memory frees them."""
    model, tokenizer = hf
    long_params = {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    generate(engine, input_ids=list(range(3, 60)), sampling_params=long_params)
    held = _kv_cache_bytes(engine)
    assert held > 0
    assert requests.post(f"{engine}/flush_cache").status_code == 200
    assert _kv_cache_bytes(engine) == held
    ids = tokenizer("12+30=")["input_ids"]
    params = {"max_new_tokens": 12, "min_new_tokens": 12, "temperature": 0}
    assert generate(engine, input_ids=ids, sampling_params=params)["output_ids"] == hf_greedy(model, ids, 12)
    requests.post(f"{engine}/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert _kv_cache_bytes(engine) == 0
    requests.post(f"{engine}/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert generate(engine, input_ids=ids, sampling_params=params)["output_ids"] == hf_greedy(model, ids, 12)


# ---- weights --------------------------------------------------------------------------------------


def _weights(url: str, name: str, size: int = 100) -> list:
    response = requests.get(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": size})
    assert response.status_code == 200, response.text
    return response.json()


def _random_state(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) * 0.02 for n, p in model.named_parameters()}


def _assert_engine_has(url: str, state: dict[str, torch.Tensor]) -> None:
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.allclose(torch.tensor(_weights(url, name, 3)), state[name][:3], atol=1e-6), name


@contextlib.contextmanager
def weight_session(url: str) -> Iterator[None]:
    """SGLang >= 0.5.21: distributed and tensor updates run between begin and end."""
    begun = requests.post(f"{url}/begin_weight_update", json={"selector": "all"})
    assert begun.json() == {"success": True, "message": "Success"}, begun.text
    try:
        yield
    finally:
        ended = requests.post(f"{url}/end_weight_update", json={})
        assert ended.json() == {"success": True, "message": "Success"}, ended.text


def test_update_weights_from_distributed(engine, hf, restore_weights):
    model, _ = hf
    port = free_port()
    holder: dict = {}
    trainer = threading.Thread(
        target=lambda: holder.update(
            group=create_weight_update_group("127.0.0.1", port, 0, 2, "wug", "gloo", 30)
        )
    )
    trainer.start()
    init = requests.post(
        f"{engine}/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "wug",
            "backend": "gloo",
        },
    )
    trainer.join()
    assert init.json() == {"success": True, "message": "Succeeded to initialize custom process group."}
    group = holder["group"]

    def push(state: dict[str, torch.Tensor], version: str, load_format: str | None) -> dict:
        names = list(state)
        body = {
            "names": names,
            "dtypes": ["float32"] * len(names),
            "shapes": [list(state[n].shape) for n in names],
            "group_name": "wug",
            "weight_version": version,
            "load_format": load_format,
        }
        with weight_session(engine), concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(requests.post, f"{engine}/update_weights_from_distributed", json=body)
            if load_format:  # one uint8 buffer: every tensor's bytes back to back (SGLang's flattened bucket)
                tensors = [torch.cat([state[n].reshape(-1).view(torch.uint8) for n in names])]
            else:
                tensors = [state[n] for n in names]
            for tensor in tensors:
                group.broadcast([tensor.contiguous()]).wait()
            return reply.result(30).json()

    state = _random_state(model, 1)
    assert push(state, "v1", None)["success"]
    _assert_engine_has(engine, state)
    assert requests.get(f"{engine}/model_info").json()["weight_version"] == "v1"
    assert (
        generate(engine, text="a", sampling_params={"max_new_tokens": 1})["meta_info"]["weight_version"]
        == "v1"
    )

    state = _random_state(model, 2)
    assert push(state, "v2", "flattened_bucket")["success"]
    _assert_engine_has(engine, state)
    assert requests.get(f"{engine}/get_model_info").json()["weight_version"] == "v2"

    # A trainer that never sends: the call fails after the timeout instead of hanging.
    names = ["model.norm.weight"]
    body = {"names": names, "dtypes": ["float32"], "shapes": [[128]], "group_name": "wug"}
    started = time.monotonic()
    with weight_session(engine):
        failed = requests.post(f"{engine}/update_weights_from_distributed", json=body)
    assert failed.status_code == 400 and failed.json()["success"] is False
    assert time.monotonic() - started < DIST_TIMEOUT_S + 10
    # Its broadcast is still pending: the group is dropped, not shut down (which waits the transport out).
    started = time.monotonic()
    destroyed = requests.post(f"{engine}/destroy_weights_update_group", json={"group_name": "wug"}).json()
    assert destroyed["success"] and time.monotonic() - started < DIST_TIMEOUT_S
    assert not requests.post(f"{engine}/destroy_weights_update_group", json={"group_name": "wug"}).json()[
        "success"
    ]


# The trainer side as SGLang and slime build it (torch's private group helper); run in its own process so
# that the group it registers in torch.distributed's globals cannot leak into other tests.
SGLANG_STYLE_TRAINER = """
import datetime, sys, torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend, PrefixStore, _new_process_group_helper, _world, rendezvous,
)
port, name = int(sys.argv[1]), sys.argv[2]
timeout = datetime.timedelta(seconds=60)
print("imported", flush=True)  # the store is up a moment later, well within the engine's rendezvous timeout
store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
store.set_timeout(timeout)
pg, _ = _new_process_group_helper(
    2, 0, [], Backend("gloo"), PrefixStore(name, store),
    group_name=name, backend_options=None, timeout=timeout,
)
_world.pg_group_ranks[pg] = {0: 0, 1: 1}
dist.broadcast(torch.arange(128, dtype=torch.float32), src=0, group=pg)
print("sent", flush=True)
sys.stdin.readline()  # the engine closes its side first, as after a real weight sync
dist.destroy_process_group(pg)
"""


def test_weight_group_meets_a_trainer_built_the_sglang_way(engine, restore_weights):
    port = free_port()
    trainer = subprocess.Popen(
        [sys.executable, "-c", SGLANG_STYLE_TRAINER, str(port), "sglang_wug"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Joining starts the engine's DIST_TIMEOUT_S rendezvous clock; importing torch in a fresh process
        # can take longer than that on a loaded machine, so join only once the trainer is about to host.
        assert trainer.stdout.readline().strip() == "imported"
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        init.update(group_name="sglang_wug", backend="gloo")
        assert requests.post(f"{engine}/init_weights_update_group", json=init).json()["success"]
        body = {
            "names": ["model.norm.weight"],
            "dtypes": ["float32"],
            "shapes": [[128]],
            "group_name": "sglang_wug",
        }
        with weight_session(engine):
            assert requests.post(f"{engine}/update_weights_from_distributed", json=body).json()["success"]
        assert trainer.stdout.readline().strip() == "sent"
        assert _weights(engine, "model.norm.weight", 5) == [0.0, 1.0, 2.0, 3.0, 4.0]
        destroy = {"group_name": "sglang_wug"}
        assert requests.post(f"{engine}/destroy_weights_update_group", json=destroy).json()["success"]
        trainer.communicate("bye\n", timeout=30)
        assert trainer.returncode == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_update_weights_from_tensor(engine, hf, restore_weights):
    model, _ = hf
    for seed, flattened in ((3, False), (4, True)):
        state = _random_state(model, seed)
        payload = serialize_named_tensors(list(state.items()), flattened=flattened)
        with weight_session(engine):
            reply = requests.post(
                f"{engine}/update_weights_from_tensor",
                json={
                    "serialized_named_tensors": [payload],
                    "load_format": "flattened_bucket" if flattened else None,
                    "flush_cache": True,
                    "weight_version": f"t{seed}",
                },
            ).json()
        assert reply["success"], reply
        _assert_engine_has(engine, state)
        assert requests.get(f"{engine}/model_info").json()["weight_version"] == f"t{seed}"
    bad = serialize_named_tensors([("no.such.weight", torch.zeros(2))])
    with weight_session(engine):
        reply = requests.post(
            f"{engine}/update_weights_from_tensor", json={"serialized_named_tensors": [bad]}
        )
    assert reply.status_code == 400 and "no.such.weight" in reply.json()["message"]


def test_update_weights_from_disk_and_weight_version(engine, hf, model_dir, tmp_path, restore_weights):
    from safetensors.torch import save_file

    model, _ = hf
    state = _random_state(model, 5)
    new_dir = tmp_path / "new"
    shutil.copytree(model_dir, new_dir)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(new_dir / "model.safetensors"))
    reply = requests.post(
        f"{engine}/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "d1"}
    )
    assert reply.json() == {"success": True, "message": reply.json()["message"], "num_paused_requests": 0}
    _assert_engine_has(engine, state)
    info = requests.get(f"{engine}/get_model_info").json()
    assert info["model_path"] == str(new_dir.resolve()) and info["weight_version"] == "d1"
    assert (
        requests.post(f"{engine}/update_weights_from_disk", json={"model_path": str(tmp_path)}).status_code
        == 400
    )
    bumped = requests.post(f"{engine}/update_weight_version", json={"new_version": "d2"}).json()
    assert bumped == {"success": True, "message": "Weight version updated to d2", "new_version": "d2"}


def engine_state_info(url: str) -> dict:
    return requests.get(f"{url}/get_server_info").json()


def test_health_is_a_generation_that_a_pause_holds_until_503_as_sglang(engine):
    """SGLang 0.5.19-0.5.23 serve ``/health`` and ``/health_generate`` with one handler
    (``entrypoints/http_server.py`` ``health_generate``; ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
    defaults to true in ``srt/environ.py``): a one-token generation, 503 when nothing came back within
    ``SGLANG_HEALTH_CHECK_TIMEOUT``. While paused the generation waits, so a router's health check
    drops a paused engine (seen on a real 0.5.23 server: 503 after ≈ 20 s)."""
    assert requests.get(f"{engine}/health").status_code == 200
    requests.post(f"{engine}/pause_generation", json={"mode": "abort"})
    try:
        for path in ("/health", "/health_generate"):
            start = time.monotonic()
            assert requests.get(f"{engine}{path}", timeout=30).status_code == 503
            assert HEALTH_TIMEOUT_S <= time.monotonic() - start < HEALTH_TIMEOUT_S + 5
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a resume within the timeout: 200
            held = pool.submit(requests.get, f"{engine}/health", timeout=30)
            time.sleep(0.5)
            assert not held.done()
            requests.post(f"{engine}/continue_generation", json={})
            assert held.result().status_code == 200
    finally:
        requests.post(f"{engine}/continue_generation", json={})


def test_release_and_resume_memory_occupation(engine, model_dir, restore_weights):
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    before = generate(engine, text="mem", sampling_params=params)["output_ids"]
    requests.post(f"{engine}/release_memory_occupation", json={"tags": ["kv_cache"]})
    refused = requests.post(f"{engine}/generate", json={"text": "mem"})
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.json()["error"]["message"]
    requests.post(f"{engine}/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert generate(engine, text="mem", sampling_params=params)["output_ids"] == before

    requests.post(f"{engine}/release_memory_occupation", json={})  # tags null: everything
    refused_before = engine_state_info(engine)["generations_while_released"]
    # A health check is a generation (SGLang's /health too): never to be sent to a released engine,
    # refused and counted when it is.
    assert requests.get(f"{engine}/health").status_code == 503
    assert engine_state_info(engine)["generations_while_released"] == refused_before + 1
    assert (
        requests.get(f"{engine}/get_weights_by_name", json={"name": "model.norm.weight"}).status_code == 400
    )
    # Weights may be pushed before resuming; the rest come back as zeros until the next update.
    requests.post(f"{engine}/resume_memory_occupation", json={"tags": None})
    assert _weights(engine, "model.norm.weight", 4) == [0.0] * 4
    reload = requests.post(f"{engine}/update_weights_from_disk", json={"model_path": str(model_dir)}).json()
    assert reload["success"]
    assert generate(engine, text="mem", sampling_params=params)["output_ids"] == before


# ---- SGLang releases ------------------------------------------------------------------------------


def test_weight_update_sessions_as_sglang_0_5_23(engine):
    """``srt/managers/scheduler_components/weight_updater.py`` of SGLang 0.5.23 (sessions from 0.5.21):
    outside a session distributed and tensor updates are refused at once (400), before any receive;
    a second begin and an end without begin are refused with SGLang's messages."""
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "group_name": "none"}
    started = time.monotonic()
    refused = requests.post(f"{engine}/update_weights_from_distributed", json=body)
    assert time.monotonic() - started < 2  # no broadcast was waited for
    assert refused.status_code == 400
    assert refused.json() == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and "
        "end_weight_update()",
    }
    tensor = requests.post(f"{engine}/update_weights_from_tensor", json={"serialized_named_tensors": ["x"]})
    assert tensor.status_code == 400 and tensor.json()["message"].startswith(
        "update_weights_from_tensor must"
    )
    assert requests.post(f"{engine}/begin_weight_update", json={}).json()["success"]  # selector "all"
    again = requests.post(f"{engine}/begin_weight_update", json={"selector": "all"})
    assert again.status_code == 400 and again.json()["message"] == (
        "a weight-update session is already open; call end_weight_update() first"
    )
    assert requests.post(f"{engine}/end_weight_update", json={}).json()["success"]
    bad = requests.post(f"{engine}/begin_weight_update", json={"selector": "both"})
    assert bad.status_code == 400 and bad.json()["object"] == "error"
    stray = requests.post(f"{engine}/end_weight_update", json={})
    assert stray.status_code == 400 and stray.json()["message"] == (
        "no weight-update session is open; call begin_weight_update() first"
    )
    # /get_weight_version is gone (0.5.21): the version is in /model_info; /get_load too (/v1/loads).
    assert requests.get(f"{engine}/get_weight_version").status_code == 404
    assert requests.get(f"{engine}/get_load").status_code == 404
    assert requests.get(f"{engine}/server_info").json()["version"] == "0.5.23"


@pytest.fixture(scope="module")
def oldest_engine(model_dir, tmp_path_factory) -> Iterator[str]:
    """The torch engine as SGLang 0.5.19, the oldest release slime supports."""
    log = tmp_path_factory.mktemp("oldest_engine") / "engine.log"
    server = _start_engine(model_dir, log, "--sglang-release", "0.5.19", "--max-running-requests", "2")
    try:
        yield server.url
    finally:
        server.stop()


def test_sglang_0_5_19_has_no_sessions_and_still_serves_get_load(oldest_engine, model_dir):
    """``srt/entrypoints/http_server.py`` of SGLang 0.5.19: no /begin_weight_update (404), tensor
    updates run without a session, /get_load is a shim over /v1/loads, /get_weight_version is a 404
    pointing at /model_info."""
    url = oldest_engine
    assert requests.post(f"{url}/begin_weight_update", json={}).status_code == 404
    from slime.engine_client.protocol import probe_engine_api

    api = probe_engine_api(url)
    assert (api.version, api.weight_update_sessions, api.load_path) == ("0.5.19", False, "/v1/loads")
    state = {"model.norm.weight": torch.full((128,), 0.5)}
    payload = serialize_named_tensors(list(state.items()))
    reply = requests.post(
        f"{url}/update_weights_from_tensor",
        json={"serialized_named_tensors": [payload], "weight_version": "old-1"},
    )
    assert reply.json()["success"], reply.text
    assert _weights(url, "model.norm.weight", 2) == [0.5, 0.5]
    assert requests.get(f"{url}/model_info").json()["weight_version"] == "old-1"
    moved = requests.get(f"{url}/get_weight_version")
    assert moved.status_code == 404 and "/model_info" in moved.json()["message"]
    (load,) = requests.get(f"{url}/get_load").json()
    assert {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load) and load["num_reqs"] == 0
    reload = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(model_dir)}).json()
    assert reload["success"]


def test_sglang_0_5_19_sends_every_abort_of_a_rid_on(oldest_engine):
    """``tokenizer_manager.abort_request`` of 0.5.19 has no ``abort_sent``: an abort of a held rid is
    lost, but one sent after ``/continue_generation`` still reaches the request."""
    url = oldest_engine
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        requests.post(f"{url}/pause_generation", json={"mode": "abort"})
        params = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}
        held = pool.submit(generate, url, rid="old-held", text="long", sampling_params=params)
        time.sleep(0.3)
        requests.post(f"{url}/abort_request", json={"rid": "old-held"})  # lost: not scheduled yet
        requests.post(f"{url}/continue_generation", json={})
        deadline = time.monotonic() + 30
        while num_scheduled(url) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        requests.post(f"{url}/abort_request", json={"rid": "old-held"})
        reply = held.result(30)
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert reply["meta_info"]["completion_tokens"] < 480


def test_engine_api_probe_sees_the_newest_release(engine):
    from slime.engine_client.protocol import probe_engine_api

    api = probe_engine_api(engine)
    assert (api.version, api.weight_update_sessions, api.load_path) == ("0.5.23", True, "/v1/loads")


# ---- process ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        (["--attention-backend", "triton"], "--attention-backend is an SGLang option"),
        (["--tp-size", "2"], "--tp-size 2"),
    ],
)
def test_unsupported_option_is_rejected_at_start(model_dir, flag, words):
    done = subprocess.run(
        command_line(model_dir, *flag), cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "torch engine" in lines[0]


def test_sigterm_aborts_in_flight_requests_and_exits_zero(model_dir, tmp_path):
    server = _start_engine(model_dir, tmp_path / "engine.log")
    proc = server.process.proc
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = _start_long(server.url, "bye", pool)
            proc.send_signal(signal.SIGTERM)
            reply = future.result(30)
        assert reply["meta_info"]["finish_reason"]["type"] == "abort"
        assert proc.wait(30) == 0
    finally:
        server.stop()


@pytest.mark.parametrize("gather", [True, False])
def test_an_idle_engine_prefills_requests_arriving_together_in_one_forward(model_dir, monkeypatch, gather):
    """Eight requests 20 ms apart reach an idle engine: gathering arrivals (widened here from 1 ms
    quiet / 5 ms at most to 200 ms / 2 s, so a loaded machine cannot split them) prefills them in one
    forward and decodes them in step; without it the first is prefilled alone."""
    from slime.backends.torch_engine import scheduler
    from slime.backends.torch_engine.engine import TorchEngine
    from slime.backends.torch_engine.protocol import parse_generate
    from slime.backends.torch_engine.server_args import parse_server_args

    monkeypatch.setattr(scheduler, "GATHER_QUIET_S", 0.2)
    monkeypatch.setattr(scheduler, "GATHER_MAX_S", 2.0 if gather else 0.0)
    engine = TorchEngine(parse_server_args(["--model-path", str(model_dir), "--random-seed", "0"]))
    engine.scheduler.start()
    replies: list[concurrent.futures.Future] = []
    try:
        params = {"max_new_tokens": 4, "min_new_tokens": 4, "temperature": 0}
        for i in range(8):
            (gen,), _ = parse_generate({"input_ids": [5, 6, 7 + i], "sampling_params": params})
            request = engine.build_request(gen)
            future: concurrent.futures.Future = concurrent.futures.Future()
            request.on_finish = future.set_result
            replies.append(future)
            engine.scheduler.submit(request)
            time.sleep(0.02)
        assert all(len(f.result(timeout=60)["output_ids"]) == 4 for f in replies)
        stats = engine.scheduler.stats
        if gather:
            assert (stats.prefill_batches, stats.decode_steps) == (1, 3)
        else:
            assert stats.prefill_batches >= 2
    finally:
        engine.scheduler.stop()


def test_requests_with_the_same_prompt_prefill_it_once_and_sample_on_their_own(model_dir, hf, monkeypatch):
    """A prompt group as the rollout sends it (eight copies of one prompt, at temperature 0.7, with
    log-probs) and a different prompt, arriving together: the repeated prompt is computed once, the
    copies report it as cached (all but its last token, as SGLang counts a prefix hit), each copy
    samples on its own, and every log-prob is that of a plain forward over its own tokens."""
    from slime.backends.torch_engine import scheduler
    from slime.backends.torch_engine.engine import TorchEngine
    from slime.backends.torch_engine.protocol import parse_generate
    from slime.backends.torch_engine.server_args import parse_server_args

    model, _ = hf
    monkeypatch.setattr(scheduler, "GATHER_QUIET_S", 0.2)
    monkeypatch.setattr(scheduler, "GATHER_MAX_S", 2.0)
    engine = TorchEngine(parse_server_args(["--model-path", str(model_dir), "--random-seed", "0"]))
    engine.scheduler.start()
    prompts = [[5, 17, 40, 3]] * 8 + [[5, 17, 41]]
    futures: list[concurrent.futures.Future] = []
    try:
        params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.7}
        for ids in prompts:
            (gen,), _ = parse_generate({"input_ids": ids, "sampling_params": params, "return_logprob": True})
            request = engine.build_request(gen)
            futures.append(concurrent.futures.Future())
            request.on_finish = futures[-1].set_result
            engine.scheduler.submit(request)
        replies = [f.result(timeout=60) for f in futures]
        stats = engine.scheduler.stats
    finally:
        engine.scheduler.stop()
    assert stats.prefill_batches == 1 and stats.prefill_copied_requests == 7
    assert stats.prefill_tokens == 4 + 3
    assert [r["meta_info"]["cached_tokens"] for r in replies] == [0] + [3] * 7 + [0]
    outputs = [tuple(r["output_ids"]) for r in replies[:8]]
    assert len(set(outputs)) > 1  # eight draws of six tokens from one distribution are not all equal
    for ids, reply in zip(prompts, replies, strict=True):
        ours = torch.tensor([t[0] for t in reply["meta_info"]["output_token_logprobs"]])
        expected = forward_logprobs(model, ids + reply["output_ids"], len(ids), 0.7)
        assert torch.allclose(ours, expected, atol=1e-4)
