"""Advantages, the policy losses and the KL estimators against values computed by hand."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from slime.algorithms.advantages import (
    gae,
    group_normalized_rewards,
    kl_shaped_rewards,
    masked_whiten,
    outcome_advantages,
    ppo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_returns,
)
from slime.algorithms.aggregation import weighted_token_sum
from slime.algorithms.kl import kl_estimate
from slime.algorithms.losses import (
    cispo_loss,
    clipped_value_loss,
    gspo_loss,
    ppo_clip_loss,
    truncated_is_weights,
)
from slime.algorithms.mismatch import masked_is_weights, mismatch_token_metrics, per_scored_token
from slime.backends.megatron.batching import MicroBatch
from slime.backends.megatron.loss import make_policy_loss_fn, make_value_loss_fn, old_log_probs_are_current
from slime.cli import check_implemented
from slime.config.derive import fill_algorithm
from slime.config.settings.trainer import TrainerSettings
from slime.config.validate import ConfigError, _check_critic, _check_off_policy_corrections
from tests.support.trainers import bare_settings


def test_grpo_normalises_each_group_by_its_mean_and_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_normalized_rewards(rewards, 4)
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: all equal -> 0
    expected = 0.5 / math.sqrt(1 / 3)
    assert adv[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-5)
    assert adv[4:].tolist() == [0.0] * 4


def test_dr_grpo_only_centres_and_broadcasts_to_every_token():
    adv = outcome_advantages([3.0, 1.0], [2, 3], 2, estimator="dr_grpo")
    assert [a.tolist() for a in adv] == [[1.0, 1.0], [-1.0, -1.0, -1.0]]


def test_uneven_groups_are_rejected():
    with pytest.raises(ValueError, match="groups of 4"):
        group_normalized_rewards(torch.zeros(6), 4)


def test_ppo_clip_on_policy_has_zero_kl_and_no_clipping():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, clipped, kl = ppo_clip_loss(logp, logp.clone(), adv, 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-1.0, 1.0, -2.0])
    assert clipped.sum().item() == 0 and kl.abs().max().item() == 0


def test_ppo_clip_uses_asymmetric_bounds():
    old = torch.zeros(2)
    new = torch.log(torch.tensor([1.5, 0.5]))  # ratios 1.5 and 0.5
    adv = torch.tensor([1.0, -1.0])
    loss, clipped, _ = ppo_clip_loss(new, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    # ratio 1.5, A>0: min(1.5, 1.28) = 1.28; ratio 0.5, A<0: min(-0.5, -0.8) = -0.8
    assert loss.tolist() == pytest.approx([-1.28, 0.8])
    assert clipped.tolist() == [1.0, 1.0]


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    r = 2.0  # pi / pi_ref
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(math.log(r))
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(r) ** 2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(1 / r - 1 + math.log(r))
    assert kl_estimate(logp, logp, "low_var_kl").item() == 0.0


def test_low_var_kl_stays_finite_for_extreme_log_ratios():
    logp = torch.tensor([50.0, -50.0])
    value = kl_estimate(logp, torch.zeros(2), "low_var_kl")
    assert torch.isfinite(value).all() and value.abs().max().item() <= 10.0


def test_rloo_subtracts_the_mean_of_the_other_samples_of_the_group():
    adv = outcome_advantages([3.0, 1.0, 2.0, 6.0, 5.0, 5.0, 5.0, 5.0], [1] * 8, 4, "rloo")
    # 3 - (1+2+6)/3 = 0, 1 - 11/3, 2 - 10/3, 6 - 6/3; the second group is all equal
    expected = [0.0, 1 - 11 / 3, 2 - 10 / 3, 4.0, 0.0, 0.0, 0.0, 0.0]
    assert [a.item() for a in adv] == pytest.approx(expected, abs=1e-6)


def test_rloo_refuses_groups_of_one():
    with pytest.raises(ValueError, match="n-samples-per-prompt"):
        outcome_advantages([1.0, 2.0], [1, 1], 1, "rloo")


def test_gspo_and_cispo_advantages_are_grpos():
    for estimator in ("gspo", "cispo"):
        adv = outcome_advantages([1.0, 0.0], [2, 1], 2, estimator)
        expected = 0.5 / math.sqrt(0.5)  # unbiased std of (1, 0)
        assert torch.cat(adv).tolist() == pytest.approx([expected, expected, -expected], rel=1e-5)


def test_reinforce_plus_plus_baseline_whitens_centred_rewards_over_unmasked_tokens():
    adv = outcome_advantages(
        [1.0, 0.0, 2.0, 2.0],
        [1, 2, 1, 1],
        2,
        "reinforce_plus_plus_baseline",
        loss_masks=[[1], [1, 0], [1], [1]],
    )
    # tokens (0.5), (-0.5, masked -0.5), (0), (0): unmasked mean 0, unbiased var 0.5 / 3
    scale = 1 / math.sqrt(0.5 / 3)
    assert [len(a) for a in adv] == [1, 2, 1, 1]
    assert torch.cat(adv).tolist() == pytest.approx([0.5 * scale, -0.5 * scale, -0.5 * scale, 0, 0], rel=1e-5)


def test_masked_whiten_uses_the_moments_summed_over_ranks():
    values, masks = [torch.tensor([1.0, 2.0, 7.0])], [torch.tensor([1.0, 1.0, 0.0])]
    # a second rank holding the same share: reduce doubles the moments
    sharded = masked_whiten(values, masks, reduce=lambda m: 2 * m)[0]
    whole = masked_whiten(values * 2, masks * 2)[0]
    assert sharded.tolist() == pytest.approx(whole.tolist())
    # unmasked tokens 1, 2, 1, 2: mean 1.5, unbiased var 1/3; the masked 7 is shifted alike
    assert sharded.tolist() == pytest.approx([(v - 1.5) * math.sqrt(3) for v in (1, 2, 7)], rel=1e-5)


def test_reinforce_plus_plus_returns_discount_kl_penalties_and_the_outcome():
    returns = reinforce_plus_plus_returns(
        1.0,
        log_probs=torch.tensor([-1.0, -1.0, -2.0]),
        ref_log_probs=torch.tensor([-1.5, -1.0, -1.0]),
        loss_mask=torch.tensor([1.0, 1.0, 0.0]),
        kl_coef=0.1,
        gamma=0.5,
    )
    # k1 = (0.5, 0, -1); rewards (-0.05, 0 + outcome 1 on the last unmasked token, masked 0)
    assert returns.tolist() == pytest.approx([-0.05 + 0.5 * 1.0, 1.0, 0.0])


def test_reinforce_plus_plus_returns_without_kl_are_the_discounted_outcome():
    zeros = torch.zeros(3)
    returns = reinforce_plus_plus_returns(2.0, zeros, zeros, torch.ones(3), kl_coef=0.0, gamma=0.9)
    assert returns.tolist() == pytest.approx([2.0 * 0.81, 2.0 * 0.9, 2.0])


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.9])
def test_discounted_cumsum_equals_the_token_by_token_recursion_across_blocks(gamma):
    """8,200 tokens (33 blocks of 256, the last one partial) against ``G_t = v_t + γ G_{t+1}``."""
    from slime.algorithms.advantages import discounted_cumsum

    values = torch.randn(8200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected, running = torch.empty_like(values), 0.0
    for t in range(len(values) - 1, -1, -1):
        running = values[t].item() + gamma * running
        expected[t] = running
    assert torch.allclose(discounted_cumsum(values, gamma), expected, rtol=1e-9, atol=1e-9)
    assert discounted_cumsum(values[:1], gamma).tolist() == [values[0].item()]
    assert discounted_cumsum(values[:0], gamma).numel() == 0


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c():
    old = torch.zeros(3)
    new = torch.log(torch.tensor([4.0, 4.0, 0.5]))
    adv = torch.tensor([-1.0, 1.0, -1.0])
    loss, clipped, _ = ppo_clip_loss(new, old, adv, 0.2, 0.2, eps_clip_c=3.0)
    # ratio 4, A<0: PPO gives 4, capped at -c·A = 3; A>0 clips to -1.2; ratio 0.5, A<0: 0.8 < 3
    assert loss.tolist() == pytest.approx([3.0, -1.2, 0.8])
    assert clipped.tolist() == [1.0, 1.0, 1.0]
    plain, _, _ = ppo_clip_loss(new, old, adv, 0.2, 0.2)
    assert plain.tolist() == pytest.approx([4.0, -1.2, 0.8])


def test_gspo_on_policy_has_zero_kl_and_no_clipping():
    logp = torch.tensor([-1.0, -2.0])
    loss, clipped, kl = gspo_loss(logp, logp.clone(), torch.tensor([2.0, 2.0]), torch.ones(2), 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-2.0, -2.0])
    assert clipped.sum().item() == 0 and kl.abs().max().item() == 0


def test_gspo_clips_the_sequence_ratio_over_unmasked_tokens_only():
    old = torch.zeros(3)
    new = torch.log(torch.tensor([2.0, 1.0, 100.0]))  # the masked third token must not count
    mask = torch.tensor([1.0, 1.0, 0.0])
    s = math.sqrt(2.0)  # exp(mean(ln 2, 0))
    loss, clipped, kl = gspo_loss(new, old, torch.ones(3), mask, 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-1.28] * 3) and clipped.tolist() == [1.0] * 3
    assert kl.tolist() == pytest.approx([-math.log(s)] * 3)
    loss, clipped, _ = gspo_loss(new, old, -torch.ones(3), mask, 0.2, 0.28)
    assert loss.tolist() == pytest.approx([s] * 3) and clipped.sum().item() == 0
    loss, _, _ = gspo_loss(new, old, -torch.ones(3), mask, 0.2, 0.28, eps_clip_c=1.3)
    assert loss.tolist() == pytest.approx([1.3] * 3)


def test_gspo_token_gradient_is_the_sequence_ratio_times_grad_log_prob():
    new = torch.log(torch.tensor([2.0, 1.0, 3.0])).requires_grad_()
    mask = torch.tensor([1.0, 1.0, 0.0])
    loss, _, _ = gspo_loss(new, torch.zeros(3), -torch.ones(3), mask, 0.2, 0.28)
    (loss * mask).sum().backward()
    # unclipped, A = -1: loss_t = s_t, d s_t / d log π_t = sg(s) = sqrt(2); no cross-token gradient
    assert new.grad.tolist() == pytest.approx([math.sqrt(2.0), math.sqrt(2.0), 0.0])


def test_cispo_detaches_the_clipped_ratio_and_keeps_every_token_s_gradient():
    new = torch.log(torch.tensor([1.5, 0.5, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, clipped, _ = cispo_loss(new, torch.zeros(3), adv, 0.2, 0.28)
    # weights clip(1.5) = 1.28, clip(0.5) = 0.8, 1.1 unclipped; loss = -w · A · log π
    expected = [-1.28 * math.log(1.5), -0.8 * math.log(0.5), 1.1 * math.log(1.1)]
    assert loss.tolist() == pytest.approx(expected, rel=1e-5)
    assert clipped.tolist() == [1.0, 1.0, 0.0]
    loss.sum().backward()
    assert new.grad.tolist() == pytest.approx([-1.28, -0.8, 1.1], rel=1e-5)


def test_cispo_on_policy_clips_nothing():
    logp = torch.tensor([-1.0, -3.0])
    _, clipped, kl = cispo_loss(logp, logp.clone(), torch.ones(2), 0.2, 0.28)
    assert clipped.sum().item() == 0 and kl.abs().max().item() == 0


def test_truncated_is_weights_clamp_the_old_over_rollout_ratio():
    rollout = torch.tensor([-math.log(3.0), math.log(2.0), 0.0])  # ratios 3, 0.5, 1
    weights, clipped = truncated_is_weights(torch.zeros(3), rollout, clip_low=0.6, clip_high=2.0)
    assert weights.tolist() == pytest.approx([2.0, 0.6, 1.0])
    assert clipped.tolist() == [1.0, 1.0, 0.0]


def test_reinforce_plus_plus_advantages_whiten_the_returns_of_the_batch():
    log_probs = [torch.tensor([-1.0, -1.0]), torch.tensor([-2.0])]
    ref = [torch.tensor([-1.5, -1.0]), torch.tensor([-2.0])]
    adv = reinforce_plus_plus_advantages([1.0, 0.0], log_probs, ref, [[1, 1], [1]], kl_coef=0.1, gamma=1.0)
    # returns: sample 1 rewards (-0.05, 1) -> (0.95, 1); sample 2 -> (0); mean 0.65, unbiased var
    # ((0.3)² + (0.35)² + (0.65)²) / 2
    mean, var = 0.65, (0.3**2 + 0.35**2 + 0.65**2) / 2
    expected = [(v - mean) / math.sqrt(var) for v in (0.95, 1.0, 0.0)]
    assert torch.cat(adv).tolist() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="ref_log_probs"):
        reinforce_plus_plus_advantages([1.0], log_probs[:1], None, [[1, 1]], kl_coef=0.1, gamma=1.0)


def _policy_args(**overrides) -> TrainerSettings:
    defaults = dict(
        advantage_estimator="grpo",
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=None,
        use_tis=False,
        tis_clip=2.0,
        tis_clip_low=0.0,
        use_mis=False,
        mis_level="token",
        mis_lower_bound=0.5,
        mis_upper_bound=2.0,
        entropy_coef=0.0,
        use_kl_loss=False,
        force_old_logprob_pass=True,  # these batches carry their own old log-probs
    )
    return bare_settings(**{**defaults, **overrides})


def _micro_batch(**samples) -> MicroBatch:
    lengths = [len(m) for m in samples["loss_masks"]]
    samples["loss_weights"] = [1.0 / sum(sum(m) for m in samples["loss_masks"])] * len(lengths)
    none = torch.zeros(0, dtype=torch.long)
    return MicroBatch(
        torch.zeros(1), torch.zeros(1), lengths, lengths, samples, list(range(len(lengths))), none, none, none
    )


def test_policy_loss_dispatches_gspo_by_estimator():
    batch = _micro_batch(
        loss_masks=[[1, 1, 0]], advantages=[[1.0, 1.0, 1.0]], old_log_probs=[[0.0, 0.0, 0.0]]
    )
    log_probs = [torch.log(torch.tensor([2.0, 1.0, 100.0]))]
    loss, metrics = make_policy_loss_fn(_policy_args(advantage_estimator="gspo"))(batch, log_probs, None)
    # sequence ratio sqrt(2) clipped to 1.28 on both unmasked tokens; token-mean weight 1/2
    assert loss.item() == pytest.approx(-1.28) and metrics["pg_clipfrac"].item() == pytest.approx(1.0)
    ppo_loss, _ = make_policy_loss_fn(_policy_args())(batch, log_probs, None)
    assert ppo_loss.item() == pytest.approx(-(1.28 + 1.0) / 2)


def test_policy_loss_multiplies_token_losses_by_truncated_is_weights():
    batch = _micro_batch(
        loss_masks=[[1, 1]],
        advantages=[[1.0, 1.0]],
        old_log_probs=[[0.0, 0.0]],
        rollout_log_probs=[[-math.log(3.0), 0.0]],  # TIS weights clamp(3) = 2 and 1
    )
    log_probs = [torch.zeros(2)]  # on-policy: ppo loss -A = -1 per token
    loss, metrics = make_policy_loss_fn(_policy_args(use_tis=True))(batch, log_probs, None)
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2)
    assert metrics["tis_clipfrac"].item() == pytest.approx(0.5) and metrics["pg_clipfrac"].item() == 0
    cispo, _ = make_policy_loss_fn(_policy_args(advantage_estimator="cispo"))(batch, log_probs, None)
    assert cispo.item() == 0.0  # -w · A · log π with log π = 0


def test_estimator_flags_that_landed_pass_the_not_yet_implemented_check():
    base = dict(
        loss_type="policy_loss",
        custom_loss_function_path=None,
        custom_advantage_function_path=None,
        use_rollout_logprobs=False,
        ref_load=None,
        colocate=False,
        use_kl_loss=False,
        kl_coef=0.0,
        use_tis=False,
        eps_clip_c=None,
        multimodal_keys=None,
    )
    for estimator in ("gspo", "cispo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus"):
        check_implemented(argparse.Namespace(**{**base, "advantage_estimator": estimator}))
    check_implemented(argparse.Namespace(**{**base, "advantage_estimator": "grpo", "use_tis": True}))
    check_implemented(argparse.Namespace(**{**base, "advantage_estimator": "grpo", "eps_clip_c": 3.0}))
    shaped = {**base, "advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1}
    check_implemented(argparse.Namespace(**{**shaped, "use_kl_loss": True}))
    # KL reward shaping without the KL loss, PPO with its critic and engine log-probs as old policy
    check_implemented(argparse.Namespace(**{**shaped, "advantage_estimator": "grpo"}))
    ppo = {**base, "advantage_estimator": "ppo", "use_rollout_logprobs": True}
    check_implemented(argparse.Namespace(**ppo))
    with pytest.raises(ConfigError, match="--ref-load"):
        check_implemented(argparse.Namespace(**{**base, "advantage_estimator": "grpo", "ref_load": "/x"}))


def test_gae_by_hand_with_discount_and_lambda():
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.2, 0.4])
    adv, ret = gae(rewards, values, torch.ones(3), gamma=1.0, lambd=1.0)
    # γ = λ = 1: A_t = (sum of future rewards) - V_t, R_t = 1
    assert adv.tolist() == pytest.approx([0.5, 0.8, 0.6]) and ret.tolist() == pytest.approx([1.0] * 3)
    adv, ret = gae(rewards, values, torch.ones(3), gamma=0.5, lambd=0.5)
    # δ = (-0.4, 0.0, 0.6); A_2 = 0.6, A_1 = 0 + 0.25·0.6, A_0 = -0.4 + 0.25·0.15
    assert adv.tolist() == pytest.approx([-0.3625, 0.15, 0.6])
    assert ret.tolist() == pytest.approx([0.1375, 0.35, 1.0])


def test_gae_skips_masked_tokens():
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 9.0, 0.4])
    adv, ret = gae(rewards, values, torch.tensor([1.0, 0.0, 1.0]), gamma=0.5, lambd=0.5)
    # the masked token is not a step: token 0 bootstraps from token 2 (δ_0 = 0.5·0.4 - 0.5)
    assert adv.tolist() == pytest.approx([-0.3 + 0.25 * 0.6, 0.0, 0.6])
    assert ret.tolist() == pytest.approx([-0.15 + 0.5, 9.0, 1.0])


def test_ppo_advantages_shape_rewards_with_kl_and_whiten_over_variable_lengths():
    values = [torch.zeros(2), torch.tensor([0.5, 0.5, 0.5])]
    log_probs = [torch.tensor([-1.0, -1.0]), torch.zeros(3)]
    ref = [torch.tensor([-1.5, -1.0]), torch.zeros(3)]
    adv, ret = ppo_advantages(
        [1.0, 0.0], values, log_probs, ref, [[1, 1], [1, 1, 0]], kl_coef=0.1, gamma=1.0, lambd=1.0
    )
    # sample 0: token rewards (-0.05, 1) -> returns (0.95, 1); sample 1: outcome 0 on token 1
    assert ret[0].tolist() == pytest.approx([0.95, 1.0])
    assert ret[1].tolist() == pytest.approx([0.0, 0.0, 0.5])
    raw = [0.95, 1.0, -0.5, -0.5]  # unmasked advantages before whitening
    mean, std = sum(raw) / 4, math.sqrt(sum((x - sum(raw) / 4) ** 2 for x in raw) / 3)
    assert [len(a) for a in adv] == [2, 3]
    unmasked = [*adv[0].tolist(), *adv[1][:2].tolist()]
    assert unmasked == pytest.approx([(x - mean) / std for x in raw], rel=1e-5)


def test_kl_shaped_rewards_subtract_the_summed_token_kl():
    shaped = kl_shaped_rewards(
        [1.0], [torch.tensor([-1.0, -1.0, -3.0])], [torch.tensor([-1.5, -2.0, 0.0])], [[1, 1, 0]], 0.1
    )
    assert shaped == pytest.approx([1.0 - 0.1 * (0.5 + 1.0)])


def test_clipped_value_loss_by_hand():
    values, old, returns = torch.tensor([0.5, 1.0]), torch.zeros(2), torch.tensor([0.6, 0.0])
    loss, clipped = clipped_value_loss(values, old, returns, value_clip=0.2)
    # token 0: (0.5-0.6)² = 0.01 < clipped (0.2-0.6)² = 0.16; token 1: 1.0 > (0.2-0)² = 0.04
    assert loss.tolist() == pytest.approx([0.08, 0.5]) and clipped.tolist() == [1.0, 0.0]
    plain, none = clipped_value_loss(values, old, returns, value_clip=None)
    assert plain.tolist() == pytest.approx([0.005, 0.5]) and none.sum().item() == 0


def test_value_loss_fn_aggregates_over_unmasked_tokens():
    batch = _micro_batch(loss_masks=[[1, 0], [1]], values=[[0.0, 0.0], [0.0]], returns=[[1.0, 5.0], [0.0]])
    loss, metrics = make_value_loss_fn(0.2)(batch, [torch.tensor([0.1, 3.0]), torch.tensor([-0.1])], None)
    # clipped values equal the values here: ½ ((0.9)² + 0.1²) / 2 tokens; the masked token is ignored
    assert loss.item() == pytest.approx(0.5 * (0.81 + 0.01) / 2)
    assert metrics["values_mean"].item() == pytest.approx(0.0) and metrics["returns_mean"].item() == 0.5


def test_masked_is_drops_tokens_or_sequences_outside_the_bounds():
    old = torch.zeros(3)
    rollout = torch.log(torch.tensor([3.0, 1.0, 1 / 1.5]))  # ratios 1/3, 1, 1.5
    mask = torch.ones(3)
    weights, kept = masked_is_weights(old, rollout, mask, "token", 0.5, 2.0)
    assert weights.tolist() == pytest.approx([0.0, 1.0, 1.5]) and kept.tolist() == [0.0, 1.0, 1.0]
    weights, kept = masked_is_weights(old, rollout, mask, "sequence", 0.4, 2.0)
    assert weights.tolist() == pytest.approx([0.5] * 3) and kept.tolist() == [1.0] * 3  # product 0.5
    weights, _ = masked_is_weights(old, rollout, mask, "geometric", 0.4, 2.0)
    assert weights.tolist() == pytest.approx([0.5 ** (1 / 3)] * 3)
    # the masked third token leaves the product at 1/3: the whole sequence is dropped
    weights, kept = masked_is_weights(old, rollout, torch.tensor([1.0, 1.0, 0.0]), "sequence", 0.4, 2.0)
    assert weights.tolist() == [0.0] * 3 and kept.tolist() == [0.0] * 3
    huge, _ = masked_is_weights(torch.zeros(2), torch.full((2,), -50.0), torch.ones(2), "sequence", 0.5, 2.0)
    assert torch.isfinite(huge).all() and huge.sum().item() == 0.0


def test_mismatch_metrics_by_hand():
    train, rollout = torch.tensor([0.0, math.log(0.5)]), torch.zeros(2)
    metrics = mismatch_token_metrics(train, rollout, tis_clip_low=0.6, tis_clip=2.0)
    assert metrics["train_rollout_logprob_abs_diff"].tolist() == pytest.approx([0.0, math.log(2)])
    # k3 of KL(rollout ‖ train): r - 1 - log r with r = π_train/π_rollout = (1, 0.5)
    assert metrics["train_rollout_kl"].tolist() == pytest.approx([0.0, -0.5 + math.log(2)])
    assert metrics["train_rollout_tis_clipfrac"].tolist() == [0.0, 1.0]


def test_policy_loss_with_mis_masks_tokens_and_logs_the_mismatch():
    batch = _micro_batch(
        loss_masks=[[1, 1]],
        advantages=[[1.0, 1.0]],
        old_log_probs=[[0.0, 0.0]],
        rollout_log_probs=[[-math.log(3.0), 0.0]],  # MIS ratios 3 (dropped) and 1
    )
    loss, metrics = make_policy_loss_fn(_policy_args(use_mis=True))(batch, [torch.zeros(2)], None)
    assert loss.item() == pytest.approx(-1.0 / 2)  # only the second token, weight 1, token-mean over 2
    assert metrics["mis_masked_frac"].item() == pytest.approx(0.5)
    assert metrics["train_rollout_logprob_abs_diff"].item() == pytest.approx(math.log(3.0) / 2)
    assert metrics["train_rollout_tis_clipfrac"].item() == pytest.approx(0.5)  # 3 > --tis-clip 2


def test_tokens_without_engine_log_probs_get_no_is_correction_and_stay_out_of_the_mismatch():
    """Sample 0 has engine log-probs (ratio 3 on its first token); sample 1 was built by hand
    (``rollout_log_prob_masks`` 0, placeholder 0.0, which against log π = log 0.5 would look like a
    ratio of 0.5): it is trained with weight 1, and the mismatch is the mean over sample 0 alone."""
    batch = _micro_batch(
        loss_masks=[[1, 1], [1, 1]],
        advantages=[[1.0, 1.0], [1.0, 1.0]],
        old_log_probs=[[0.0, 0.0], [math.log(0.5)] * 2],
        rollout_log_probs=[[-math.log(3.0), 0.0], [0.0, 0.0]],
        rollout_log_prob_masks=[[1, 1], [0, 0]],
    )
    log_probs = [torch.zeros(2), torch.full((2,), math.log(0.5))]  # on-policy: -A per token
    loss, metrics = make_policy_loss_fn(_policy_args(use_tis=True))(batch, log_probs, None)
    assert loss.item() == pytest.approx(-(2.0 + 1.0 + 1.0 + 1.0) / 4)  # TIS 2, 1 and 1, 1 (unknown)
    assert metrics["tis_clipfrac"].item() == pytest.approx(1 / 4)
    assert metrics["rollout_logprob_coverage"].item() == pytest.approx(0.5)
    reduced = per_scored_token({k: v.item() for k, v in metrics.items()})
    assert reduced["train_rollout_logprob_abs_diff"] == pytest.approx(math.log(3.0) / 2)
    assert reduced["train_rollout_tis_clipfrac"] == pytest.approx(0.5)
    mis_loss, mis = make_policy_loss_fn(_policy_args(use_mis=True))(batch, log_probs, None)
    assert mis_loss.item() == pytest.approx(-(0.0 + 1.0 + 1.0 + 1.0) / 4)  # only the ratio-3 token dropped
    assert mis["mis_masked_frac"].item() == pytest.approx(1 / 4)


def test_mismatch_metrics_are_left_out_when_no_token_was_scored_by_the_engine():
    metrics = {"rollout_logprob_coverage": 0.0, "train_rollout_kl": 0.0, "pg_loss": 1.5}
    assert per_scored_token(metrics) == {"rollout_logprob_coverage": 0.0, "pg_loss": 1.5}
    assert per_scored_token({"pg_loss": 1.5}) == {"pg_loss": 1.5}


def _algorithm_args(**overrides) -> argparse.Namespace:
    defaults = dict(
        eps_clip=0.2,
        eps_clip_high=None,
        use_mis=False,
        use_tis=False,
        mis_upper_bound=2.0,
        mis_lower_bound=None,
        kl_coef=0.0,
        custom_advantage_function_path=None,
        loss_type="policy_loss",
        value_clip=0.2,
        num_critic_only_steps=0,
        critic_num_nodes=1,
        critic_num_gpus_per_node=1,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        use_dynamic_batch_size=False,
        global_batch_size=8,
        micro_batch_size=2,
    )
    args = argparse.Namespace(**{**defaults, **overrides})
    fill_algorithm(args)
    return args


def test_off_policy_and_critic_flags_are_checked():
    args = _algorithm_args()
    _check_off_policy_corrections(args)
    assert args.mis_lower_bound == 0.5  # 1 / --mis-upper-bound
    for bad, flag in (
        (dict(use_mis=True, use_tis=True), "--use-mis"),
        (dict(mis_lower_bound=3.0), "--mis-lower-bound"),
        (dict(kl_coef=0.1, custom_advantage_function_path="m.f"), "--kl-coef"),
    ):
        with pytest.raises(ConfigError, match=flag):
            _check_off_policy_corrections(_algorithm_args(**bad))
    _check_critic(_algorithm_args())
    for bad, flag in (
        (dict(value_clip=0.0), "--value-clip"),
        (dict(loss_type="custom_loss"), "--loss-type"),
        (dict(critic_num_gpus_per_node=3), "--critic-num-gpus-per-node"),  # 8 % (2 × 3)
        (dict(tensor_model_parallel_size=2, critic_num_gpus_per_node=1), "--critic-num-gpus-per-node"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), "--sequence-parallel"),  # value head
    ):
        with pytest.raises(ConfigError, match=flag):
            _check_critic(_algorithm_args(**bad))


def test_a_sample_without_a_reward_stays_out_of_its_groups_statistics():
    from slime.algorithms.advantages import outcome_advantages

    def per_sample(rewards, valid, estimator, normalize_std=True):
        advantages = outcome_advantages(rewards, [1] * len(rewards), 4, estimator, normalize_std, valid=valid)
        return [round(a.item(), 5) for a in advantages]

    # [1, 1, 1, failed]: all valid rewards agree, so nothing is learned (the placeholder 0.0 gave +0.5).
    assert per_sample([1.0, 1.0, 1.0, 0.0], [True, True, True, False], "grpo") == [0.0] * 4
    assert per_sample([1.0, 1.0, 1.0, 0.0], None, "grpo") == [0.5] * 3 + [-1.5]
    # [1, 0, 1, failed]: mean 2/3, unbiased std over the three sqrt(1/3).
    third = 1 / 3
    expected = [round(v / math.sqrt(third), 5) for v in (third, -2 * third, third)] + [0.0]
    assert per_sample([1.0, 0.0, 1.0, 5.0], [True, True, True, False], "grpo") == expected
    assert per_sample([1.0, 0.0, 1.0, 5.0], [True, True, True, False], "dr_grpo") == [
        round(third, 5),
        round(-2 * third, 5),
        round(third, 5),
        0.0,
    ]
    # RLOO: each valid reward minus the mean of the other valid ones; one valid sample: nothing.
    assert per_sample([1.0, 0.0, 1.0, 5.0], [True, True, True, False], "rloo") == [0.5, -1.0, 0.5, 0.0]
    assert per_sample([1.0, 0.0, 0.0, 0.0], [True, False, False, False], "rloo") == [0.0] * 4


def test_groups_are_the_rollouts_not_blocks_of_n_samples_per_prompt():
    """A generate function returning two samples per prompt with --n-samples-per-prompt 2 gives a
    group of 4 then one of 2: by position in blocks of 2 the first group would be split in two."""
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    by_group = outcome_advantages(rewards, [1] * 6, [0, 0, 0, 0, 1, 1], "dr_grpo")
    assert [a.item() for a in by_group] == pytest.approx([0.5, 0.5, -0.5, -0.5, 0.5, -0.5])
    by_position = outcome_advantages(rewards, [1] * 6, 2, "dr_grpo")
    assert [a.item() for a in by_position] == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.5, -0.5])
    # unbiased std over the group of 4 = sqrt(1/3); over the group of 2 = sqrt(1/2)
    grpo = outcome_advantages(rewards, [1] * 6, [7, 7, 7, 7, 9, 9], "grpo")
    expected = (
        [0.5 / math.sqrt(1 / 3)] * 2
        + [-0.5 / math.sqrt(1 / 3)] * 2
        + [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)]
    )
    assert [a.item() for a in grpo] == pytest.approx(expected, rel=1e-5)
    rloo = outcome_advantages(rewards, [1] * 6, [0, 0, 0, 0, 1, 1], "rloo")
    assert [a.item() for a in rloo] == pytest.approx([2 / 3, 2 / 3, -2 / 3, -2 / 3, 1.0, -1.0])


def _per_sample_reference(settings, batch, log_probs):
    """The policy loss and its metrics sample by sample, with the pure per-sample functions and
    ``weighted_token_sum``: what the flat micro-batch computation must equal."""
    masks = batch.per_sample("loss_masks", torch.device("cpu"))
    weights = batch.samples["loss_weights"]
    old = batch.per_sample("old_log_probs", torch.device("cpu"))
    advantages = batch.per_sample("advantages", torch.device("cpu"))
    rollout = batch.per_sample("rollout_log_probs", torch.device("cpu"))
    opts = settings.loss
    low, high = opts.eps_clip, opts.eps_clip_high
    losses, clipped = [], []
    for lp, o, a, m, r in zip(log_probs, old, advantages, masks, rollout, strict=True):
        if opts.advantage_estimator == "gspo":
            loss, clip, _ = gspo_loss(lp, o, a, m, low, high)
        else:
            loss, clip, _ = ppo_clip_loss(lp, o, a, low, high)
        if opts.use_tis:
            loss = loss * truncated_is_weights(o, r, opts.tis_clip_low, opts.tis_clip)[0]
        if opts.use_mis:
            bounds = (opts.mis_level, opts.mis_lower_bound, opts.mis_upper_bound)
            loss = loss * masked_is_weights(o, r, m, *bounds)[0]
        losses.append(loss)
        clipped.append(clip)
    ref = batch.per_sample("ref_log_probs", torch.device("cpu"))
    kl = [kl_estimate(lp, r, opts.kl_loss_type) for lp, r in zip(log_probs, ref, strict=True)]
    total = weighted_token_sum(losses, masks, weights) + opts.kl_loss_coef * weighted_token_sum(
        kl, masks, weights
    )
    return total, weighted_token_sum(clipped, masks, weights)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(advantage_estimator="gspo"),
        dict(use_tis=True),
        dict(use_mis=True, mis_level="sequence", mis_lower_bound=0.1, mis_upper_bound=10.0),
        dict(use_mis=True, mis_level="geometric", mis_lower_bound=0.5, mis_upper_bound=1.5),
    ],
)
def test_the_flat_micro_batch_loss_equals_the_per_sample_one_in_value_and_gradient(overrides):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2]
    batch = _micro_batch(
        loss_masks=[[1, 0, 1], [1], [1, 1, 1, 0, 1], [0, 0]],
        advantages=[[a] * n for a, n in zip([1.0, -0.5, 2.0, 0.3], lengths, strict=True)],
        old_log_probs=[(-torch.rand(n, generator=gen)).tolist() for n in lengths],
        rollout_log_probs=[(-torch.rand(n, generator=gen)).tolist() for n in lengths],
        ref_log_probs=[(-torch.rand(n, generator=gen)).tolist() for n in lengths],
    )
    settings = _policy_args(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", **overrides)
    leaves = [(-torch.rand(n, generator=gen)).requires_grad_() for n in lengths]
    flat_loss, metrics = make_policy_loss_fn(settings)(batch, leaves, None)
    flat_grads = torch.autograd.grad(flat_loss, leaves)
    reference, clipfrac = _per_sample_reference(settings, batch, leaves)
    reference_grads = torch.autograd.grad(reference, leaves)
    assert flat_loss.item() == pytest.approx(reference.item(), rel=1e-6, abs=1e-7)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipfrac.item(), abs=1e-7)
    for ours, theirs in zip(flat_grads, reference_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def _skip_args(**overrides) -> TrainerSettings:
    return _policy_args(**{**_SKIP, **overrides})


_SKIP = dict(
    force_old_logprob_pass=False,
    loss_type="policy_loss",
    use_rollout_logprobs=False,
    num_steps_per_rollout=1,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_kl_loss=False,
    kl_coef=0.0,
    custom_advantage_function_path=None,
    advantage_estimator="grpo",
)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(force_old_logprob_pass=True),
        dict(num_steps_per_rollout=2),
        dict(use_kl_loss=True),
        dict(kl_coef=0.05),  # KL-shaped rewards need the old and reference log-probs
        dict(hidden_dropout=0.1),  # the old pass runs in eval mode, the training forward does not
        dict(attention_dropout=0.1),
        dict(advantage_estimator="reinforce_plus_plus"),  # token-level advantages from them
        dict(advantage_estimator="ppo"),
        dict(loss_type="custom_loss"),  # a custom loss may read them
        dict(custom_advantage_function_path="m.f"),
        dict(use_rollout_logprobs=True),  # the engine's log-probs are the old policy's
    ],
)
def test_the_old_logprob_pass_is_kept_wherever_it_can_differ(overrides):
    assert old_log_probs_are_current(_skip_args())
    for estimator in ("grpo", "dr_grpo", "rloo", "gspo", "cispo", "reinforce_plus_plus_baseline"):
        assert old_log_probs_are_current(_skip_args(advantage_estimator=estimator))
    assert not old_log_probs_are_current(_skip_args(**overrides))


def test_a_skipped_old_logprob_pass_gives_ratio_one_and_the_computed_pass_s_loss():
    """With the old log-probs taken from the training forward itself (detached), the loss and its
    gradient are those of a separate pass that computed the same values."""
    batch = _micro_batch(loss_masks=[[1, 1], [1, 0, 1]], advantages=[[1.0, 1.0], [-1.0, -1.0, -1.0]])
    values = [torch.tensor([-0.5, -1.5]), torch.tensor([-0.2, -0.9, -2.0])]
    skipped = make_policy_loss_fn(_skip_args())
    computed = make_policy_loss_fn(_policy_args())
    batch_with_old = _micro_batch(
        loss_masks=batch.samples["loss_masks"],
        advantages=batch.samples["advantages"],
        old_log_probs=[v.tolist() for v in values],
    )
    results = []
    for fn, b in ((skipped, batch), (computed, batch_with_old)):
        leaves = [v.clone().requires_grad_() for v in values]
        loss, metrics = fn(b, leaves, None)
        results.append((loss.item(), metrics["ppo_kl"].item(), torch.autograd.grad(loss, leaves)))
    (loss_a, kl_a, grads_a), (loss_b, kl_b, grads_b) = results
    assert kl_a == 0.0 and kl_b == 0.0
    assert loss_a == pytest.approx(loss_b, abs=1e-7)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b)
