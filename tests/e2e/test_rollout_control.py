"""Rollout control end to end: two torch engines behind a real sglang-router, driven as in production.

- the multi-turn calculator example through a RolloutManager for 2 rollouts (prompts from the
  ``--data-source-path`` example), checked turn by turn against the tool it calls;
- dynamic sampling: a filter drops groups, the rollout stops at the target and aborts the rest, and
  no request is left on any engine;
- partial rollout: aborted samples go back with their tokens and resume, after a weight-version change,
  as the concatenation of both parts, the older part masked out of the loss.

The last two call the default rollout function in this process against the manager's router.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
import time
from pathlib import Path

import pytest
import ray
from tqdm import tqdm

from examples.multi_turn_tool.calculator import tool_reply
from slime.config import parse_args
from slime.config.eval_config import resolve_eval_set
from slime.config.settings.data import DataSettings
from slime.config.settings.rollout import RolloutSettings
from slime.engine_client import control
from slime.rollout import sglang_rollout
from slime.rollout.errors import RolloutError
from slime.rollout.evaluation import EvalSet
from slime.rollout.filters import FilterResult
from slime.rollout.generate_utils import cached_tokenizer, prompt_ids, rollout_context
from slime.rollout.sample import Sample
from slime.rollout.sglang_rollout import (
    RolloutClient,
    generate_groups,
    generate_rollout,
    sample_rollout,
    sampling_params,
)
from slime.rollout.train_data import rollout_metrics, samples_to_train_data
from slime.utils.http import post_json_sync
from tests.support.engines import engine_state
from tests.support.plugins.text_form_generate import write_chat_prompts
from tests.support.rollouts import prompt_source, rollout_parts, running_rollout_manager

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "examples/multi_turn_tool/prompts.jsonl"
PLUGINS = REPO / "tests/support/plugins/text_form_generate.py"
MULTI_TURN = [
    "--data-source-path", f"{REPO}/examples/data_plugins/arithmetic_source.py:ArithmeticSource",
    "--custom-generate-function-path", "examples.multi_turn_tool.calculator.generate",
    "--custom-rm-path", f"{REPO}/examples/multi_turn_tool/calculator.py:reward",
    "--max-turns", "3",
    "--rollout-max-response-len", "48",
]  # fmt: skip


def make_args(model: Path, *extra: str, router_url: str | None = None):
    args = parse_args(
        [
            "--hf-checkpoint", str(model),
            "--n-samples-per-prompt", "2",
            "--rollout-num-gpus", "2",
            "--rollout-backend", "torch",
            "--num-rollout", "2",
            "--debug-rollout-only",
            "--log-level", "WARNING",
            "--sglang-max-running-requests", "4",
            *extra,
        ]
    )  # fmt: skip
    if router_url is not None:
        args.sglang_router_ip, args.sglang_router_port = router_url.removeprefix("http://").split(":")
    return args


@pytest.fixture(scope="module")
def rollout(ray_cluster, tiny_models, tmp_path_factory):
    """A manager running the multi-turn example on two engines; the other tests reuse its router."""
    args = make_args(tiny_models["qwen2"], "--rollout-batch-size", "2", *MULTI_TURN)
    with running_rollout_manager(args, tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="module")
def oldest_rollout(ray_cluster, tiny_models, tmp_path_factory):
    """Two engines behind a router that speak SGLang 0.5.19's protocol (no sessions, /get_load)."""
    args = control_args(
        tiny_models["qwen2"], None, "--rollout-batch-size", "2", "--torch-engine-sglang-release", "0.5.19"
    )
    with running_rollout_manager(args, tmp_path_factory.mktemp("logs_0519")) as running:
        yield running


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` of each maximal run of equal values."""
    out, start = [], 0
    for value, items in itertools.groupby(mask):
        n = len(list(items))
        out.append((value, start, start + n))
        start += n
    return out


def test_multi_turn_example_masks_every_tool_reply_over_two_rollouts(rollout, tiny_models):
    manager, _, _ = rollout
    tokenizer = cached_tokenizer(str(tiny_models["qwen2"]))
    indices, tool_tokens = [], 0
    for rollout_id in range(2):
        data = ray.get(manager.generate.remote(rollout_id)).data
        indices += data["sample_indices"]
        keys = ("tokens", "response_lengths", "loss_masks", "rollout_log_probs")
        for tokens, n, mask, log_probs in zip(*(data[key] for key in keys), strict=True):
            assert 0 < n <= 48 and len(mask) == len(log_probs) == n
            response = tokens[-n:]
            segments = runs(mask)
            assert segments[0][0] == 1  # the model speaks first
            assert len([s for s in segments if s[0] == 1]) <= 3  # --max-turns
            for (value, start, end), previous in zip(segments, [None, *segments], strict=False):
                if value == 0:  # a tool reply: exactly what the calculator answers to the turn before it
                    model_text = tokenizer.decode(response[previous[1] : previous[2]])
                    assert tokenizer.decode(response[start:end]) == tool_reply(model_text)
                    assert log_probs[start:end] == [0.0] * (end - start)
                    tool_tokens += end - start
                else:
                    assert all(lp < 0.0 for lp in log_probs[start:end])
    assert tool_tokens > 0  # the random model never answers within one turn of 16 tokens every time
    assert indices == list(range(8))  # the example data source continued across rollouts


_seen: list[int] = []


def drop_first_two(args, group: list[Sample]) -> FilterResult:
    """A dynamic-sampling filter that drops the first two groups it sees."""
    _seen.append(group[0].group_index)
    return FilterResult(len(_seen) > 2, None if len(_seen) > 2 else "first_two")


def drop_all(args, group: list[Sample]) -> FilterResult:
    return FilterResult(False, "always")


def aborted_requests(url: str) -> int:
    return engine_state(url)["aborted_requests"]


def control_args(model: Path, router_url: str | None, *extra: str):
    return make_args(
        model,
        "--prompt-data", str(PROMPTS), "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact",
        "--rollout-max-response-len", "64",
        *extra,
        router_url=router_url,
    )  # fmt: skip


@pytest.mark.parametrize("engines", ["oldest_rollout", "rollout"])  # SGLang 0.5.19 and 0.5.23
def test_dynamic_sampling_stops_at_the_target_and_leaves_no_request_on_any_engine(
    engines, tiny_models, request
):
    _, urls, router_url = request.getfixturevalue(engines)
    args = control_args(
        tiny_models["qwen2"], router_url,
        "--rollout-batch-size", "1", "--over-sampling-batch-size", "8",
        "--dynamic-sampling-filter-path", f"{__name__}.drop_first_two",
    )  # fmt: skip
    source = prompt_source(args)
    before = sum(aborted_requests(url) for url in urls)
    _seen.clear()
    output = asyncio.run(sample_rollout(args, *rollout_parts(args), 0, source))
    assert [control.num_requests(url) for url in urls] == [0, 0]
    assert sum(aborted_requests(url) for url in urls) > before  # in-flight requests were aborted
    [group] = output.groups
    assert group[0].group_index not in _seen[:2] and all(s.finished and s.reward is not None for s in group)
    assert output.metrics["rollout/dynamic_sampling/dropped/first_two"] == 2.0
    assert output.metrics["rollout/dynamic_sampling/finished_groups"] == 3.0
    assert output.metrics["rollout/returned_groups"] == 5.0  # 8 drawn - 3 finished and filtered
    assert len(source.buffer) == 5  # without --partial-rollout they come back as fresh prompts
    for sample in (s for g in source.buffer for s in g):
        assert sample.status is Sample.Status.PENDING and sample.response_length == 0
        assert sample.loss_mask is None and sample.weight_versions == [] and sample.tokens  # prompt ids kept


def test_abort_waits_for_requests_a_paused_engine_held_and_leaves_none_running(rollout, tiny_models):
    """SGLang holds a request that reaches a paused engine before its scheduler: ``abort_all`` does not
    reach it and ``/v1/loads`` does not count it. The rollout's abort returns only once every one of
    its requests (by rid) came back, and no engine holds any request afterwards."""
    _, urls, router_url = rollout
    args = control_args(tiny_models["qwen2"], router_url, "--rollout-batch-size", "2")
    groups = prompt_source(args).get_samples(2)
    total = sum(len(group) for group in groups)

    async def scenario() -> tuple[RolloutClient, list]:
        client = RolloutClient(args, router_url, *rollout_parts(args))
        try:
            with rollout_context(client.context), tqdm(disable=True) as bar:
                for url in urls:
                    await asyncio.to_thread(post_json_sync, f"{url}/pause_generation", {"mode": "abort"})
                params = sampling_params(RolloutSettings.from_args(args).sampling)
                tasks = {asyncio.ensure_future(client.generate_group(g, params, bar)) for g in groups}
                while len(client.context.in_flight) < total:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
                held = [control.num_requests(url) for url in urls]
                resume = threading.Timer(
                    1.0, lambda: [post_json_sync(f"{url}/continue_generation", {}) for url in urls]
                )
                resume.start()
                returned = await client.abort(tasks)
                resume.join()
                return client, held, returned
        finally:
            await client.close()

    client, held, returned = asyncio.run(scenario())
    assert held == [0, 0]  # the engines' load does not see requests held by the pause
    assert len(returned) == 2 and not client.context.in_flight
    assert sum(len(group) for group in returned) == total
    time.sleep(1.0)  # nothing resurfaces: no request of the rollout is left to run
    assert [control.num_requests(url) for url in urls] == [0, 0]


def test_a_filter_that_keeps_nothing_stops_the_rollout_instead_of_drawing_forever(rollout, tiny_models):
    _, urls, router_url = rollout
    args = control_args(
        tiny_models["qwen2"], router_url,
        "--rollout-batch-size", "1", "--over-sampling-batch-size", "4",
        "--dynamic-sampling-filter-path", f"{__name__}.drop_all",
    )  # fmt: skip
    with pytest.raises(
        RolloutError, match=r"drew 80 prompt groups for a batch of 1 and kept 0: 80 dropped .*'always'"
    ):
        asyncio.run(sample_rollout(args, *rollout_parts(args), 0, prompt_source(args)))
    assert [control.num_requests(url) for url in urls] == [0, 0]


@pytest.fixture(scope="module")
def chat_prompts(tmp_path_factory) -> Path:
    return write_chat_prompts(tmp_path_factory.mktemp("chat") / "chat.jsonl")


def chat_args(model: Path, router_url: str, prompts: Path, plugin: str):
    return make_args(
        model,
        "--prompt-data", str(prompts), "--input-key", "messages", "--label-key", "label",
        "--custom-generate-function-path", f"{PLUGINS}:{plugin}",
        "--custom-rm-path", f"{PLUGINS}:first_letter_reward",
        "--rollout-batch-size", "2", "--rollout-max-response-len", "8", "--rollout-temperature", "0.7",
        router_url=router_url,
    )  # fmt: skip


def test_a_text_form_generate_is_tokenized_and_trained_without_engine_log_probs(
    rollout, tiny_models, chat_prompts
):
    _, _, router_url = rollout
    args = chat_args(tiny_models["qwen2"], router_url, chat_prompts, "text_generate")
    output = asyncio.run(sample_rollout(args, *rollout_parts(args), 0, prompt_source(args)))
    tokenizer = cached_tokenizer(DataSettings.from_args(args).tokenizer_path)
    samples = [s for group in output.groups for s in group]
    assert len(samples) == 4 and all(s.status is Sample.Status.COMPLETED for s in samples)
    for sample in samples:
        response_ids = tokenizer(sample.response, add_special_tokens=False)["input_ids"]
        assert sample.response_length == len(response_ids) > 0
        assert sample.tokens[-sample.response_length :] == response_ids
        assert sample.tokens[: sample.prompt_length] == prompt_ids(args, sample)
        assert sample.loss_mask == [1] * len(response_ids) and sample.rollout_log_probs is None
        assert sample.reward in (0.0, 1.0)
    data = samples_to_train_data(output.groups)
    assert "rollout_log_probs" not in data and data["loss_masks"] == [s.loss_mask for s in samples]
    prompts = [group[0] for group in prompt_source(args).get_samples(3)]
    eval_set = EvalSet(resolve_eval_set(args, {"name": "chat", "path": str(chat_prompts)}, "test"), prompts)
    metrics = generate_rollout(args, 0, [eval_set], evaluation=True).metrics  # before: "no reward yet"
    assert 0.0 <= metrics["eval/chat"] <= 1.0 and metrics["eval/chat/response_length"] > 0


UNFINISHED = r"kept 0: 40 came back unfinished \(samples \{'aborted': 80\}\)"


@pytest.mark.parametrize(
    ("plugin", "error"),
    [
        ("untouched_generate", r"untouched_generate returned sample \d+ still pending .*sample\.response"),
        ("aborted_generate", r"drew 40 prompt groups for a batch of 2 and " + UNFINISHED),
    ],
)
def test_a_generate_returning_unfinished_samples_stops_the_rollout_at_once(
    rollout, tiny_models, chat_prompts, plugin, error
):
    """Before, their groups were never scored and the rollout drew prompts without end."""
    _, urls, router_url = rollout
    args = chat_args(tiny_models["qwen2"], router_url, chat_prompts, plugin)
    started = time.monotonic()
    with pytest.raises(RolloutError, match=error):
        asyncio.run(sample_rollout(args, *rollout_parts(args), 0, prompt_source(args)))
    assert time.monotonic() - started < 10
    assert [control.num_requests(url) for url in urls] == [0, 0]


def test_partial_rollout_resumes_aborted_samples_as_the_concatenation_of_both_parts(rollout, tiny_models):
    _, urls, router_url = rollout
    flags = (
        "--partial-rollout", "--mask-offpolicy-in-partial-rollout",
        "--buffer-filter-path", f"{REPO}/examples/data_plugins/buffer_filters.py:most_progress_first",
    )  # fmt: skip
    over_sampling = ("--rollout-batch-size", "1", "--over-sampling-batch-size", "8")
    args = control_args(tiny_models["qwen2"], router_url, *over_sampling, *flags)
    source = prompt_source(args)  # with the buffer filter of --buffer-filter-path
    first = asyncio.run(sample_rollout(args, *rollout_parts(args), 0, source))
    assert len(first.groups) == 1 and len(source.buffer) == 7
    assert first.metrics["rollout/partial_samples_returned"] >= 1
    parts = {s.index: copy.deepcopy(s) for g in source.buffer for s in g}
    progress = {g[0].group_index: sum(s.response_length for s in g) for g in source.buffer}
    for url in urls:  # new weights: what was generated before is off-policy now
        post_json_sync(f"{url}/update_weight_version", {"new_version": "v2"})

    resume = control_args(tiny_models["qwen2"], router_url, "--rollout-batch-size", "7", *flags)
    second = asyncio.run(sample_rollout(resume, *rollout_parts(resume), 1, source))
    served = [g[0].group_index for g in second.groups]  # in the order drawn from the buffer
    assert served == sorted(progress, key=lambda i: -progress[i])  # the buffer filter's order
    masked = 0
    for sample in (s for g in second.groups for s in g):
        part = parts[sample.index]
        n1 = part.response_length
        assert sample.finished and sample.tokens[: len(part.tokens)] == part.tokens
        assert n1 <= sample.response_length <= 64
        if part.status is Sample.Status.ABORTED and n1:
            assert sample.rollout_log_probs[:n1] == part.rollout_log_probs
            assert sample.turn_spans == [(0, n1), (n1, sample.response_length)]
            assert sample.weight_versions[-1] == "v2" and sample.weight_versions[0] != "v2"
            assert sample.loss_mask == [0] * n1 + [1] * (sample.response_length - n1)
            masked += n1
    assert masked > 0 and second.metrics["rollout/offpolicy_masked_tokens"] == masked


@pytest.mark.parametrize("delay", [0.0, 600.0])
def test_a_rollout_shows_its_sample_bar_only_once_it_has_run_for_the_bar_delay(
    rollout, tiny_models, monkeypatch, capfd, delay
):
    _, _, router_url = rollout
    monkeypatch.setattr(sglang_rollout, "BAR_DELAY_S", delay)
    args = control_args(tiny_models["qwen2"], router_url, "--rollout-batch-size", "2")
    output = asyncio.run(sample_rollout(args, *rollout_parts(args), 7, prompt_source(args)))
    assert len(output.groups) == 2
    assert ("rollout 7: 100%" in capfd.readouterr().err) == (delay == 0.0)


def test_max_new_tokens_is_capped_to_the_engines_context_length(rollout, tiny_models, monkeypatch):
    """Prompts of 508 and 600 tokens on engines of context 512 with a budget of 64: before, each was
    an HTTP 400 that stopped the run. Now the first gets the tokens that fit (TRUNCATED), the
    second none (TRUNCATED without a request), and both are counted. EOS is banned until the capped
    budget (``min_new_tokens``), so that the untrained model cannot finish the first early."""
    _, urls, router_url = rollout
    assert control.context_length(urls) == 512  # GET /v1/models max_model_len
    args = control_args(tiny_models["qwen2"], router_url, "--rollout-batch-size", "2")
    tokenizer = cached_tokenizer(DataSettings.from_args(args).tokenizer_path)
    short = tokenizer("a", add_special_tokens=False)["input_ids"]
    groups = [
        [Sample(group_index=g, index=2 * g + i, tokens=short * n, label="x") for i in range(2)]
        for g, n in enumerate((508 // len(short), 600 // len(short)))
    ]
    prompt_lengths = [len(group[0].tokens) for group in groups]
    assert prompt_lengths[0] <= 508 and prompt_lengths[1] >= 512
    capped = 512 - prompt_lengths[0] - 2
    monkeypatch.setattr(
        sglang_rollout, "sampling_params", lambda *a: sampling_params(*a) | {"min_new_tokens": capped}
    )
    output = asyncio.run(generate_groups(args, *rollout_parts(args), groups, router_url))
    fitted, overlong = output
    # SGLang's scheduler keeps max_new_tokens <= context - input - 2 (init_req_max_new_tokens)
    assert all(s.response_length == capped and s.status is Sample.Status.TRUNCATED for s in fitted)
    for sample in overlong:  # no request: FAILED, on a two-token stub the trainer takes (loss mask 0)
        assert sample.status is Sample.Status.FAILED and sample.response_length == 1
        assert sample.loss_mask == [0] and sample.rollout_log_probs == [0.0] and len(sample.tokens) == 2
    assert all(sample.metadata["context_capped"] for sample in (*fitted, *overlong))
    assert rollout_metrics(output, 1.0)["rollout/context_capped_samples"] == 4.0


def test_the_dynamic_sampling_abort_leaves_an_evaluation_running_beside_alone(rollout, tiny_models):
    """As under train_async.py: the next rollout's abort, once it has kept its group, must not end the
    requests of the evaluation that runs on the same engines (before, abort_all ended them too)."""
    _, urls, router_url = rollout
    args = control_args(
        tiny_models["qwen2"], router_url,
        "--rollout-batch-size", "1", "--over-sampling-batch-size", "6", "--rollout-max-response-len", "16",
        "--eval-max-response-len", "440", "--eval-temperature", "1.0",
    )  # fmt: skip
    evaluation = [[Sample(group_index=g, index=g, prompt="abc", label="cba")] for g in range(6)]
    before = sum(aborted_requests(url) for url in urls)

    async def side_by_side():
        eval_set = resolve_eval_set(args, {"name": "beside", "path": str(PROMPTS)}, "test")
        eval_task = asyncio.ensure_future(
            generate_groups(args, *rollout_parts(args), evaluation, router_url, eval_set=eval_set)
        )
        await asyncio.sleep(0.2)  # the evaluation's requests are on the engines first
        output = await sample_rollout(args, *rollout_parts(args), 0, prompt_source(args))
        assert not eval_task.done()  # the rollout's abort happened while the evaluation generated
        return output, await eval_task

    output, evaluated = asyncio.run(side_by_side())
    assert len(output.groups) == 1 and output.metrics["rollout/returned_groups"] >= 1
    assert sum(aborted_requests(url) for url in urls) > before  # the rollout's own were aborted
    statuses = [s.status for group in evaluated for s in group]
    assert Sample.Status.ABORTED not in statuses and all(s.reward is not None for g in evaluated for s in g)
