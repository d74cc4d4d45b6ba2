"""PPO with a critic group and GSPO with the off-policy corrections, each 2 rollouts of ``train.py``'s
``train`` in-process on the session's Ray.

One engine and one trainer rank per run (plus the critic's rank for PPO) keep them short. The harness
(flags, leak check, TensorBoard reader) is tests.support's, the data conftest's ``reverse_task``.
"""

from __future__ import annotations

import math

import pytest

from tests.support.in_process import train_in_process
from tests.support.train_runs import ONE_PER_SIDE, read_events

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_ppo_warms_up_the_critic_saves_it_and_resumes_it(ray_cluster, tiny_run_flags, tmp_path):
    """Rollout 0 trains only the critic and is saved with the actor; a resumed run loads both and trains
    both on rollout 1."""
    ckpt, tb, resumed_tb = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "tb_resumed"
    # rewards that vary (the response length) give the critic non-zero returns to fit
    extra = [
        "--custom-rm-path", "tests.support.plugins.length_reward.response_length_reward",
        "--advantage-estimator", "ppo",
        "--num-critic-only-steps", "1",
        "--critic-lr", "1e-3",
        "--value-clip", "0.5",
        "--gamma", "1.0", "--lambd", "0.95",
        "--kl-coef", "0.01",
    ]  # fmt: skip
    saving = ["--save", str(ckpt), "--save-interval", "1", "--tb-dir", str(tb)]
    train_in_process(tiny_run_flags(*extra, *saving, **ONE_PER_SIDE, num_rollout=1))
    scalars = read_events(tb)
    # the zero-initialised head values everything 0; the returns are not, so the loss is positive
    assert scalars["train/critic/values_mean"] == [(0, 0.0)]
    assert scalars["train/critic/value_loss"][0][1] > 0 and scalars["train/critic/grad_norm"][0][1] > 0
    assert scalars["train/critic/returns_mean"][0][1] > 0
    # critic-only warm-up: the policy took no step
    assert scalars["train/skipped"] == [(0, 1.0)] and "train/pg_loss" not in scalars
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert (ckpt / "critic" / "latest_checkpointed_iteration.txt").read_text() == "0"

    resume = ["--load", str(ckpt), "--tb-dir", str(resumed_tb)]
    result = train_in_process(tiny_run_flags(*extra, *resume, **ONE_PER_SIDE))
    assert "at rollout 1" in result.log
    scalars = read_events(resumed_tb)
    # a fresh critic would value everything exactly 0: this one was loaded
    values_mean = scalars["train/critic/values_mean"]
    assert [step for step, _ in values_mean] == [1] and values_mean[0][1] != 0.0
    assert math.isfinite(values_mean[0][1]) and math.isfinite(scalars["train/critic/value_loss"][0][1])
    assert [step for step, _ in scalars["train/pg_loss"]] == [1] and scalars["train/skipped"] == [(1, 0.0)]


def test_gspo_with_masked_is_and_kl_shaping(ray_cluster, tiny_run_flags, tmp_path):
    tb = tmp_path / "tb"
    extra = [
        "--advantage-estimator", "gspo",
        "--eps-clip", "3e-4", "--eps-clip-high", "4e-4",
        "--use-mis", "--mis-level", "geometric",
        "--kl-coef", "0.01", "--ref-update-interval", "1",
        "--tb-dir", str(tb),
    ]  # fmt: skip
    train_in_process(tiny_run_flags(*extra, **ONE_PER_SIDE))
    scalars = read_events(tb)
    assert [step for step, _ in scalars["train/loss"]] == [0, 1]
    assert all(math.isfinite(v) for _, v in scalars["train/loss"])
    # CPU fp32: engine and trainer agree, so nothing is masked and the mismatch is tiny
    assert all(v == 0.0 for _, v in scalars["train/mis_masked_frac"])
    assert all(abs(v - 1.0) < 1e-3 for _, v in scalars["train/mis"])
    assert all(0 <= v < 1e-4 for _, v in scalars["train/train_rollout_kl"])
    assert all(v == 0.0 for _, v in scalars["train/train_rollout_tis_clipfrac"])
    assert all(v < 1e-3 for _, v in scalars["train/train_rollout_logprob_abs_diff"])
    # old policy = the engine's log-probs: step 0's sequence ratio is 1 up to the mismatch
    assert abs(scalars["train/ppo_kl"][0][1]) < 1e-3
