"""The usage guide's plugin forms run unchanged (issue 33, items 1-3).

- A bare ``file.py`` names the conventional attribute of its flag (generate: ``custom_generate``,
  then ``generate``; reward: ``reward_func``, then ``CustomRewardModel``); a failed lookup names
  what it tried, in one line before anything starts.
- The guide's generate ``async def custom_generate(args, samples, evaluation=False)`` gets the whole
  prompt group; a reward it sets is kept, text responses are tokenized.
- The guide's ``class CustomRewardModel(model_path)`` with ``compute_reward(prompts, responses)``:
  built once per process from ``--custom-rm-model-path``, called once per group.

The plugins in the guide's forms are ``tests/support/plugins/compat/guide_generate.py`` and
``tests/support/plugins/compat/guide_reward_model.py``; the last test trains 2 rollouts with both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from slime.config import parse_args
from slime.config.settings.rollout import RewardSettings
from slime.rollout.generate_utils import rollout_context
from slime.rollout.rewards import score_groups
from slime.rollout.rewards.scoring import reward_model
from slime.rollout.sample import Sample
from slime.rollout.sampling import sampling_params
from slime.rollout.sglang_rollout import RolloutClient, generate_groups
from slime.utils.plugins import load_function
from tests.support.configs import base, expect_error, make_hf
from tests.support.in_process import train_in_process
from tests.support.rollouts import make, rollout_parts
from tests.support.train_runs import ONE_PER_SIDE, read_events

REPO = Path(__file__).resolve().parents[2]
GUIDE_GENERATE = REPO / "tests/support/plugins/compat/guide_generate.py"
GUIDE_REWARD_MODEL = REPO / "tests/support/plugins/compat/guide_reward_model.py"
GENERATE, REWARD = "--custom-generate-function-path", "--custom-rm-path"
DOTTED_REWARD = "tests.support.plugins.text_form_generate.first_letter_reward"


@pytest.fixture
def hf(tmp_path: Path) -> str:
    return make_hf(tmp_path)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A ``model_path`` for the guide's reward model: its "weights" and the log of its calls."""
    path = tmp_path / "rm"
    path.mkdir()
    (path / "weights.json").write_text(json.dumps({"weight": 0.5}))
    return path


def plugin_file(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


# ---- (a) resolution and refusals, before anything starts ---------------------------------------

GENERATE_BOTH = """
async def custom_generate(args, samples, evaluation=False):
    return samples

async def generate(args, sample, sampling_params):
    return sample
"""
REWARD_BOTH = """
def reward_func(args, sample):
    return 1.0

class CustomRewardModel:
    def __init__(self, model_path): ...
    def compute_reward(self, prompts, responses): ...
"""


def test_a_bare_file_resolves_to_the_conventional_name_of_its_kind(hf, tmp_path, model_dir):
    both = plugin_file(tmp_path, "both.py", GENERATE_BOTH)
    only_generate = plugin_file(
        tmp_path, "only.py", "async def generate(args, sample, sampling_params): ...\n"
    )
    rewards = plugin_file(tmp_path, "rewards.py", REWARD_BOTH)
    args = parse_args(base(hf, GENERATE, str(both), REWARD, str(rewards)))
    assert args.custom_generate_function_path == f"{both}:custom_generate"  # first of the two names
    assert args.custom_rm_path == f"{rewards}:reward_func"
    rm_flags = (REWARD, str(GUIDE_REWARD_MODEL), "--custom-rm-model-path", str(model_dir))
    args = parse_args(base(hf, GENERATE, str(only_generate), *rm_flags))
    assert args.custom_generate_function_path == f"{only_generate}:generate"
    assert args.custom_rm_path == f"{GUIDE_REWARD_MODEL}:CustomRewardModel"
    # The explicit forms keep working, and name what they name.
    args = parse_args(base(hf, GENERATE, f"{both}:generate", REWARD, DOTTED_REWARD))
    assert args.custom_generate_function_path == f"{both}:generate"
    assert args.custom_rm_path == DOTTED_REWARD


def test_a_relative_bare_file_is_made_absolute(hf, monkeypatch):
    monkeypatch.chdir(REPO)
    args = parse_args(base(hf, GENERATE, "tests/support/plugins/compat/guide_generate.py"))
    assert args.custom_generate_function_path == f"{GUIDE_GENERATE}:custom_generate"


@pytest.mark.parametrize(
    ("flag", "text"),
    [
        (GENERATE, "defines none of custom_generate, generate (the names a bare file is looked up by)"),
        (REWARD, "defines none of reward_func, CustomRewardModel (the names a bare file is looked up by)"),
        ("--buffer-filter-path", "names a file but no function in it; write"),
    ],
)
def test_a_failed_lookup_names_the_names_it_tried(hf, tmp_path, capsys, flag, text):
    other = plugin_file(tmp_path, "other.py", "def something(args, sample): ...\n")
    err = expect_error(capsys, base(hf, flag, str(other)), flag)
    assert text in err, err


def test_the_reward_model_class_without_its_model_path_is_refused_naming_the_flag(hf, capsys):
    err = expect_error(capsys, base(hf, REWARD, str(GUIDE_REWARD_MODEL)), "--custom-rm-model-path")
    assert "CustomRewardModel" in err and "model_path" in err, err


@pytest.mark.parametrize(("flag", "value"), [("--custom-rm-model-path", "/m"), ("--rm-batch-size", "2")])
def test_reward_model_flags_without_a_reward_model_class_are_refused(hf, capsys, flag, value):
    err = expect_error(capsys, base(hf, REWARD, DOTTED_REWARD, flag, value), flag)
    assert "counts only with a reward-model class" in err, err


@pytest.mark.parametrize(
    ("source", "text"),
    [
        (
            "def custom_generate(args, samples, evaluation=False): ...\n",
            "takes samples but is not async fn(args, samples",
        ),
        (
            "class CustomRewardModel:\n    def __init__(self, model_path): ...\n",
            "has no method compute_reward",
        ),
        (
            "class CustomRewardModel:\n    def __init__(self, path): ...\n"
            "    def compute_reward(self, prompts): ...\n",
            "compute_reward(self, prompts) does not take (prompts, responses)",
        ),
    ],
)
def test_a_guide_form_written_wrong_is_one_line(hf, tmp_path, capsys, source, text):
    path = plugin_file(tmp_path, "wrong.py", source)
    flag = REWARD if "class" in source else GENERATE
    err = expect_error(capsys, base(hf, flag, str(path), "--custom-rm-model-path", "/m"), flag)
    assert text in err, err


# ---- (a) the guide's generate and reward model at their call sites, no engine --------------------

GROUP_GENERATE = """
CALLS = []

async def custom_generate(args, samples: list, evaluation=False):
    CALLS.append(([s.index for s in samples], evaluation))
    for sample in samples:
        sample.response = "34" if sample.index % 2 == 0 else "12"
        if sample.response == sample.label:
            sample.reward = 1.0  # scored here: the reward function must not be called for it
    return samples
"""
RECORDING_REWARD = """
SEEN = []

def reward_func(args, sample):
    SEEN.append(sample.index)
    return 0.25
"""


def test_the_guide_generate_gets_each_group_once_and_its_rewards_are_kept(tiny_models, prompts, tmp_path):
    generate = plugin_file(tmp_path, "group_generate.py", GROUP_GENERATE)
    reward = plugin_file(tmp_path, "recording_reward.py", RECORDING_REWARD)
    args = make(tiny_models, prompts, GENERATE, str(generate), REWARD, str(reward))
    groups = [
        [Sample(group_index=g, index=2 * g + i, prompt=f"q{g}", label="34") for i in range(2)]
        for g in range(2)
    ]
    done = asyncio.run(generate_groups(args, *rollout_parts(args), groups, "http://127.0.0.1:9"))
    calls = sys.modules[load_function(f"{generate}:custom_generate").__module__].CALLS
    seen = sys.modules[load_function(f"{reward}:reward_func").__module__].SEEN
    assert sorted(calls) == [([0, 1], False), ([2, 3], False)]  # one call per group, training
    assert [[s.reward for s in g] for g in done] == [[1.0, 0.25], [1.0, 0.25]]
    assert sorted(seen) == [1, 3]  # only the samples the generate left unscored
    for sample in (s for g in done for s in g):  # the text form, completed: tokens, mask, status
        assert sample.status is Sample.Status.COMPLETED and sample.response_length > 0
        assert sample.loss_mask == [1] * sample.response_length and sample.rollout_log_probs is None

    async def evaluate() -> None:
        client = RolloutClient(args, "http://127.0.0.1:9", *rollout_parts(args), evaluation=True)
        with rollout_context(client.context), tqdm(disable=True) as bar:
            await client.generate_group(
                [Sample(index=9, prompt="q", label="34")],
                sampling_params(rollout_parts(args)[0].sampling),
                bar,
            )
        await client.close()

    asyncio.run(evaluate())
    assert calls[-1] == ([9], True)


def test_a_group_generate_that_leaves_samples_pending_stops_the_rollout_in_one_line(
    tiny_models, prompts, tmp_path
):
    from slime.rollout.errors import RolloutError

    generate = plugin_file(
        tmp_path, "lazy.py", "async def custom_generate(args, samples):\n    return samples\n"
    )
    args = make(tiny_models, prompts, GENERATE, str(generate))
    groups = [[Sample(group_index=0, index=i, prompt="q", label="34") for i in range(2)]]
    with pytest.raises(RolloutError, match=r"lazy.py:custom_generate returned sample 0 still pending") as e:
        asyncio.run(generate_groups(args, *rollout_parts(args), groups, "http://127.0.0.1:9"))
    assert "\n" not in str(e.value)


ASYNC_MODEL = """
class CustomRewardModel:
    built = 0

    def __init__(self, model_path):
        CustomRewardModel.built += 1
        self.calls = []

    async def compute_reward(self, prompts, responses):
        self.calls.append(list(prompts))
        return [len(r) for r in responses]


class WrongCount(CustomRewardModel):
    def compute_reward(self, prompts, responses):
        return [1.0]


class NotANumber(CustomRewardModel):
    def compute_reward(self, prompts, responses):
        return ["good"] * len(responses)
"""


def reward_args(path: str, rm_batch_size: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        rm_type=None,
        custom_rm_path=path,
        group_rm=False,
        reward_key=None,
        custom_rm_model_path="/m",
        rm_batch_size=rm_batch_size,
        rm_url=None,
        max_failed_reward_rollouts=3,
    )


def score(args: argparse.Namespace, groups: list[list[Sample]]):
    """``score_groups`` with the reward settings of ``args`` (the reward functions get ``args``)."""
    return score_groups(args, groups, RewardSettings.from_args(args))


def group_of(group_index: int, *responses: str) -> list[Sample]:
    return [
        Sample(group_index=group_index, index=10 * group_index + i, prompt=f"p{group_index}", response=r)
        for i, r in enumerate(responses)
    ]


def test_the_reward_model_class_is_built_once_and_called_per_group(tmp_path, model_dir):
    models = plugin_file(tmp_path, "models.py", ASYNC_MODEL)
    args = reward_args(f"{models}:CustomRewardModel")
    groups = [group_of(0, "a", "bb"), group_of(1, "ccc", "dddd", "e")]
    groups[1][2].reward = 7.0  # set by the generate function: kept, not sent to the model
    asyncio.run(score(args, groups))
    asyncio.run(score(args, [group_of(2, "ff")]))
    model = reward_model(args.custom_rm_path, "/m")
    assert type(model).built == 1  # once per process, however many rollouts
    assert model.calls == [["p0", "p0"], ["p1", "p1"], ["p2"]]
    assert [[s.reward for s in g] for g in groups] == [[1.0, 2.0], [3.0, 4.0, 7.0]]
    model.calls.clear()
    asyncio.run(score(reward_args(args.custom_rm_path, rm_batch_size=2), [group_of(3, *"abcde")]))
    assert model.calls == [["p3", "p3"], ["p3", "p3"], ["p3"]]  # --rm-batch-size 2

    # The guide's own (sync) class, from its model_path: called on a worker thread.
    args = argparse.Namespace(**{**vars(args), "custom_rm_path": f"{GUIDE_REWARD_MODEL}:CustomRewardModel"})
    args.custom_rm_model_path = str(model_dir)
    group = group_of(0, "ab", "abcdef")
    asyncio.run(score(args, [group]))
    assert [s.reward for s in group] == [0.25, 0.5]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("WrongCount", "WrongCount.compute_reward returned 1 rewards for a group of 2"),
        ("NotANumber", "NotANumber.compute_reward returned 'good'; expected a number per response"),
    ],
)
def test_a_reward_model_answering_wrong_fails_its_group_naming_the_class(tmp_path, caplog, name, text):
    models = plugin_file(tmp_path, "models.py", ASYNC_MODEL)
    group = group_of(0, "a", "b")
    asyncio.run(score(reward_args(f"{models}:{name}"), [group]))
    assert all(s.status is Sample.Status.FAILED and s.reward == 0.0 for s in group)
    assert text in group[0].metadata["reward_error"]
    (line,) = [r.getMessage() for r in caplog.records if "reward of" in r.getMessage()]
    assert text in line and "\n" not in line


# ---- (b) the guide's plugins through train.py --------------------------------------------------


@pytest.mark.e2e
def test_the_guide_generate_and_reward_model_train_two_rollouts(
    ray_cluster, tiny_run_flags, tmp_path, model_dir
):
    """The guide's generate as a bare relative file and its reward-model class: 2 rollouts train.
    Before, the bare file was read as a dotted path (exit 2), the group form got one Sample
    (``TypeError: 'Sample' object is not iterable``) and the class was refused."""
    tb = tmp_path / "tb"
    flags = tiny_run_flags(
        "--tb-dir", str(tb),
        GENERATE, "tests/support/plugins/compat/guide_generate.py",
        REWARD, "tests/support/plugins/compat/guide_reward_model.py",
        "--custom-rm-model-path", str(model_dir),
        **ONE_PER_SIDE, rm_type=None,
    )  # fmt: skip
    train_in_process(flags)
    scalars = read_events(tb)
    assert [step for step, _ in scalars["train/loss"]] == [0, 1]
    records = [json.loads(line) for line in (model_dir / "calls.jsonl").read_text().splitlines()]
    inits = [r for r in records if r["event"] == "init"]
    calls = [r for r in records if r["event"] == "compute_reward"]
    assert len(inits) == len({r["pid"] for r in records}) == 1  # one rollout process, built once
    n_per_prompt = ONE_PER_SIDE["n_samples_per_prompt"]
    assert calls and all(1 <= c["prompts"] == c["responses"] <= n_per_prompt for c in calls)
    assert len(calls) <= 2 * 4  # at most once per prompt group: 2 rollouts of 4 groups
