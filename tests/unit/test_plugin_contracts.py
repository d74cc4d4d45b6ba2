"""Plugin contracts: every plugin flag's target is called at its real call site with the documented
arguments, both path forms load, and a wrong signature is one ``error: <flag>: ...`` line at start-up.

Also the generate helpers on a hand-built trajectory (what the loss mask must be, token by token).
No engine runs here: the generate plugins below fill responses themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from examples.multi_turn_tool.calculator import calculator, tool_reply
from slime.config.settings.data import DataSettings
from slime.config.settings.rollout import RewardSettings
from slime.rollout import plugin_args
from slime.rollout.data_source import PromptDataSource, make_data_source
from slime.rollout.filters import FilterResult, keep_varied_rewards
from slime.rollout.generate_utils import Turn, append_env_output, append_model_turn, mask_offpolicy_turns
from slime.rollout.output import RolloutOutput
from slime.rollout.rollout_function import RolloutFunction
from slime.rollout.sample import Sample
from slime.rollout.sglang_rollout import generate_groups, sample_rollout
from slime.utils.plugins import PLUGIN_CONTRACTS, PluginError, check_plugin, load_function
from tests.support.rollouts import make, prompt_source, rollout_parts

REPO = Path(__file__).resolve().parents[2]

CALLS: list[tuple[str, tuple]] = []


def model_turn(ids: list[int], version: str = "1", status: Sample.Status = Sample.Status.COMPLETED) -> Turn:
    return Turn(ids, [-0.5] * len(ids), "".join(map(str, ids)), status, version, {"type": "stop"})


# ---- plugins with the documented signatures, recording how they are called --------------------


async def recording_generate(args, sample: Sample, sampling_params: dict) -> Sample | list[Sample]:
    CALLS.append(("generate", (type(args), sample.index, sampling_params["max_new_tokens"])))
    sample.tokens = [1, 2]
    append_model_turn(sample, model_turn([3, 4 + sample.index % 2]))
    if sample.index == 0:  # a list: an extra trajectory joins the group
        extra = Sample(group_index=sample.group_index, index=100, tokens=[1, 2], label=sample.label)
        append_model_turn(extra, model_turn([9]))
        return [sample, extra]
    return sample


def recording_filter(args, group: list[Sample]) -> FilterResult | bool:
    CALLS.append(("filter", (type(args), [s.index for s in group])))
    return group[0].group_index % 2 == 1 or FilterResult(False, "even")


def recording_rollout(args, rollout_id: int, data_source, evaluation: bool) -> RolloutOutput:
    CALLS.append(("rollout", (type(args), rollout_id, type(data_source), evaluation)))
    return RolloutOutput([], {"custom/metric": 1.0})


def last_first(args, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    CALLS.append(("buffer", (type(args), len(buffer), num_groups)))
    return buffer[::-1][:num_groups]


async def two_params(args, sample):  # a generate function written for another contract
    return sample


def sync_generate(args, sample, sampling_params):
    return sample


class NoSave:
    def __init__(self, args): ...
    def get_samples(self, num_groups): ...
    def add_samples(self, groups): ...
    def load(self, rollout_id, directory): ...


class WrongLoad(NoSave):
    def save(self, rollout_id, directory): ...
    def load(self, directory): ...


def test_every_plugin_flag_has_a_contract_and_is_a_parser_flag(tiny_models, prompts):
    args = make(tiny_models, prompts)
    for flag in PLUGIN_CONTRACTS:
        assert hasattr(args, flag[2:].replace("-", "_")), flag


def test_custom_generate_and_dynamic_filter_are_called_with_the_documented_arguments(tiny_models, prompts):
    CALLS.clear()
    args = make(
        tiny_models, prompts,
        "--custom-generate-function-path", f"{__name__}.recording_generate",
        "--dynamic-sampling-filter-path", f"{__name__}.recording_filter",
        "--rollout-batch-size", "1", "--over-sampling-batch-size", "2",
    )  # fmt: skip
    output = asyncio.run(sample_rollout(args, *rollout_parts(args), 0, prompt_source(args)))
    generated = [c for name, c in CALLS if name == "generate"]
    assert generated == [(argparse.Namespace, i, 5) for i in range(4)]  # max_new_tokens from the flags
    filtered = [c for name, c in CALLS if name == "filter"]
    assert sorted(filtered) == [(argparse.Namespace, [0, 100, 1]), (argparse.Namespace, [2, 3])]
    [group] = output.groups  # group 0 is even: dropped; group 1 kept (a plain True)
    assert [s.index for s in group] == [2, 3] and [s.reward for s in group] == [1.0, 0.0]  # "34" / "35"
    assert output.metrics["rollout/dynamic_sampling/dropped/even"] == 1.0


def test_rollout_function_is_called_for_training_and_evaluation(tiny_models, prompts):
    CALLS.clear()
    args = make(tiny_models, prompts, "--rollout-function-path", f"{__name__}.recording_rollout")
    fn = RolloutFunction(args.rollout_function_path)
    output, seconds = fn(args, 3, prompt_source(args))
    fn(args, 4, {"set": []}, evaluation=True)
    assert [
        ("rollout", (argparse.Namespace, 3, PromptDataSource, False)),
        ("rollout", (argparse.Namespace, 4, dict, True)),
    ] == CALLS
    assert output.metrics == {"custom/metric": 1.0} and seconds >= 0


def test_buffer_filter_picks_the_returned_groups_served_first(tiny_models, prompts):
    CALLS.clear()
    args = make(tiny_models, prompts, "--buffer-filter-path", f"{__name__}.last_first")
    source = prompt_source(args)
    first = source.get_samples(3)
    assert CALLS == []  # an empty buffer is not filtered
    source.add_samples(first)
    served = source.get_samples(4)
    assert [("buffer", (argparse.Namespace, 3, 4))] == CALLS
    assert [g[0].group_index for g in served] == [2, 1, 0, 3] and source.buffer == []
    source.buffer_filter = lambda buffer, n: [buffer[0], buffer[0]]
    source.add_samples(served[:2])
    with pytest.raises(ValueError, match="at most that many distinct groups taken from the buffer"):
        source.get_samples(2)


def test_data_source_example_serves_takes_back_and_resumes(tiny_models, prompts, tmp_path):
    path = f"{REPO}/examples/data_plugins/arithmetic_source.py:ArithmeticSource"
    args = make(tiny_models, prompts, "--data-source-path", path)
    source = make_data_source(DataSettings.from_args(args), args)
    groups = source.get_samples(2)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    assert all(s.prompt.startswith("What is ") and s.label.lstrip("-").isdigit() for g in groups for s in g)
    source.add_samples(groups[1:])
    source.save(0, tmp_path)
    expected = source.get_samples(2)
    resumed = make_data_source(DataSettings.from_args(args), args)
    assert resumed.load(0, tmp_path) and not resumed.load(1, tmp_path)
    again = resumed.get_samples(2)
    assert [[s.to_dict() for s in g] for g in again] == [[s.to_dict() for s in g] for g in expected]
    assert again[0][0].index == 2  # the returned group first, then new prompts


def test_a_relative_file_path_is_made_absolute_for_workers_elsewhere(tiny_models, prompts, monkeypatch):
    monkeypatch.chdir(REPO)
    args = make(
        tiny_models,
        prompts,
        "--buffer-filter-path",
        "examples/data_plugins/buffer_filters.py:most_progress_first",
    )
    assert args.buffer_filter_path == f"{REPO}/examples/data_plugins/buffer_filters.py:most_progress_first"


def test_plugin_paths_load_in_both_forms_and_fail_in_one_line(tmp_path):
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text("def score(args, sample):\n    return 1.0\n")
    assert load_function(f"{plugin}:score")(None, None) == 1.0
    assert load_function("examples.multi_turn_tool.calculator.calculator") is calculator
    for path, text in [
        (f"{tmp_path}/missing.py:score", "does not exist"),
        (f"{plugin}:nope", "has no attribute 'nope'"),
        ("nodots", "not a dotted path module.attr or a file path file.py:attr"),
    ]:
        with pytest.raises(PluginError, match=text):
            load_function(path)


@pytest.mark.parametrize(
    ("flag", "target", "text"),
    [
        ("--custom-generate-function-path", "two_params", "does not take (args, sample, sampling_params)"),
        ("--custom-generate-function-path", "sync_generate", "is not an async function"),
        ("--dynamic-sampling-filter-path", "two_params", "is an async function, but slime calls it directly"),
        ("--dynamic-sampling-filter-path", "last_first", "expected fn(args, group) -> FilterResult | bool"),
        ("--rollout-function-path", "last_first", "take (args, rollout_id, data_source, evaluation)"),
        ("--buffer-filter-path", "recording_filter", "does not take (args, buffer, num_groups)"),
        ("--custom-loss-function-path", "recording_filter", "take (args, batch, log_probs, entropy)"),
        ("--custom-advantage-function-path", "last_first", "does not take (args, data)"),
        ("--custom-rm-path", "last_first", "does not take (args, sample_or_group)"),
        ("--data-source-path", "recording_filter", "not a class"),
        ("--data-source-path", "NoSave", "has no method save"),
        ("--data-source-path", "WrongLoad", "load(self, directory) does not take (rollout_id, directory)"),
    ],
)
def test_wrong_signature_is_one_error_line_before_anything_starts(
    tiny_models, prompts, capsys, flag, target, text
):
    with pytest.raises(SystemExit) as exc:
        make(tiny_models, prompts, flag, f"{__name__}.{target}")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag}: {__name__}.{target}"), err
    assert text in err, err


def test_every_documented_signature_passes_its_own_check():
    documented = {
        "--custom-generate-function-path": "recording_generate",
        "--dynamic-sampling-filter-path": "recording_filter",
        "--rollout-function-path": "recording_rollout",
        "--buffer-filter-path": "last_first",
    }
    for flag, name in documented.items():
        assert check_plugin(flag, f"{__name__}.{name}") is globals()[name]
    source = "examples/data_plugins/arithmetic_source.py:ArithmeticSource"
    assert check_plugin("--data-source-path", source).__name__ == "ArithmeticSource"


def test_rollout_control_flags_are_checked(tiny_models, prompts, capsys):
    for extra, flag in [
        (["--mask-offpolicy-in-partial-rollout"], "--mask-offpolicy-in-partial-rollout"),
        (["--max-turns", "0"], "--max-turns"),
    ]:
        with pytest.raises(SystemExit):
            make(tiny_models, prompts, *extra)
        assert capsys.readouterr().err.startswith(f"error: {flag}: ")


# ---- the generate helpers on a known trajectory --------------------------------------------------


def test_model_and_tool_tokens_on_a_known_trajectory():
    sample = Sample(index=0, tokens=[1, 2])  # prompt [1, 2]
    append_model_turn(sample, model_turn([5, 6], version="1"))
    append_env_output(sample, [7, 8, 9], "<r>")
    append_model_turn(sample, model_turn([10], version="2", status=Sample.Status.ABORTED))
    assert sample.tokens == [1, 2, 5, 6, 7, 8, 9, 10] and sample.prompt_length == 2
    assert sample.response_length == 6 and sample.response == "56<r>10"
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5]
    assert sample.weight_versions == ["1", "2"] and sample.turn_spans == [(0, 2), (5, 6)]
    assert sample.status is Sample.Status.ABORTED and not sample.finished
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample
    append_model_turn(sample, model_turn([], version="3", status=Sample.Status.ABORTED))  # nothing sampled
    assert sample.turn_spans == [(0, 2), (5, 6)]
    assert mask_offpolicy_turns(sample) == 2  # the version-1 turn; tool tokens were never trained on
    assert sample.loss_mask == [0, 0, 0, 0, 0, 1]
    sample.reset_response()
    assert sample.tokens == [1, 2] and sample.loss_mask is None and sample.status is Sample.Status.PENDING
    assert (sample.response_length, sample.weight_versions, sample.turn_spans) == (0, [], [])


def test_keep_varied_rewards_drops_groups_whose_rewards_all_agree():
    args = argparse.Namespace()
    plugin_args.bind(args, RewardSettings(reward_key=None))
    assert keep_varied_rewards(args, [Sample(reward=1.0), Sample(reward=1.0)]) == FilterResult(
        False, "rewards_all_equal"
    )
    assert keep_varied_rewards(args, [Sample(reward=0.0), Sample(reward=1.0)]).keep
    # A sample whose reward function raised (reward 0.0 as a placeholder) varies nothing.
    failed = Sample(reward=0.0, status=Sample.Status.FAILED)
    assert not keep_varied_rewards(args, [Sample(reward=1.0), Sample(reward=1.0), failed]).keep
    assert not keep_varied_rewards(args, [Sample(reward=1.0), failed]).keep


def test_calculator_tool_evaluates_arithmetic_only():
    assert calculator("2*(3+4)") == "14" and calculator("7/2") == "3.5" and calculator("-3") == "-3"
    assert calculator("__import__('os')") == "error" and calculator("1/0") == "error"
    assert tool_reply("x <calc>6*7</calc>") == "\n<result>42</result>\n"
    assert tool_reply("no call") == "\n<result>none</result>\n"


def test_generate_groups_keeps_the_order_and_the_extra_samples_a_generate_function_returns(
    tiny_models, prompts
):
    args = make(tiny_models, prompts, "--custom-generate-function-path", f"{__name__}.recording_generate")
    groups = [[Sample(group_index=g, index=2 * g + i, label="34") for i in range(2)] for g in range(2)]
    done = asyncio.run(generate_groups(args, *rollout_parts(args), groups, "http://127.0.0.1:9"))
    assert [[s.index for s in g] for g in done] == [[0, 100, 1], [2, 3]]
    assert all(s.reward is not None for g in done for s in g)
