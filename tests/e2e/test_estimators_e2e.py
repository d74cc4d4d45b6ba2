"""Estimators beyond GRPO through the trainer group (tiny model, CPU/gloo or one GPU)."""

from __future__ import annotations

import math

import pytest

from tests.support.trainers import make_group, sft_data, trainer_args

pytestmark = pytest.mark.e2e


def test_gspo_with_tis_step_zero_is_on_policy(ray_cluster, tiny_models):
    """GSPO, two steps on one rollout. Step 0: sequence ratio 1 (ppo_kl 0, no clipping), TIS weights 1
    when the engine's log-probs are the trainer's; the loss is finite and the model gets a gradient."""
    from ray.util.placement_group import remove_placement_group

    data = sft_data(8)
    data["rewards"] = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    extra = [
        "--advantage-estimator", "gspo",
        "--eps-clip", "3e-4",
        "--eps-clip-high", "4e-4",
        "--use-tis",
        "--n-samples-per-prompt", "4",
        "--rollout-batch-size", "2",
        "--global-batch-size", "4",
    ]  # fmt: skip
    group, _, pg = make_group(trainer_args(tiny_models["qwen2"], extra=extra), loss_type="policy_loss")
    try:
        data["rollout_log_probs"] = group.compute_log_probs(data)
        first, second = group.train(data)  # two optimizer steps, one group each
        assert first["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
        assert first["pg_clipfrac"] == 0.0 and first["tis_clipfrac"] == 0.0
        assert first["tis"] == pytest.approx(1.0, abs=1e-4)
        assert math.isfinite(first["loss"]) and first["grad_norm"] > 0
        # step 1 is off-policy: the sequence ratio moved beyond the tiny clip range
        assert abs(second["ppo_kl"]) > 0 and second["pg_clipfrac"] > 0 and math.isfinite(second["loss"])
    finally:
        group.shutdown()
        remove_placement_group(pg)
