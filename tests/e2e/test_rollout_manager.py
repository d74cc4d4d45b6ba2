"""The rollout side end to end: a RolloutManager actor, two torch engines on bundles, a real sglang-router.

Every request goes through the router over HTTP, as in production; which engine served what is read
from each engine's own counters (``/get_server_info`` ``internal_states[0].finished_requests``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import ray
import requests
import yaml

from slime.config import parse_args
from slime.engine_client.generate import post_json
from slime.ray.cluster import create_placement_group, release_placement_group
from slime.ray.rollout_manager import RolloutManager
from slime.rollout.generate_utils import prompt_ids
from slime.rollout.sample import Sample
from slime.rollout.sglang_rollout import apply_reply, generate_groups
from slime.rollout.train_data import samples_to_train_data
from slime.utils.http import ServerProcess, ServerStartError, post_json_sync
from tests.support.engines import engine_state
from tests.support.paths import PLUGINS
from tests.support.rollouts import manager_parts, rollout_parts, running_rollout_manager

pytestmark = pytest.mark.e2e

ROLLOUT_BATCH_SIZE, N_SAMPLES, MAX_RESPONSE_LEN = 4, 2, 8


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rollout_data") / "prompts.jsonl"
    rows = [{"input": word, "label": word[::-1]} for word in ("abc", "hello", "slime", "ray", "xyz")]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_args(model: Path, prompts: Path, num_gpus: int, *extra: str):
    return parse_args(
        [
            "--hf-checkpoint", str(model),
            "--prompt-data", str(prompts),
            "--label-key", "label",
            "--rm-type", "exact",
            "--rollout-batch-size", str(ROLLOUT_BATCH_SIZE),
            "--n-samples-per-prompt", str(N_SAMPLES),
            "--rollout-max-response-len", str(MAX_RESPONSE_LEN),
            "--rollout-num-gpus", str(num_gpus),
            "--rollout-backend", "torch",
            "--num-rollout", "1",
            "--debug-rollout-only",
            "--log-level", "WARNING",
            *extra,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval_samples")


@pytest.fixture(scope="module")
def rollout(ray_cluster, tiny_models, prompt_file, eval_dir, tmp_path_factory):
    """One manager with two engines behind the router, shared by the tests below (shut down last).

    Two eval sets from an --eval-config file: "words" takes n = 2 from --n-samples-per-eval-prompt and
    its sampling from the --eval-* flags; "greedy" has n = 4, temperature 0, 5 tokens and its own reward
    (the response's length / 6, where the rollout's --rm-type exact gives 0 or 1).
    """
    config = eval_dir / "eval.yaml"
    reward = f"{PLUGINS / 'length_reward.py'}:response_length_reward"
    greedy = {
        "name": "greedy", "path": f"{prompt_file}@[0:3]", "n_samples_per_eval_prompt": 4, "temperature": 0,
        "max_response_len": 5, "custom_rm_path": reward,
    }  # fmt: skip
    config.write_text(yaml.safe_dump([{"name": "words", "path": str(prompt_file)}, greedy]))
    args = make_args(
        tiny_models["qwen2"],
        prompt_file,
        2,
        "--sglang-max-running-requests", "16",
        "--eval-config", str(config), "--log-passrate", "--eval-output-dir", str(eval_dir),
        "--n-samples-per-eval-prompt", "2",
        "--eval-max-response-len", "3",
    )  # fmt: skip
    with running_rollout_manager(args, tmp_path_factory.mktemp("rollout_logs")) as running:
        yield running


def finished(url: str) -> int:
    return engine_state(url)["finished_requests"]


def send(router_url: str, count: int, max_new_tokens: int = 2) -> list[dict]:
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": max_new_tokens}}
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda _: post_json_sync(f"{router_url}/generate", body), range(count)))


def test_router_spreads_64_requests_over_both_engines(rollout):
    _, urls, router_url = rollout
    before = [finished(url) for url in urls]
    replies = send(router_url, 64)
    served = [finished(url) - b for url, b in zip(urls, before, strict=True)]
    assert len(replies) == 64 and all(len(r["output_ids"]) == 2 for r in replies)
    assert sum(served) == 64 and min(served) > 0, served


def test_router_keeps_sampling_params_and_logprob_fields(rollout):
    """The router re-serializes /generate: what the rollout sends must reach the engine unchanged."""
    _, urls, router_url = rollout
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    direct = post_json_sync(f"{urls[0]}/generate", body)
    routed = post_json_sync(f"{router_url}/generate", {**body, "return_logprob": True})
    assert routed["output_ids"] == direct["output_ids"]  # temperature 0 arrived
    assert [t[1] for t in routed["meta_info"]["output_token_logprobs"]] == routed["output_ids"]
    first = direct["output_ids"][0]
    stop = {**body["sampling_params"], "stop_token_ids": [first], "no_stop_trim": True}
    stopped = post_json_sync(f"{router_url}/generate", {"input_ids": [3, 4, 5], "sampling_params": stop})
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_engine_removed_from_router_gets_no_requests(rollout):
    manager, (kept, removed), router_url = rollout
    ray.get(manager.unregister_engine.remote(removed))
    try:
        before = finished(kept), finished(removed)
        send(router_url, 16)
        assert finished(removed) == before[1]
        assert finished(kept) == before[0] + 16
    finally:
        ray.get(manager.register_engine.remote(removed))
    before_removed = finished(removed)
    send(router_url, 4)
    assert finished(removed) > before_removed  # back in rotation


def test_generate_returns_scored_train_data_with_engine_logprobs(rollout):
    manager, _, _ = rollout
    batch = ray.get(manager.generate.remote(0))
    data, metrics = batch.data, batch.metrics
    n = ROLLOUT_BATCH_SIZE * N_SAMPLES
    assert {key: len(values) for key, values in data.items()} == dict.fromkeys(data, n)
    for tokens, length, mask, log_probs in zip(
        data["tokens"], data["response_lengths"], data["loss_masks"], data["rollout_log_probs"], strict=True
    ):
        assert 1 <= length <= MAX_RESPONSE_LEN and len(tokens) > length
        assert mask == [1] * length and len(log_probs) == length
        assert all(lp <= 0.0 for lp in log_probs)
    assert all(reward in (0.0, 1.0) for reward in data["rewards"])
    assert data["sample_indices"] == list(range(n))
    assert metrics["rollout/num_samples"] == n
    assert metrics["rollout/response_length"] == sum(data["response_lengths"]) / n
    assert metrics["perf/tokens_per_sec"] > 0 and 0.0 <= metrics["rollout/truncated_ratio"] <= 1.0


def test_eval_scores_each_set_of_an_eval_config_with_its_own_n_sampling_and_reward(rollout, eval_dir):
    manager, _, _ = rollout
    metrics = ray.get(manager.eval.remote(0))
    with_ci = ("", "/ci_low", "/ci_high")
    for name, ks in (("words", (1, 2)), ("greedy", (1, 2, 4))):
        keys = {f"eval/{name}{end}" for end in (*with_ci, "/response_length", "/truncated_ratio")}
        keys |= {f"eval/{name}-pass@{k}{end}" for k in ks for end in with_ci}
        assert {key for key in metrics if key.startswith(f"eval/{name}")} == keys
    assert 0.0 <= metrics["eval/words"] <= 1.0
    assert metrics["eval/words/ci_low"] <= metrics["eval/words"] <= metrics["eval/words/ci_high"]
    assert 1 <= metrics["eval/words/response_length"] <= 3  # --eval-max-response-len, not the rollout's
    greedy_pass = [metrics[f"eval/greedy-pass@{k}"] for k in (1, 2, 4)]
    assert greedy_pass == [greedy_pass[0]] * 3  # 4 equal responses per prompt: pass@k is 0 or 1 for all k

    rows = [json.loads(line) for line in (eval_dir / "rollout_0.jsonl").read_text().splitlines()]
    assert len(rows) == 5 * 2 + 3 * 4
    for name, prompts, n in (("words", 5, 2), ("greedy", 3, 4)):
        mine = [row for row in rows if row["set"] == name]
        assert [(r["prompt_index"], r["sample_index"]) for r in mine] == [
            (i, k) for i in range(prompts) for k in range(n)
        ]
        assert all(row["rollout_id"] == 0 and row["weight_versions"] for row in mine)
    greedy = [row for row in rows if row["set"] == "greedy"]
    assert all(1 <= row["response_length"] <= 5 for row in greedy)
    assert all(row["reward"] == len(row["response"]) / 6 for row in greedy)  # its own reward function
    assert metrics["eval/greedy"] == pytest.approx(sum(row["reward"] for row in greedy) / 12)
    for i in range(3):  # temperature 0 reached the engines: the 4 responses to a prompt agree
        assert len({row["response"] for row in greedy if row["prompt_index"] == i}) == 1


def spy_on_generate(monkeypatch) -> list[dict]:
    """The ``/generate`` bodies the rollout sends, recorded on their way to the real router."""
    from slime.rollout import generate_utils

    bodies, real = [], generate_utils.post_json

    async def recording(session, url, payload):
        bodies.append(json.loads(json.dumps(payload)))
        return await real(session, url, payload)

    monkeypatch.setattr(generate_utils, "post_json", recording)
    return bodies


def routed_args(tiny_models, prompt_file, router_url, *extra):
    args = make_args(tiny_models["qwen2"], prompt_file, 2, *extra)
    args.sglang_router_ip, args.sglang_router_port = router_url.removeprefix("http://").split(":")
    return args


async def tagging_generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """A custom generate function as users write them: it finds the router through ``args``."""
    import aiohttp

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = [3, 4, 5]
    body = {"input_ids": prompt, "sampling_params": sampling_params, "return_logprob": True}
    async with aiohttp.ClientSession() as session:
        reply = await post_json(session, url, body)
    sample.metadata["custom"] = True
    return apply_reply(sample, prompt, reply)


def test_custom_generate_function_replaces_the_per_sample_step(rollout, tiny_models, prompt_file):
    _, _, router_url = rollout
    path = f"{__name__}.tagging_generate"
    args = routed_args(tiny_models, prompt_file, router_url, "--custom-generate-function-path", path)
    groups = [[Sample(index=2 * g + i, prompt="abc", label="cba") for i in range(2)] for g in range(2)]
    done = asyncio.run(generate_groups(args, *rollout_parts(args), groups, router_url))
    assert [s.index for group in done for s in group] == [0, 1, 2, 3]
    assert all(s.metadata["custom"] and s.reward is not None for group in done for s in group)
    assert all(s.tokens[:3] == [3, 4, 5] and len(s.rollout_log_probs) == s.response_length for s in done[0])


def test_a_prompt_group_is_one_batched_generate_and_each_sample_its_own_request(
    rollout, tiny_models, prompt_file, monkeypatch
):
    _, urls, router_url = rollout
    bodies = spy_on_generate(monkeypatch)
    args = routed_args(tiny_models, prompt_file, router_url)
    groups = [[Sample(index=4 * g + i, prompt="abc", label="cba") for i in range(4)] for g in range(2)]
    before = sum(finished(url) for url in urls)
    done = asyncio.run(generate_groups(args, *rollout_parts(args), groups, router_url))
    prompt = prompt_ids(args, Sample(prompt="abc"))
    assert len(bodies) == 2  # one per group, not one per sample
    for body in bodies:
        assert body["input_ids"] == [prompt] * 4 and isinstance(body["rid"], str)
        assert "sampling_seed" not in body["sampling_params"]
    assert sum(finished(url) for url in urls) - before == 8  # the engines served each input alone
    for listed in ({"sampling_params": [{}, {}]}, {"rid": ["a", "b"]}):  # why a batch shares them
        refused = requests.post(f"{router_url}/generate", json={"input_ids": [prompt, prompt], **listed})
        assert refused.status_code == 422, refused.text
    for sample in (s for group in done for s in group):
        assert sample.tokens[: len(prompt)] == prompt and sample.reward is not None
        assert 1 <= sample.response_length == len(sample.rollout_log_probs) <= MAX_RESPONSE_LEN

    bodies.clear()
    args = routed_args(tiny_models, prompt_file, router_url, "--rollout-seed-per-sample")
    runs = []
    for _ in range(2):
        fresh = [[Sample(index=i, prompt="abc", label="cba") for i in range(4)]]
        runs.append(
            [s.tokens for s in asyncio.run(generate_groups(args, *rollout_parts(args), fresh, router_url))[0]]
        )
    assert len(bodies) == 8 and all(body["input_ids"] == prompt for body in bodies)
    assert len({body["sampling_params"]["sampling_seed"] for body in bodies}) == 4  # a seed per sample
    assert runs[0] == runs[1]  # the same seeds sample the same tokens


def test_inputs_with_different_budgets_go_in_separate_batches(rollout, monkeypatch):
    from slime.rollout.generate_utils import generate_turns

    _, _, router_url = rollout
    bodies = spy_on_generate(monkeypatch)
    args = argparse.Namespace(sglang_router_ip="127.0.0.1", sglang_router_port=router_url.rsplit(":", 1)[1])
    params = {"max_new_tokens": 5, "ignore_eos": True}
    turns = asyncio.run(generate_turns(args, [[3, 4, 5], [3, 4], [3, 4, 5]], params, budgets=[2, 5, 2]))
    assert [len(turn.output_ids) for turn in turns] == [2, 5, 2]
    assert all(len(turn.log_probs) == len(turn.output_ids) for turn in turns)
    sent = sorted((body["sampling_params"]["max_new_tokens"], body["input_ids"]) for body in bodies)
    assert sent == [(2, [[3, 4, 5], [3, 4, 5]]), (5, [3, 4])]


def test_pause_holds_new_requests_until_resume(rollout):
    manager, _, router_url = rollout
    ray.get(manager.pause.remote())
    with ThreadPoolExecutor(1) as pool:
        try:
            pending = pool.submit(send, router_url, 1)
            time.sleep(0.5)
            assert not pending.done()
        finally:
            ray.get(manager.resume.remote())
        assert len(pending.result(timeout=30)) == 1


def test_shutdown_leaves_no_engine_or_router_process(rollout):
    manager, _, _ = rollout
    pids = ray.get(manager.pids.remote())
    alive = [pid for pid in [*pids["engines"], pids["router"]] if pid is not None]
    assert len(alive) == 3 and all(psutil.pid_exists(pid) for pid in alive)
    ray.get(manager.shutdown.remote())
    assert [pid for pid in alive if psutil.pid_exists(pid)] == []


def test_engine_that_fails_to_start_stops_startup_with_its_log_tail(
    ray_cluster, tiny_models, prompt_file, tmp_path
):
    args = make_args(tiny_models["qwen2"], prompt_file, 1, "--sglang-foo", "1")
    pg = create_placement_group(1)
    manager = RolloutManager.remote(*manager_parts(args), pg, [0], log_dir=str(tmp_path))
    try:
        start = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(manager.start.remote(60))
        assert time.monotonic() - start < 60
        message = str(info.value)
        assert "torch engine 0 exited with status 2" in message
        assert "--foo is an SGLang option that the torch engine does not support" in message
        assert ray.get(manager.pids.remote())["engines"] == []  # stopped and released
    finally:
        ray.kill(manager)
        release_placement_group(pg)


def test_server_that_never_gets_ready_times_out_with_log_tail_and_is_killed(tmp_path):
    argv = [sys.executable, "-c", "import time; print('loading weights', flush=True); time.sleep(60)"]
    server = ServerProcess("slow server", argv, tmp_path / "slow.log", {})
    server.start()
    with pytest.raises(ServerStartError, match=r"(?s)not ready within 1 s.*loading weights"):
        server.wait_ready(lambda: False, timeout_s=1.0)
    assert not psutil.pid_exists(server.pid)


def test_server_dies_with_the_process_that_started_it(tmp_path):
    """Ray kills actors with SIGKILL (no atexit): the parent-death signal must take the server along."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from slime.utils.http import ServerProcess; "
            "s = ServerProcess('x', [sys.executable, '-c', 'import time; time.sleep(60)'], sys.argv[1], {}); "
            "s.start(); print(s.pid, flush=True); time.sleep(60)",
            str(tmp_path / "child.log"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(child)


@pytest.mark.parametrize(
    ("finish", "status"),
    [
        ({"type": "stop", "matched": 2}, Sample.Status.COMPLETED),
        ({"type": "length", "length": 2}, Sample.Status.TRUNCATED),
        ({"type": "abort", "message": "Aborted"}, Sample.Status.ABORTED),
    ],
)
def test_apply_reply_takes_tokens_and_logprobs_from_the_reply(finish, status):
    reply = {
        "text": "xy",
        "output_ids": [7, 2],
        "meta_info": {
            "finish_reason": finish,
            "weight_version": "3",
            "output_token_logprobs": [[-0.1, 7, None], [-0.2, 2, None]],
        },
    }
    sample = apply_reply(Sample(index=0), [5, 6], reply)
    assert sample.tokens == [5, 6, 7, 2] and sample.response_length == 2 and sample.response == "xy"
    assert sample.rollout_log_probs == [-0.1, -0.2] and sample.loss_mask == [1, 1]
    assert sample.status == status and sample.weight_versions == ["3"]


def test_samples_to_train_data_masks_failed_samples_and_keeps_group_order():
    def sample(index: int, status: Sample.Status, reward: float | dict) -> Sample:
        return Sample(
            group_index=index // 2,
            index=index,
            tokens=[1, 2, 3, 4],
            response_length=2,
            loss_mask=[1, 1],
            rollout_log_probs=[-0.5, -0.25],
            reward=reward,
            status=status,
        )

    groups = [
        [sample(0, Sample.Status.COMPLETED, {"acc": 1.0}), sample(1, Sample.Status.FAILED, {"acc": 0.0})],
        [sample(2, Sample.Status.TRUNCATED, {"acc": 0.0}), sample(3, Sample.Status.COMPLETED, {"acc": 1.0})],
    ]
    data = samples_to_train_data(groups, reward_key="acc")
    assert data["sample_indices"] == [0, 1, 2, 3]
    assert data["rewards"] == [1.0, 0.0, 0.0, 1.0]
    assert data["raw_rewards"][0] == {"acc": 1.0}
    assert data["loss_masks"] == [[1, 1], [0, 0], [1, 1], [1, 1]]
    assert data["valid_rewards"] == [True, False, True, True]  # out of its group's mean and std
    assert data["prompt_groups"] == [0, 0, 1, 1]
    groups[1][1].remove_sample = True  # upstream slime's flag: kept in its group, left out of the loss
    removed = samples_to_train_data(groups, reward_key="acc")
    assert removed["loss_masks"] == [[1, 1], [0, 0], [1, 1], [0, 0]]
    assert removed["valid_rewards"] == [True, False, True, True] and removed["rewards"][3] == 1.0
    groups[1][1].remove_sample = False
    assert samples_to_train_data([groups[0] + groups[1][:1], groups[1][1:]], "acc")["prompt_groups"] == [
        0,
        0,
        0,
        1,
    ]
    groups[0][0].rollout_log_probs = [-0.5]
    with pytest.raises(ValueError, match="sample 0 is inconsistent"):
        samples_to_train_data(groups, reward_key="acc")
    groups[0][0].rollout_log_probs = None  # built by hand: no engine log-probs, no 0.0 placeholders
    data = samples_to_train_data(groups, reward_key="acc")
    assert data["rollout_log_prob_masks"] == [[0, 0], [1, 1], [1, 1], [1, 1]]
    assert data["rollout_log_probs"][:2] == [[0.0, 0.0], [-0.5, -0.25]]
    for group in groups:  # a rollout that sampled nothing (SFT) has no engine log-probs at all
        for s in group:
            s.rollout_log_probs = None
    data = samples_to_train_data(groups, reward_key="acc")
    assert "rollout_log_probs" not in data and "rollout_log_prob_masks" not in data
