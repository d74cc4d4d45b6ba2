"""Rollout routing replay (R3) on the rollout side: engine flags, validation, the rows a sample collects
turn by turn from a real torch engine behind a real sglang-router, and the train data they become.

The invariant every test here holds (miles#3277): a routed-experts row and the log-prob it explains
(row ``t``: the forward that scores token ``t + 1``) come from one forward. The engine's rows are
checked against a plain transformers forward's own top-k (``_hf_routes``), its log-probs against the
same forward's.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from slime.backends.sglang.launcher import server_command as sglang_command
from slime.backends.torch_engine.launcher import server_command as torch_command
from slime.config import parse_args
from slime.config.settings.rollout import EngineSettings
from slime.rollout.errors import RolloutError
from slime.rollout.generate_utils import (
    RolloutContext,
    RouteRequest,
    append_env_output,
    append_model_turn,
    generate_turn,
    rollout_context,
    route_request,
)
from slime.rollout.plugin_args import with_router
from slime.rollout.router import Router
from slime.rollout.sample import Sample
from slime.rollout.train_data import samples_to_train_data
from tests.support.configs import base, expect_error, make_hf
from tests.support.served_engine import ServedEngine

PROMPT = [3, 17, 42, 5, 99, 23, 8]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4}


# ---- engine flags and validation ------------------------------------------------------------------


def _moe_hf(tmp_path: Path) -> str:
    return make_hf(tmp_path, **MOE, num_experts_per_tok=2, moe_intermediate_size=64)


def test_r3_starts_every_engine_with_the_routed_experts_flag(tmp_path: Path) -> None:
    args = parse_args(base(_moe_hf(tmp_path), "--use-rollout-routing-replay"))
    engine = EngineSettings.from_args(args)
    assert dict(engine.server_args) == {"enable_return_routed_experts": True}
    sglang = sglang_command(engine, "127.0.0.1", 1, engine_rank=0, num_gpus=1, nccl_port=2)
    torch_engine = torch_command(engine, "127.0.0.1", 1, engine_rank=0, num_gpus=1)
    assert "--enable-return-routed-experts" in sglang and "--enable-return-routed-experts" in torch_engine
    plain = EngineSettings.from_args(parse_args(base(_moe_hf(tmp_path))))
    assert "enable_return_routed_experts" not in dict(plain.server_args)


@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_routing_replay_on_a_checkpoint_without_experts_is_refused(tmp_path, capsys, flag) -> None:
    hf = make_hf(tmp_path)
    assert "the model has no experts (--num-experts)" in expect_error(capsys, base(hf, flag), flag)


def test_r3_with_external_engines_warns_that_they_need_the_flag(tmp_path, capsys) -> None:
    external = ["--rollout-external-engine-addrs", "h:1", "--update-weight-transport", "disk"]
    external += ["--update-weight-disk-dir", str(tmp_path)]
    argv = base(_moe_hf(tmp_path), "--use-rollout-routing-replay", *external)
    parse_args(argv)
    assert "must have been started with --enable-return-routed-experts" in capsys.readouterr().err


# ---- Sample and train data ------------------------------------------------------------------------


def _finished(tokens: list[int], response: int, routes) -> Sample:
    return Sample(
        index=7,
        tokens=tokens,
        response_length=response,
        loss_mask=[1] * response,
        rollout_log_probs=[-0.5] * response,
        rollout_routed_experts=routes,
        reward=1.0,
        status=Sample.Status.COMPLETED,
    )


def test_a_sample_with_routes_survives_json_and_upstreams_tensor_is_taken() -> None:
    routes = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)
    sample = _finished([1, 2, 3, 4, 5], 2, routes)
    again = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert again.rollout_routed_experts.dtype == np.int32
    np.testing.assert_array_equal(again.rollout_routed_experts, routes)
    upstream = _finished([1, 2, 3, 4, 5], 2, torch.from_numpy(routes))  # upstream slime stores a tensor
    data = samples_to_train_data([[sample, upstream]], routing_replay=True)
    for row in data["rollout_routed_experts"]:
        assert row.dtype == np.int32 and row.shape == (4, 2, 2)
        np.testing.assert_array_equal(row, routes)


def test_train_data_refuses_a_sample_without_routes_and_pads_a_failed_stub() -> None:
    routes = np.zeros((4, 2, 2), dtype=np.int32)
    good = _finished([1, 2, 3, 4, 5], 2, routes)
    missing = _finished([1, 2, 3, 4, 5], 2, None)
    with pytest.raises(RolloutError, match=r"sample 1 \(index 7\) has no rows of routed.*must request"):
        samples_to_train_data([[good, missing]], routing_replay=True)
    short = _finished([1, 2, 3, 4, 5], 2, routes[:3])
    with pytest.raises(RolloutError, match="has 3 rows"):
        samples_to_train_data([[short]], routing_replay=True)
    stub = _finished([1, 5], 1, None)
    stub.status = Sample.Status.FAILED
    data = samples_to_train_data([[good, stub]], routing_replay=True)
    np.testing.assert_array_equal(data["rollout_routed_experts"][1], [[[0, 1], [0, 1]]])
    assert "rollout_routed_experts" not in samples_to_train_data([[missing]])


def test_route_request_asks_again_only_for_rows_that_explain_held_log_probs() -> None:
    sample = _finished([1, 2, 3, 4, 5], 2, np.zeros((4, 2, 2), dtype=np.int32))
    assert route_request(sample) == RouteRequest(4, False)  # all rows held
    append_env_output(sample, [6, 7], "")
    assert route_request(sample) == RouteRequest(4, False)  # the new rows explain tool tokens only
    sample.rollout_routed_experts = None  # a partial response whose routes were lost
    assert route_request(sample) == RouteRequest(0, True)
    sample.rollout_routed_experts = np.zeros((3, 2, 2), dtype=np.int32)  # rows 0..2: prompt tokens
    assert route_request(sample) == RouteRequest(3, True)


# ---- against a real engine behind a real router ---------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("r3") / "qwen3_moe", arch="qwen3_moe")


@pytest.fixture(scope="module")
def served(qwen3_moe, tmp_path_factory) -> Iterator[ServedEngine]:
    served = ServedEngine(["--model-path", str(qwen3_moe), "--enable-return-routed-experts"])
    yield served
    served.close()


@pytest.fixture(scope="module")
def args(served, qwen3_moe, tmp_path_factory) -> Iterator[argparse.Namespace]:
    """The rollout's namespace: the router in front of the engine, R3 on, the model's shape."""
    router = Router(tmp_path_factory.mktemp("router"))
    url = router.start()
    router.add_worker(served.url)
    try:
        namespace = parse_args(base(str(qwen3_moe), "--use-rollout-routing-replay", "--rollout-seed", "0"))
        assert (namespace.num_layers, namespace.moe_router_topk) == (2, 2)
        yield with_router(namespace, url)
    finally:
        router.shutdown()


def _hf(model_dir: Path, ids: list[int]) -> tuple[np.ndarray, list[float]]:
    """A plain transformers forward of ``ids``: each position's top-2 experts per layer (sorted) and
    the log-prob of every token after the first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    routes = np.stack(
        [np.sort(logits.topk(2, dim=-1).indices.numpy(), -1) for logits in out.router_logits], 1
    )
    scores = torch.log_softmax(out.logits[0, :-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return routes.astype(np.int32), scores.tolist()


def _check(sample: Sample, model_dir: Path) -> None:
    """The sample's rows and its response's log-probs are those of one forward over its tokens."""
    routes, scores = _hf(model_dir, sample.tokens)
    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    assert sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, 2, 2)
    np.testing.assert_array_equal(np.sort(sample.rollout_routed_experts, -1), routes[:-1])
    trained = [i for i, m in enumerate(sample.loss_mask) if m]
    got = [sample.rollout_log_probs[i] for i in trained]
    want = [scores[sample.prompt_length - 1 + i] for i in trained]
    np.testing.assert_allclose(got, want, atol=1e-4)


def _run(args: argparse.Namespace, coroutine_fn) -> None:
    async def main() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            with rollout_context(RolloutContext(session)):
                await coroutine_fn()

    asyncio.run(main())


def test_a_multi_turn_sample_collects_each_positions_routes_once(args, qwen3_moe) -> None:
    """Turn 1 from the prompt, a tool's tokens, turn 2 from where the rows end: the rows cover every
    position but the last, each sent once (turn 2 starts at turn 1's last token)."""
    sample = Sample(index=0, tokens=list(PROMPT))
    starts = []

    async def two_turns() -> None:
        for tool in ([11, 12, 13], None):
            ask = route_request(sample)
            starts.append(ask.start)
            turn = await generate_turn(args, sample.tokens, {"max_new_tokens": 4, **GREEDY}, routes=ask)
            append_model_turn(sample, turn)
            if tool:
                append_env_output(sample, tool, "")

    _run(args, two_turns)
    assert starts == [0, len(PROMPT) + 4 - 1]
    _check(sample, qwen3_moe)


def test_a_partial_response_without_routes_is_scored_again_with_them(args, qwen3_moe) -> None:
    """Resumed without rows (its log-probs from an earlier forward, here made wrong on purpose): the
    next turn's one request returns the rows and the log-probs of the earlier tokens too; a turn sent
    without ``route_request`` would pair new rows with the held log-probs and is refused."""
    sample = Sample(index=1, tokens=list(PROMPT))

    async def resumed() -> None:
        turn = await generate_turn(args, sample.tokens, {"max_new_tokens": 3, **GREEDY})
        append_model_turn(sample, turn)
        sample.rollout_log_probs = [-99.0] * sample.response_length
        sample.rollout_routed_experts = None
        sample.status = Sample.Status.ABORTED
        unasked = await generate_turn(args, sample.tokens, {"max_new_tokens": 3, **GREEDY})
        with pytest.raises(ValueError, match="send the turn with routes=route_request"):
            append_model_turn(sample, unasked)  # its rows would route the held (wrong) log-probs
        append_model_turn(
            sample,
            await generate_turn(
                args, sample.tokens, {"max_new_tokens": 3, **GREEDY}, routes=route_request(sample)
            ),
        )

    _run(args, resumed)
    assert sample.response_length == 6 and -99.0 not in (sample.rollout_log_probs or [])
    _check(sample, qwen3_moe)


def test_a_retracted_turn_takes_log_probs_and_routes_from_one_rescore(args, served, qwen3_moe) -> None:
    """Retracted mid-decode, the reply's log-probs are the first decode's and its rows the re-prefill's;
    the turn is scored again by a prefill-only request whose log-probs and rows it keeps."""
    scheduler = served.engine.scheduler
    sample = Sample(index=2, tokens=list(PROMPT))
    turns = []

    async def one_turn() -> None:
        turns.append(await generate_turn(args, sample.tokens, {"max_new_tokens": 200, **GREEDY}))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(_run, args, one_turn)
        while scheduler.internal_state()["num_running_reqs"] == 0:
            time.sleep(0.001)
        served.post("/pause_generation", {"mode": "retract"})
        served.post("/continue_generation", {})
        future.result(60)
    (turn,) = turns
    assert turn.num_retractions == 1 and turn.input_log_probs is not None  # the rescore's
    append_model_turn(sample, turn)
    _check(sample, qwen3_moe)


def test_sglang_router_0_3_2_drops_the_routed_experts_fields_so_r3_goes_to_an_engine(args, served) -> None:
    """Why R3 requests bypass the router: it re-serializes /generate without the two fields (measured
    on sglang-router 0.3.2), so the engine never sees them."""
    import requests

    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": True}
    router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    through_router = requests.post(f"{router}/generate", json=body, timeout=30).json()
    direct = requests.post(f"{served.url}/generate", json=body, timeout=30).json()
    assert "routed_experts" not in through_router["meta_info"]
    assert "routed_experts" in direct["meta_info"]
