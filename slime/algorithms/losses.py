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
