"""Reward functions: math answers checked by hand, text matches, custom / group / remote rm, failures."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import sys
import textwrap
from argparse import Namespace

import pytest

from slime.config.settings.rollout import RewardSettings
from slime.rollout.errors import RolloutError
from slime.rollout.rewards import (
    RewardError,
    compute_reward,
    extract_answer,
    f1_score,
    math_score,
    normalize_answer,
    score_groups,
)
from slime.rollout.rewards.failures import RewardFailureStreak
from slime.rollout.sample import Sample
from tests.support.http_servers import with_http_server


def rm_args(**overrides) -> Namespace:
    args = {"rm_type": None, "custom_rm_path": None, "group_rm": False, "rm_url": None, "reward_key": None}
    args |= {"custom_rm_model_path": None, "rm_batch_size": None, "max_failed_reward_rollouts": 3}
    return Namespace(**{**args, **overrides})


def score(args: Namespace, groups: list[list[Sample]]):
    """``score_groups`` with the reward settings of ``args`` (the reward functions get ``args``)."""
    return score_groups(args, groups, RewardSettings.from_args(args))


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"so the result is \boxed{\frac{a}{\sqrt{b}}} indeed", r"\frac{a}{\sqrt{b}}"),
        (r"\boxed{1} at first, finally \boxed{{2}+\{3\}}.", r"{2}+\{3\}"),
        ("The answer is 42.", "42."),
        ("Answer: -7\nDone", "-7"),
        ("we add 3 and 4 to get 7 apples", "7"),
        (r"<think>maybe \boxed{1}</think> it is 2", "2"),
        ("no digits here", None),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    ("response", "label"),
    [
        (r"Thus $\boxed{\dfrac{1}{2}}$.", "0.5"),
        (r"\boxed{\frac{\frac{1}{2}}{3}}", "1/6"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
        ("The answer is 42.", "42"),
        ("The answer is 42 apples.", "42"),
        (r"\boxed{-3}", "-3"),
        ("it drops by \u22125 degrees", "-5"),
        (r"\boxed{50\%}", "50"),
        ("Answer: 12%", r"12\%"),
        (r"\boxed{1,000,000}", "1000000"),
        (r"\boxed{x = 3.0}", "3"),
        ("The answer is 1.5e3", "1500"),
        (r"\boxed{\text{(B)}}", "(b)"),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)"),
        ("so 6 in total", "#### 6"),
        ("we get 2.50", r"\boxed{\frac{5}{2}}"),
    ],
)
def test_math_answers_that_match(response, label):
    assert math_score(response, label) == 1.0


@pytest.mark.parametrize(
    ("response", "label"),
    [
        (r"\boxed{2\sqrt{3}}", "3"),  # the last number of a LaTeX answer is not the answer
        ("The answer is 41.", "42"),
        (r"\boxed{-3}", "3"),
        (r"\boxed{1/0}", "1"),
        ("1e999999999", "1"),  # too large to build: not a number, and not a hang
        ("nothing", "1"),
        (r"\boxed{0.33}", "1/3"),
    ],
)
def test_math_answers_that_do_not_match(response, label):
    assert math_score(response, label) == 0.0


def test_normalize_answer_canonical_forms():
    assert normalize_answer(r" $\frac{3}{4}$ ") == "3/4"
    assert normalize_answer(r"\tfrac12") == "1/2"
    assert normalize_answer(r"90^\circ") == "90"
    assert normalize_answer("5.000") == "5"
    assert normalize_answer(r"\text{\textbf{Yes}}") == "yes"


def test_exact_and_f1_follow_squad():
    args = rm_args(rm_type="exact")
    assert run(compute_reward(args, Sample(response=" Paris \n", label="Paris"))) == 1.0
    assert run(compute_reward(args, Sample(response="paris", label="Paris"))) == 0.0
    assert f1_score("The Eiffel tower!", "eiffel tower") == 1.0
    assert f1_score("the big red dog", "a red cat") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert f1_score("", "") == 1.0 and f1_score("the", "cat") == 0.0


def test_metadata_rm_type_overrides_the_flag_and_errors_are_clear():
    sample = Sample(response=r"\boxed{4}", label="4", metadata={"rm_type": "math"})
    assert run(compute_reward(rm_args(rm_type="exact"), sample)) == 1.0
    with pytest.raises(RewardError, match="unknown --rm-type 'maths'; choose one of math, exact, f1, remote"):
        run(compute_reward(rm_args(rm_type="maths"), Sample()))
    with pytest.raises(RewardError, match="no reward function; pass --rm-type"):
        run(score(rm_args(), [[Sample()]]))


@pytest.mark.parametrize(
    ("rm_type", "response", "label", "reward"),
    [
        # DeepScaleR: only the boxed answer after the reasoning counts (upstream rm_hub/deepscaler.py).
        ("deepscaler", r"I think \boxed{3}</think>So \boxed{4}", "4", 1.0),
        ("deepscaler", r"I think \boxed{4}</think>So \boxed{3}", "4", 0.0),
        ("deepscaler", r"no reasoning marker \boxed{4}", "4", 0.0),
        ("deepscaler", r"###Response the answer is \boxed{\frac{1}{2}}", r"\boxed{0.5}", 1.0),
        ("deepscaler", r"</think>\boxed{4}", "", 0.0),
        # boxed_<type>: the type scores the last boxed answer only.
        ("boxed_exact", r"Working... \boxed{Paris}", "Paris", 1.0),
        ("boxed_exact", "Paris", "Paris", 0.0),  # no boxed answer: nothing to score
    ],
)
def test_upstream_rule_rewards_score_as_upstream_on_hand_made_cases(rm_type, response, label, reward):
    assert run(compute_reward(rm_args(rm_type=rm_type), Sample(response=response, label=label))) == reward


def test_dapo_reads_the_last_answer_line_as_an_integer_and_scores_plus_or_minus_one():
    """DAPO (upstream rm_hub/math_dapo_utils.py): the last ``Answer:`` of the last 300 characters,
    against the label as an integer; +1 / -1 with ``acc`` and ``pred``; trained with --reward-key score."""
    args = rm_args(rm_type="dapo")
    right = Sample(response="Step 1... Answer: 3\nso.\nAnswer: 42", label="42.0")
    assert run(compute_reward(args, right)) == {"score": 1.0, "acc": True, "pred": "42"}
    early = Sample(response="Answer: 42" + "x" * 300, label="42")  # outside the last 300 characters
    assert run(compute_reward(args, early)) == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    right.reward = run(compute_reward(args, right))
    assert right.reward_value("score") == 1.0  # what --reward-key score trains on


def test_an_unknown_rm_type_is_one_line_before_start(tiny_run_flags, capsys):
    from slime.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(tiny_run_flags("--rm-type", "boxed_maths", rollout_num_gpus=1))
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: --rm-type: unknown 'boxed_maths'; choose one of math, exact, f1, remote")
    assert "deepscaler, dapo" in error and "\n" not in error
    assert parse_args(tiny_run_flags("--rm-type", "boxed_math", rollout_num_gpus=1)).rm_type == "boxed_math"


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A user module on sys.path with sync, async, dict, group and failing reward functions."""
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            async def length(args, sample):
                if sample.response == "boom":
                    raise RuntimeError("judge crashed")
                return len(sample.response)

            def several(args, sample):
                return {"acc": 1.0, "len": len(sample.response)}

            async def rank(args, samples):
                order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
                return [float(order.index(i)) for i in range(len(samples))]

            def short(args, samples):
                return [1.0]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def groups_of(*responses_per_group: list[str]) -> list[list[Sample]]:
    index = iter(range(100))
    return [
        [Sample(group_index=g, index=next(index), response=r, label="1") for r in responses]
        for g, responses in enumerate(responses_per_group)
    ]


def test_custom_rm_sync_async_and_dict_with_reward_key(plugin):
    groups = groups_of(["a", "abc"], ["ab"])
    run(score(rm_args(custom_rm_path=f"{plugin}.length"), groups))
    assert [s.reward for g in groups for s in g] == [1.0, 3.0, 2.0]
    groups = groups_of(["abcd"])
    run(score(rm_args(custom_rm_path=f"{plugin}.several", reward_key="len"), groups))
    assert groups[0][0].reward == {"acc": 1.0, "len": 4} and groups[0][0].reward_value("len") == 4.0


def test_a_failing_reward_marks_only_its_sample_failed(plugin, caplog):
    groups = groups_of(["a", "boom"], ["abc"])
    with caplog.at_level(logging.WARNING):
        run(score(rm_args(custom_rm_path=f"{plugin}.length"), groups))
    failed = groups[0][1]
    assert failed.status is Sample.Status.FAILED and failed.reward == 0.0
    assert failed.metadata["reward_error"] == "RuntimeError: judge crashed"
    assert [groups[0][0].reward, groups[1][0].reward] == [1.0, 3.0]
    assert groups[0][0].status is Sample.Status.PENDING
    assert [r.getMessage() for r in caplog.records] == [
        "reward of sample 1 failed, scored 0.0: RuntimeError: judge crashed"
    ]


def test_a_dict_reward_without_reward_key_fails_the_sample(plugin):
    groups = groups_of(["a"])
    run(score(rm_args(custom_rm_path=f"{plugin}.several"), groups))
    assert groups[0][0].status is Sample.Status.FAILED
    assert "pass --reward-key" in groups[0][0].metadata["reward_error"]


def test_group_rm_scores_each_group_once_and_fails_a_group_on_a_wrong_count(plugin):
    groups = groups_of(["ccc", "a", "bb"], ["xx", "y"])
    run(score(rm_args(custom_rm_path=f"{plugin}.rank", group_rm=True), groups))
    assert [[s.reward for s in g] for g in groups] == [[2.0, 0.0, 1.0], [1.0, 0.0]]
    groups = groups_of(["a", "b"], ["c"])
    run(score(rm_args(custom_rm_path=f"{plugin}.short", group_rm=True), groups))
    assert [s.status for s in groups[0]] == [Sample.Status.FAILED] * 2
    assert "returned 1 rewards for a group of 2" in groups[0][0].metadata["reward_error"]
    assert groups[1][0].reward == 1.0 and groups[1][0].status is Sample.Status.PENDING


def test_unloadable_custom_rm_is_a_configuration_error():
    with pytest.raises(RewardError, match=r"--custom-rm-path 'no_such_module\.fn' cannot be loaded"):
        run(score(rm_args(custom_rm_path="no_such_module.fn"), groups_of(["a"])))


def test_remote_rm_posts_the_sample_and_reads_both_reply_shapes():
    from aiohttp import web

    seen = []

    async def handler(request):
        payload = await request.json()
        seen.append(payload)
        if payload["response"] == "bad":
            return web.Response(status=500, text="model exploded")
        score = float(payload["response"] == payload["label"])
        return web.json_response(score if payload["metadata"].get("plain") else {"reward": score})

    async def body(url):
        groups = [
            [
                Sample(index=0, prompt="p", response="4", label="4", metadata={"plain": True}),
                Sample(index=1, prompt="p", response="5", label="4"),
                Sample(index=2, prompt="p", response="bad", label="4"),
            ]
        ]
        await score(rm_args(rm_type="remote", rm_url=url), groups)
        return groups[0]

    samples = run(with_http_server("/reward", handler, body))
    assert seen[0] == {"prompt": "p", "response": "4", "label": "4", "metadata": {"plain": True}}
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0]
    assert samples[2].status is Sample.Status.FAILED
    assert "answered HTTP 500: model exploded" in samples[2].metadata["reward_error"]


def test_remote_rm_timeout_and_refused_connection_are_clear_errors():
    from aiohttp import web

    from slime.rollout.rewards import post_reward

    release = asyncio.Event()

    async def slow(request):
        await release.wait()
        return web.json_response(1.0)

    async def body(url):
        with pytest.raises(RewardError, match=rf"reward model {re.escape(url)} did not answer within 0\.2 s"):
            await post_reward(url, {}, timeout=0.2)
        release.set()  # let the server shut down without waiting for the handler

    run(with_http_server("/reward", slow, body))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/reward"
    with pytest.raises(RewardError, match=f"cannot reach reward model {re.escape(url)}"):
        run(post_reward(url, {}, timeout=2))


@pytest.mark.parametrize("returned", ["float('nan')", "None", "'good'", "1 / 0"])
def test_a_reward_failing_on_every_sample_stops_the_run_after_the_limit_of_rollouts_in_a_row(
    tmp_path, returned
):
    """NaN, None, a string or an exception: each rollout all FAILED counts; one good one resets."""
    (tmp_path / "broken_reward.py").write_text(f"def reward(args, sample):\n    return {returned}\n")
    path = f"{tmp_path / 'broken_reward.py'}:reward"
    args = rm_args(custom_rm_path=path, max_failed_reward_rollouts=2)
    streak = RewardFailureStreak.from_settings(RewardSettings.from_args(args))

    def rollout(rollout_id: int, *responses: str) -> None:
        groups = groups_of(list(responses))
        run(score(args, groups))
        streak.observe(rollout_id, groups)

    rollout(0, "a", "b")
    streak.observe(1, groups_of(["a"], ["b"]))  # samples not FAILED (a working reward's): the streak resets
    rollout(2, "a", "b")
    with pytest.raises(RolloutError) as stopped:
        rollout(3, "c")
    message = str(stopped.value)
    assert message.startswith(
        f"the reward function --custom-rm-path {path} failed on every sample of rollouts 2-3 "
        "(2 in a row, --max-failed-reward-rollouts 2), e.g. sample 0: "
    ), message
    assert "\n" not in message and message.endswith("under --reward-key)")


def test_max_failed_reward_rollouts_0_never_stops_and_the_function_is_named_as_it_was_chosen():
    failed = groups_of(["a"])
    failed[0][0].status = Sample.Status.FAILED
    failed[0][0].metadata["error"] = "its 600 input tokens fill the context length of 512"
    once = RewardFailureStreak.from_settings(RewardSettings(rm_type="math", max_failed_reward_rollouts=1))
    once.observe(6, failed)  # failed in generation: not the reward function's doing
    failed[0][0].metadata["reward_error"] = "ValueError: judge said\nmore"
    never = RewardFailureStreak.from_settings(RewardSettings(rm_type="math", max_failed_reward_rollouts=0))
    for rollout_id in range(5):
        never.observe(rollout_id, failed)
    with pytest.raises(RolloutError) as stopped:
        once.observe(7, failed)
    assert str(stopped.value) == (
        "the reward function --rm-type math failed on every sample of rollout 7 (1 in a row, "
        "--max-failed-reward-rollouts 1), e.g. sample 0: ValueError: judge said; fix it (it must return "
        "a finite number, or a dict holding one under --reward-key)"
    )
    failed[0][0].metadata["rm_type"] = "f1"  # the data's own choice wins over --rm-type
    with pytest.raises(
        RolloutError, match=r"^the reward function rm_type 'f1' \(of the sample's data\) failed "
    ):
        once.observe(8, failed)


@pytest.mark.e2e
def test_train_py_stops_in_one_line_when_the_reward_fails_on_every_sample(tiny_run_flags, tmp_path):
    """Before, every sample's failure was a warning and the run went on training on nothing."""
    from tests.support.train_runs import ONE_PER_SIDE, run_train

    (tmp_path / "nan_reward.py").write_text("def reward(args, sample):\n    return float('nan')\n")
    path = f"{tmp_path / 'nan_reward.py'}:reward"
    flags = tiny_run_flags(
        "--debug-rollout-only", "--max-failed-reward-rollouts", "2", "--tb-dir", str(tmp_path / "tb"),
        **(ONE_PER_SIDE | {"lr": None, "rm_type": None}), custom_rm_path=path, num_rollout=3,
    )  # fmt: skip
    result = run_train(flags, exit_code=1)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f" ERROR slime: the reward function --custom-rm-path {path} failed on every sample of " in last
    assert "of rollouts 0-1 (2 in a row, --max-failed-reward-rollouts 2), e.g. sample " in last
    assert ": RewardError: reward function returned nan for sample " in last
    assert last.endswith("; every process of the run was stopped"), last
