"""Evaluation metrics of scored sets (means, pass@k, their intervals) and the per-sample JSONL.

Every expected number is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import json

import pytest

from slime.config.settings.eval import EvalSettings
from slime.rollout.evaluation import eval_metrics, eval_output_dir, write_eval_samples
from slime.rollout.sample import Sample


def group(rewards: list[float], label: str = "x", truncated: int = 0) -> list[Sample]:
    return [
        Sample(
            reward=reward,
            response=f"r{i}",
            response_length=2 + i,
            label=label,
            status=Sample.Status.TRUNCATED if i < truncated else Sample.Status.COMPLETED,
            weight_versions=["3"],
        )
        for i, reward in enumerate(rewards)
    ]


def test_eval_metrics_average_prompts_first_and_put_intervals_on_mean_and_pass_at_k() -> None:
    # Three prompts of n = 4: correct counts 0, 2, 4, so per-prompt means 0, 0.5, 1 and pass@2 0, 5/6, 1.
    groups = [group([0, 0, 0, 0]), group([1, 0, 1, 0], truncated=1), group([1, 1, 1, 1])]
    metrics = eval_metrics("math", groups, pass_threshold=1.0)
    # mean 0.5; variance (0.25 + 0 + 0.25) / 2 = 0.25, standard error 0.5 / sqrt(3) = 0.288675,
    # half width 4.302653 × 0.288675 = 1.242069.
    assert metrics["eval/math"] == pytest.approx(0.5)
    assert metrics["eval/math/ci_low"] == pytest.approx(0.5 - 1.242069, abs=1e-6)
    assert metrics["eval/math/ci_high"] == pytest.approx(0.5 + 1.242069, abs=1e-6)
    assert metrics["eval/math/response_length"] == (2 + 3 + 4 + 5) / 4  # the same lengths in every group
    assert metrics["eval/math/truncated_ratio"] == 1 / 12
    assert metrics["eval/math-pass@1"] == pytest.approx(0.5)
    assert metrics["eval/math-pass@2"] == pytest.approx((0 + 5 / 6 + 1) / 3)
    assert metrics["eval/math-pass@4"] == pytest.approx((0 + 1 + 1) / 3)
    # pass@4 per prompt 0, 1, 1: mean 2/3, the interval of [0, 1, 1] above, cut to [0, 1].
    assert metrics["eval/math-pass@4/ci_low"] == 0.0 and metrics["eval/math-pass@4/ci_high"] == 1.0
    assert {key for key in metrics if key.startswith("eval/math-pass@")} == {
        f"eval/math-pass@{k}{end}" for k in (1, 2, 4) for end in ("", "/ci_low", "/ci_high")
    }


def test_pass_at_k_counts_rewards_at_or_above_the_threshold() -> None:
    groups = [group([0.4, 0.5]), group([0.6, 0.2])]
    metrics = eval_metrics("s", groups, pass_threshold=0.5)
    assert metrics["eval/s-pass@1"] == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert metrics["eval/s-pass@2"] == 1.0
    assert "eval/s-pass@1" not in eval_metrics("s", groups)  # without --log-passrate


def test_a_one_prompt_set_has_its_mean_but_no_interval() -> None:
    assert eval_metrics("one", [group([1, 0])]) == {
        "eval/one": 0.5,
        "eval/one/response_length": 2.5,
        "eval/one/truncated_ratio": 0.0,
    }


def test_eval_samples_are_one_jsonl_line_each(tmp_path) -> None:
    path = tmp_path / "eval" / "rollout_7.jsonl"
    eval_groups = {"a": [group([1.0, 0.0], label="L")], "b": [group([0.5]), group([0.25])]}
    assert write_eval_samples(path, 7, eval_groups) == 4
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["set"], r["prompt_index"], r["sample_index"], r["reward"]) for r in rows] == [
        ("a", 0, 0, 1.0), ("a", 0, 1, 0.0), ("b", 0, 0, 0.5), ("b", 1, 0, 0.25),
    ]  # fmt: skip
    assert rows[1] == {
        "set": "a", "rollout_id": 7, "prompt_index": 0, "sample_index": 1, "weight_versions": ["3"],
        "reward": 0.0, "raw_reward": 0.0, "status": "completed", "response_length": 3, "label": "L",
        "response": "r1",
    }  # fmt: skip


def test_eval_output_goes_to_the_flag_else_next_to_the_checkpoints_else_the_log_dir() -> None:
    def where(output_dir: str | None, save: str | None) -> str:
        return str(eval_output_dir(EvalSettings(output_dir=output_dir, save=save), "/logs"))

    assert where("/out", "/ckpt") == "/out"
    assert where(None, "/ckpt") == "/ckpt/eval"
    assert where(None, None) == "/logs/eval"
