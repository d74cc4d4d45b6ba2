"""How per-token losses of a global batch become one scalar.

Each sample gets a weight ``w_i`` such that the global loss is ``Σ_i w_i Σ_t mask_it · loss_it``. The
weights are computed once over the whole global batch (before it is split across data-parallel
ranks and micro-batches), so every layout of the same batch yields the same loss and gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slime.config.slime_train_args import LOSS_AGGREGATION_MODES


def loss_weights(loss_masks: Sequence[Sequence[int]], mode: str = "token_mean") -> list[float]:
    """Per-sample weights for one global batch.

    - ``token_mean``: every unmasked token counts equally (``1 / Σ_i n_i``).
    - ``seq_mean_token_mean``: mean over tokens within a sample, then over samples (``1 / (S · n_i)``).
    - ``seq_mean_token_sum``: sum within a sample, mean over samples (``1 / S``; Dr. GRPO).
    Samples with no unmasked token get weight 0.
    """
    counts = [sum(mask) for mask in loss_masks]
    num_samples = len(counts)
    if mode == "token_mean":
        total = sum(counts)
        return [1.0 / total if total else 0.0] * num_samples
    if mode == "seq_mean_token_mean":
        return [1.0 / (num_samples * n) if n else 0.0 for n in counts]
    if mode == "seq_mean_token_sum":
        return [1.0 / num_samples if n else 0.0 for n in counts]
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {LOSS_AGGREGATION_MODES}")


def weighted_token_sum(
    values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], weights: Sequence[float]
) -> torch.Tensor:
    """``Σ_i w_i Σ_t mask_it · value_it``: this micro-batch's share of the global aggregate."""
    total = values[0].new_zeros(())
    for value, mask, weight in zip(values, masks, weights, strict=True):
        total = total + weight * (value * mask).sum()
    return total
