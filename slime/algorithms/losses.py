"""Losses as pure functions of per-sample tensors (no Megatron, no distributed state)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slime.algorithms.aggregation import weighted_token_sum


def sft_loss(
    log_probs: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor], weights: Sequence[float]
) -> torch.Tensor:
    """Negative log-likelihood of the unmasked response tokens, aggregated by ``weights``."""
    return -weighted_token_sum(log_probs, loss_masks, weights)


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate (Schulman et al. 2017) with DAPO's asymmetric bounds.

    Returns ``(loss, clipped, approx_kl)`` per token: ``loss = -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)``,
    ``clipped`` is 1 where the clipped term was the smaller one, ``approx_kl = old - new`` (k1 of the
    old policy against the current one; 0 on the first step of on-policy training).
    """
    log_ratio = log_probs - old_log_probs
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped_term = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped_term)
    clipped = (clipped_term < unclipped).float()
    return loss, clipped, -log_ratio.detach()
