"""Advantages, the PPO clip loss and the KL estimators against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from slime.algorithms.advantages import group_normalized_rewards, outcome_advantages
from slime.algorithms.kl import kl_estimate
from slime.algorithms.losses import ppo_clip_loss


def test_grpo_normalises_each_group_by_its_mean_and_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_normalized_rewards(rewards, group_size=4)
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: all equal -> 0
    expected = 0.5 / math.sqrt(1 / 3)
    assert adv[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-5)
    assert adv[4:].tolist() == [0.0] * 4


def test_dr_grpo_only_centres_and_broadcasts_to_every_token():
    adv = outcome_advantages([3.0, 1.0], [2, 3], group_size=2, estimator="dr_grpo")
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
