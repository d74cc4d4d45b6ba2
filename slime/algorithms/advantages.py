"""Advantage estimators as pure functions of rewards (and, for token-level ones, per-token tensors)."""

from __future__ import annotations

import torch


def group_normalized_rewards(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's advantage: each reward minus its group's mean, divided by the group's std (optional).

    ``rewards`` is flat with consecutive groups of ``group_size`` samples of the same prompt. The std
    is the unbiased one, as in the GRPO paper and slime; a group whose rewards are all equal gets
    advantage 0 (its std is 0 and ``eps`` keeps the division finite).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}")
    grouped = rewards.float().reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def broadcast_to_tokens(per_sample: torch.Tensor, response_lengths: list[int]) -> list[torch.Tensor]:
    """One advantage per response token: outcome rewards credit every token of the response alike."""
    return [
        torch.full((n,), float(value)) for value, n in zip(per_sample.tolist(), response_lengths, strict=True)
    ]


def outcome_advantages(
    rewards: list[float],
    response_lengths: list[int],
    group_size: int,
    estimator: str,
    normalize_std: bool = True,
) -> list[torch.Tensor]:
    """Per-token advantages for the outcome-reward estimators, one tensor per sample.

    ``grpo``: group-normalised rewards (std normalisation unless disabled); ``dr_grpo``: group-centred
    rewards without std normalisation (Liu et al. 2025, pair it with ``--loss-agg-mode
    seq_mean_token_sum``).
    """
    values = torch.tensor(rewards, dtype=torch.float32)
    if estimator == "grpo":
        per_sample = group_normalized_rewards(values, group_size, normalize_std)
    elif estimator == "dr_grpo":
        per_sample = group_normalized_rewards(values, group_size, normalize_std=False)
    else:
        raise ValueError(f"--advantage-estimator {estimator} is not implemented yet; use grpo or dr_grpo")
    return broadcast_to_tokens(per_sample, response_lengths)
