"""Plugin losses and advantages through the trainer group (tiny model, CPU/gloo or one GPU)."""

from __future__ import annotations

import math

import pytest

from tests.support.trainers import make_group, sft_data, trainer_args

pytestmark = pytest.mark.e2e

EXAMPLE = "examples.custom_loss.custom_loss"


def test_example_custom_loss_and_advantages_train_one_step(ray_cluster, tiny_models):
    """The example's REINFORCE loss on its length-penalised advantages: one optimizer step, a finite
    loss, a gradient, and the metrics the custom loss returns among the step's metrics."""
    from ray.util.placement_group import remove_placement_group

    from examples.custom_loss.custom_loss import length_penalized_advantages
    from slime.cli import check_implemented

    data = sft_data(8)
    data["rewards"] = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    extra = [
        "--loss-type", "custom_loss",
        "--custom-loss-function-path", f"{EXAMPLE}.reinforce_loss",
        "--custom-advantage-function-path", f"{EXAMPLE}.length_penalized_advantages",
        "--n-samples-per-prompt", "4",
        "--rollout-batch-size", "2",
        "--global-batch-size", "8",
    ]  # fmt: skip
    args = trainer_args(tiny_models["qwen2"], extra=extra)
    check_implemented(args)  # no longer refused
    advantages = length_penalized_advantages(args, data)
    assert [len(a) for a in advantages] == [len(m) for m in data["loss_masks"]]
    assert sum(a[0] for a in advantages[:4]) == pytest.approx(0.0, abs=1e-6)  # group-mean baseline (fp32)
    group, _, pg = make_group(args)
    try:
        (step,) = group.train(data)
        assert math.isfinite(step["loss"]) and step["grad_norm"] > 0
        assert step["loss"] == pytest.approx(step["reinforce_pg_loss"])  # --entropy-coef 0
        assert "advantage_mean" in step and "entropy" in step
    finally:
        group.shutdown()
        remove_placement_group(pg)
