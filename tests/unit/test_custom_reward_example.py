"""``examples/custom_reward/reward.py``: its scores on hand-built samples (values worked out by hand),
and the flag that uses it, ``--custom-rm-path examples/custom_reward/reward.py:partial_sort_reward``,
parsed and scored through the rollout's own reward dispatch (no Ray, no engine)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from examples.custom_reward.reward import partial_sort_reward
from examples.quickstart.make_data import make_data
from slime.config import parse_args
from slime.config.settings.rollout import RewardSettings
from slime.rollout.rewards import score_groups
from slime.rollout.sample import Sample
from tests.support.models import model_args
from tests.support.paths import REPO

PATH = "examples/custom_reward/reward.py:partial_sort_reward"


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("1359", "1359", 1.0),  # exact
        (" 1359\n", "1359", 1.0),  # surrounding whitespace does not count
        ("1358", "1359", 0.75),  # 3 of 4 positions
        ("9531", "1359", 0.0),  # every digit in the wrong place
        ("135", "1359", 0.75),  # cut short: 3 matches / 4
        ("13599", "1359", 0.8),  # one digit too many: 4 matches / 5
        ("", "1359", 0.0),
        ("0021", "0012", 0.5),
    ],
)
def test_partial_credit_by_position(response: str, label: str, expected: float) -> None:
    sample = Sample(index=0, response=response, label=label)
    assert partial_sort_reward(argparse.Namespace(), sample) == pytest.approx(expected)


def test_the_flag_parses_and_scores_through_the_rollouts_reward_dispatch(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the path is relative to the repository root, as in run.sh
    make_data(tmp_path, num_sft=1, num_train=8, num_eval=1)
    args = parse_args(
        [
            *model_args(),
            "--hf-checkpoint", str(tiny_models["qwen2"]),
            "--prompt-data", str(tmp_path / "train.jsonl"), "--input-key", "prompt", "--label-key", "label",
            "--custom-rm-path", PATH,
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--rollout-num-gpus", "1", "--debug-rollout-only", "--rollout-max-response-len", "8",
        ]
    )  # fmt: skip
    assert args.custom_rm_path == f"{REPO}/{PATH}"  # made absolute for Ray workers elsewhere
    group = [
        Sample(index=0, response="1359", label="1359"),
        Sample(index=1, response="1358", label="1359"),
    ]
    no_label = [Sample(index=2, response="12", label=None), Sample(index=3, response="12", label="12")]
    asyncio.run(score_groups(args, [group, no_label], RewardSettings.from_args(args)))
    assert [s.reward for s in group] == [1.0, 0.75]
    assert no_label[0].status == Sample.Status.FAILED and no_label[0].reward == 0.0  # raised: only it fails
    assert "no label" in no_label[0].metadata["reward_error"] and no_label[1].reward == 1.0
