"""Losses as pure functions of per-sample tensors (no Megatron, no distributed state).

Every policy loss returns ``(loss, clipped, approx_kl)`` per token of one sample: the loss to
aggregate, 1.0 where a clip bound was active (its aggregate is ``pg_clipfrac``) and the k1 estimate of
KL(old ‖ current) (``ppo_kl``; 0 on the first step of on-policy training).
"""

from __future__ import annotations

import torch

from slime.algorithms.aggregation import FlatTokens, sample_mean


def sft_loss(log_probs: torch.Tensor, tokens: FlatTokens) -> torch.Tensor:
    """Negative log-likelihood of the unmasked response tokens (flat over ``tokens``), aggregated."""
    return -tokens.aggregate(log_probs)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``-min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)`` per token, and where the clipped term won.

    With ``eps_clip_c`` (dual-clip PPO, Ye et al. 2020) the loss of a token with A < 0 is also capped at
    ``-c·A``, so a huge ratio on a bad token cannot blow the loss up.
    """
    unclipped = ratio * advantages
    clipped_term = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped_term)
    clipped = clipped_term < unclipped
    if eps_clip_c is not None:
        cap = -eps_clip_c * advantages
        dual = (advantages < 0) & (cap < loss)
        loss = torch.where(dual, cap, loss)
        clipped = clipped | dual
    return loss, clipped.float()


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate (Schulman et al. 2017) with DAPO's asymmetric bounds and optional
    dual clip; the ratio is ``π/π_old`` of each token."""
    log_ratio = log_probs - old_log_probs
    loss, clipped = clipped_surrogate(log_ratio.exp(), advantages, eps_clip, eps_clip_high, eps_clip_c)
    return loss, clipped, -log_ratio.detach()


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
    tokens: FlatTokens | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): PPO's clipped surrogate on the sequence-level ratio of each sample
    (of one sample's tokens, or of the flat ``tokens`` of several).

    ``s = exp(mean_t log(π_t/π_old,t))`` over the unmasked response tokens; every token carries
    ``s_t = sg(s) · π_t / sg(π_t)`` (GSPO-token), whose value is ``s`` and whose gradient is
    ``s · ∇log π_t``. All tokens of a sample are clipped together.
    """
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = sample_mean(log_ratio, loss_mask, tokens)
    token_log_ratio = seq_log_ratio.detach() + log_probs - log_probs.detach()
    loss, clipped = clipped_surrogate(token_log_ratio.exp(), advantages, eps_clip, eps_clip_high, eps_clip_c)
    return loss, clipped, (-seq_log_ratio.detach()).expand_as(log_probs)


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1-ε_low, 1+ε_high)) · A · log π`` per token.

    The importance weight is clipped and detached instead of the update, so every token keeps a
    gradient; ``clipped`` marks tokens whose weight was clipped.
    """
    log_ratio = log_probs - old_log_probs
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = -weight * advantages * log_probs
    return loss, (weight != ratio).float(), -log_ratio.detach()


def truncated_is_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling (Yao et al. 2025) for the engine/trainer mismatch, per token.

    ``w = clamp(π_old / π_rollout, clip_low, clip_high)`` (no gradient) multiplies the policy loss of
    each token; also returns 1.0 where the clamp was active (``tis_clipfrac``).
    """
    ratio = (old_log_probs.detach() - rollout_log_probs.detach()).exp()
    weight = ratio.clamp(clip_low, clip_high)
    return weight, (weight != ratio).float()


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's loss per token: ``½ max((V - R)², (V_clip - R)²)`` with
    ``V_clip = V_old + clip(V - V_old, ±ε)`` (PPO2's value clip).

    As PPO's policy clip, the value clip keeps one rollout's updates near the values the advantages
    were computed with; ``value_clip`` None is the plain ``½ (V - R)²``. Also returns 1.0 where the
    clipped term was the larger one (``value_clipfrac``).
    """
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()
