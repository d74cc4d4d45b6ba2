"""How per-token losses of a global batch become one scalar.

Each sample gets a weight ``w_i`` such that the global loss is ``Σ_i w_i Σ_t mask_it · loss_it``. The
weights are computed once over the whole global batch (before it is split across data-parallel
ranks and micro-batches), so every layout of the same batch yields the same loss and gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class FlatTokens:
    """The response tokens of a micro-batch's samples as one vector, so every loss term is one torch op
    over the micro-batch instead of one per sample (on a small model the per-op overhead, not the
    arithmetic, was most of the loss's cost). ``aggregate`` equals ``weighted_token_sum`` up to the
    order of the float additions."""

    mask: torch.Tensor  # [N] float: the loss mask of every token
    weight: torch.Tensor  # [N]: its sample's aggregation weight ``w_i``
    sample: torch.Tensor  # [N] long: the sample it belongs to
    num_samples: int

    @classmethod
    def of(cls, masks: Sequence[torch.Tensor], weights: Sequence[float]) -> FlatTokens:
        device = masks[0].device
        lengths = torch.tensor([len(m) for m in masks], device=device)
        sample = torch.repeat_interleave(torch.arange(len(masks), device=device), lengths)
        weight = torch.tensor(list(weights), dtype=torch.float32, device=device)[sample]
        return cls(torch.cat(list(masks)).float(), weight, sample, len(masks))

    def aggregate(self, values: torch.Tensor) -> torch.Tensor:
        """``Σ_i w_i Σ_t mask_it · value_it`` of flat per-token ``values``."""
        return (values * self.mask * self.weight).sum()

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sample sums ``[num_samples]`` of flat per-token ``values``."""
        return values.new_zeros(self.num_samples).index_add(0, self.sample, values)

    def spread(self, per_sample: torch.Tensor) -> torch.Tensor:
        """Every token's value of its sample's entry in ``per_sample``."""
        return per_sample[self.sample]


def sample_mean(values: torch.Tensor, mask: torch.Tensor, tokens: FlatTokens | None) -> torch.Tensor:
    """Each sample's masked mean of ``values``, per token: over the flat ``tokens`` of several
    samples, or over all of ``values`` (one sample) when ``tokens`` is None (then a scalar)."""
    if tokens is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return tokens.spread(tokens.sums(values * mask) / tokens.sums(mask).clamp(min=1.0))


def sample_sum(values: torch.Tensor, mask: torch.Tensor, tokens: FlatTokens | None) -> torch.Tensor:
    """As ``sample_mean``, the masked sum."""
    if tokens is None:
        return (values * mask).sum()
    return tokens.spread(tokens.sums(values * mask))
