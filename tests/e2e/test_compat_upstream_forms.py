"""Plugins written for upstream slime (THUDM/slime) run here unchanged: its import paths, its types and
its semantics where they differ from ours (docs/guides/upstream-compat.md). The plugins are in
tests/support/plugins/compat/; two tiny ``train.py`` runs take them end to end, the rest are unit tests
of each upstream name."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from slime.config.settings.rollout import RolloutSettings
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from slime.rollout.generate_state import GenerateState
from slime.rollout.output import RolloutOutput
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.rollout_function import RolloutFunction
from slime.rollout.sampling import sampling_params
from slime.utils import http_utils
from slime.utils.http import HttpError
from slime.utils.types import Sample
from tests.support.in_process import train_in_process
from tests.support.rollouts import rollout_only_args


@pytest.fixture
def fresh_state():
    GenerateState.reset()
    yield
    GenerateState.reset()


# ---- slime.utils.types.Sample -------------------------------------------------------------------


def test_sample_has_upstream_fields_and_status():
    sample = Sample(index=3, reward={"acc": 1.0})
    assert Sample.Status.FAILED.value == "failed" and Sample.Status.TRUNCATED.value == "truncated"
    assert sample.multimodal_inputs is None and sample.remove_sample is False
    assert sample.train_metadata is None and sample.session_id is None
    sample.session_id, sample.train_metadata = "s1", {"loss": "sft"}
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample
    assert sample.get_reward_value(argparse.Namespace(reward_key="acc")) == 1.0


# ---- slime.utils.http_utils.post ----------------------------------------------------------------


async def _serve(failures: int) -> tuple[web.AppRunner, str, list[dict]]:
    """A server that answers HTTP 503 ``failures`` times, then echoes the payload."""
    seen: list[dict] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if len(seen) <= failures:
            return web.Response(status=503, text="busy")
        if seen[-1].get("plain"):
            return web.Response(text="ok")
        return web.json_response({"echo": seen[-1], "header": request.headers.get("X-SMG-Routing-Key")})

    app = web.Application()
    app.router.add_post("/generate", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/generate", seen


def test_post_retries_failures_as_upstream_then_raises(monkeypatch):
    monkeypatch.setattr(http_utils, "RETRY_DELAY_S", 0.0)

    async def scenario() -> None:
        runner, url, seen = await _serve(failures=2)
        try:
            answer = await http_utils.post(url, {"x": 1}, headers={"X-SMG-Routing-Key": "s1"})
            assert answer == {"echo": {"x": 1}, "header": "s1"} and len(seen) == 3
            assert await http_utils.post(url, {"plain": True}) == "ok"
            seen.clear()
            with pytest.raises(HttpError, match="503"):
                await http_utils.post(url, {"x": 2}, max_retries=2)
            assert len(seen) == 2
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_get_answers_json_once_and_raises_on_an_error_and_model_urls_name_the_router():
    from slime.rollout.sglang_rollout import get_model_url

    async def scenario() -> None:
        calls: list[str] = []

        async def info(request: web.Request) -> web.Response:
            calls.append(request.path)
            if request.path == "/missing":
                return web.Response(status=404, text="no such route")
            return web.json_response({"model_path": "/m"})

        app = web.Application()
        app.router.add_get("/{name}", info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            assert await http_utils.get(f"{base}/model_info") == {"model_path": "/m"}
            with pytest.raises(HttpError, match="404"):
                await http_utils.get(f"{base}/missing")
            assert calls == ["/model_info", "/missing"]  # no retry, as upstream's get
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    args = argparse.Namespace(sglang_router_ip="127.0.0.1", sglang_router_port=3000)
    assert get_model_url(args, "ref") == "http://127.0.0.1:3000/generate"
    assert get_model_url(args, "actor", "/v1/loads") == "http://127.0.0.1:3000/v1/loads"


# ---- slime.rollout.sglang_rollout.GenerateState -------------------------------------------------


def test_generate_state_is_one_per_process_with_upstream_attributes(tiny_models, prompts, fresh_state):
    from slime.rollout.sglang_rollout import GenerateState as upstream_path

    args = rollout_only_args(tiny_models, prompts, "--sglang-server-concurrency", "3")
    state = upstream_path(args)
    assert upstream_path is GenerateState and GenerateState(rollout_only_args(tiny_models, prompts)) is state
    assert state.tokenizer("abc", add_special_tokens=False)["input_ids"]
    assert state.processor is None  # a text-only checkpoint, as upstream answers it
    assert state.semaphore._value == 3  # --sglang-server-concurrency x 1 engine
    assert state.sampling_params == sampling_params(RolloutSettings.from_args(args).sampling)


# ---- rm_hub and filter_hub ----------------------------------------------------------------------


def test_rm_hub_scores_by_the_reward_flags_and_batches_a_custom_function(tiny_models, prompts):
    args = rollout_only_args(tiny_models, prompts)
    right, wrong = Sample(index=0, response="34", label="34"), Sample(index=1, response="3", label="34")
    assert asyncio.run(async_rm(args, right)) == 1.0
    assert asyncio.run(batched_async_rm(args, [right, wrong])) == [1.0, 0.0]
    batched = rollout_only_args(
        tiny_models,
        prompts,
        "--custom-rm-path",
        "tests.support.plugins.compat.upstream_reward.batched_reward",
    )
    assert asyncio.run(batched_async_rm(batched, [right, wrong])) == [0.0, 1.0]  # one call, whole list


def test_check_reward_nonzero_std_keeps_varied_groups_with_upstream_reason():
    args = argparse.Namespace(reward_key=None)
    varied = [Sample(reward=1.0), Sample(reward=0.0)]
    same = [Sample(reward=1.0), Sample(reward=1.0)]
    assert check_reward_nonzero_std(args, varied) == DynamicFilterOutput(keep=True)
    assert check_reward_nonzero_std(args, same) == DynamicFilterOutput(keep=False, reason="zero_std_1.0")


# ---- data source and rollout-function types -----------------------------------------------------


def test_data_buffer_serves_returned_groups_through_the_guides_buffer_filter(tiny_models, prompts):
    args = rollout_only_args(
        tiny_models, prompts, "--buffer-filter-path", "tests.support.plugins.compat.upstream_filters.pop_last"
    )
    with pytest.raises(RuntimeError, match="read-only"):
        RolloutDataSource(args).add_samples([])  # upstream's source without a buffer takes nothing back
    source = RolloutDataSourceWithBuffer(args)
    assert isinstance(source, RolloutDataSource) and source.args is args and len(source) == 6
    first = source.get_samples(3)
    assert [g[0].prompt for g in first] == ["q0", "q1", "q2"] and all(len(g) == 2 for g in first)
    source.add_samples([first[0], first[2]])
    assert source.get_buffer_length() == 2
    assert source.get_samples(1) == [first[2]]  # the newest returned group (the default: the oldest)
    again = source.get_samples(2)
    assert again[0] == first[0] and again[1][0].prompt == "q3"
    assert source.get_buffer_length() == 0


def test_upstreams_four_argument_buffer_filter_is_called_with_rollout_id_none(tiny_models, prompts, capsys):
    path = "tests.support.plugins.compat.upstream_filters.pop_first_with_rollout_id"
    source = RolloutDataSourceWithBuffer(
        rollout_only_args(tiny_models, prompts, "--buffer-filter-path", path)
    )
    first = source.get_samples(3)
    source.add_samples([first[2], first[0]])
    assert source.get_samples(1) == [first[2]]  # the oldest returned group, as upstream's pop_first
    assert source.get_buffer_length() == 1
    with pytest.raises(SystemExit):  # a function of neither form (a dynamic filter) is one line before start
        rollout_only_args(
            tiny_models,
            prompts,
            "--buffer-filter-path",
            "tests.support.plugins.compat.upstream_filters.nonzero_std_logged",
        )
    error = capsys.readouterr().err
    assert error.startswith("error: --buffer-filter-path: ") and "upstream slime's form" in error, error


def test_upstream_rollout_outputs_are_rollout_outputs(tiny_models, prompts):
    groups = [[Sample(index=0)]]
    train = RolloutFnTrainOutput(samples=groups, metrics={"rollout/x": 1.0})
    assert isinstance(train, RolloutOutput) and train.samples is groups and train.groups is groups
    evaluated = RolloutFnEvalOutput(data={"aime": {"rewards": [1.0, 0.0], "truncated": [False, True]}})
    assert evaluated.metrics == {"eval/aime": 0.5} and evaluated.groups == []
    args = rollout_only_args(
        tiny_models,
        prompts,
        "--rollout-function-path",
        "tests.support.plugins.compat.upstream_rollout.generate_rollout",
    )
    output, _ = RolloutFunction(args.rollout_function_path)(args, 0, None, evaluation=True)
    assert isinstance(output, RolloutFnEvalOutput)


# ---- end to end through train.py ----------------------------------------------------------------


ONE_EACH = {"rollout_num_gpus": 1, "actor_num_gpus_per_node": 1}
"""``tiny_run_flags`` overrides: one engine and one trainer rank, the least a run needs."""


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
def test_upstream_multi_turn_generate_reward_and_filter_train(ray_cluster, tiny_run_flags, tmp_path):
    """Upstream's multi-turn generate (GenerateState, post, Sample.Status.TRUNCATED), its reward
    function form and a filter from filter_hub train two rollouts."""
    train_in_process(
        tiny_run_flags(
            "--tb-dir", str(tmp_path),
            "--custom-generate-function-path",
            "tests.support.plugins.compat.upstream_multi_turn_generate.generate",
            "--custom-rm-path", "tests.support.plugins.compat.upstream_reward.reward_func",
            "--dynamic-sampling-filter-path",
            "tests.support.plugins.compat.upstream_filters.nonzero_std_logged",
            **ONE_EACH,
        )
    )  # fmt: skip
    entries = _log(tmp_path / "compat.jsonl")
    generated = [e for e in entries if e["plugin"] == "generate"]
    assert len(generated) >= 16 and all(e["semaphore"] for e in generated)  # 2 rollouts x 4 groups x 2
    assert "truncated" in {e["status"] for e in generated} <= {"completed", "truncated"}
    assert all(e["loss_mask"][1] == 0 for e in generated if len(e["loss_mask"]) == 3)  # observation masked
    assert any(e["plugin"] == "filter" and e["keep"] for e in entries)


@pytest.mark.e2e
def test_upstream_rollout_function_with_data_buffer_trains(ray_cluster, tiny_run_flags, tmp_path):
    """Upstream's rollout function (default ``generate``, ``batched_async_rm``, RolloutFnTrainOutput)
    over ``RolloutDataSourceWithBuffer``: the group it hands back is served first the next rollout."""
    train_in_process(
        tiny_run_flags(
            "--tb-dir", str(tmp_path),
            "--rollout-function-path", "tests.support.plugins.compat.upstream_rollout.generate_rollout",
            "--data-source-path", "slime.rollout.data_source.RolloutDataSourceWithBuffer",
            "--buffer-filter-path", "tests.support.plugins.compat.upstream_filters.pop_last",
            "--custom-rm-path", "tests.support.plugins.compat.upstream_reward.batched_reward", **ONE_EACH,
        )
    )  # fmt: skip
    first, second = [e for e in _log(tmp_path / "compat.jsonl") if e["plugin"] == "rollout"]
    assert second["first_group"] == first["spare"]  # the buffered group came back first
    assert first["buffered"] == second["buffered"] == 1
    assert set(first["statuses"]) <= {"completed", "truncated"}
