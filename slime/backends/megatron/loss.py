"""The loss a train step optimises, chosen by ``--loss-type``.

A loss function sees one micro-batch and the per-sample response log-probs (and entropy) the model
produced for it, and returns its share of the global loss plus metric shares aggregated the same
way (so that summing over micro-batches and data-parallel ranks gives global values).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from slime.algorithms.aggregation import weighted_token_sum
from slime.algorithms.losses import sft_loss
from slime.backends.megatron.batching import MicroBatch

LossFn = Callable[[MicroBatch, list[torch.Tensor], list[torch.Tensor] | None], tuple[torch.Tensor, dict]]


def sft_loss_fn(batch: MicroBatch, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None):
    device = log_probs[0].device
    masks = batch.per_sample("loss_masks", device)
    weights = batch.samples["loss_weights"]
    metrics = {}
    if entropy is not None:
        metrics["entropy"] = weighted_token_sum([e.detach() for e in entropy], masks, weights)
    return sft_loss(log_probs, masks, weights), metrics


_LOSSES: dict[str, LossFn] = {"sft_loss": sft_loss_fn}


def build_loss_fn(args: argparse.Namespace) -> LossFn:
    try:
        return _LOSSES[args.loss_type]
    except KeyError:
        raise ValueError(
            f"--loss-type {args.loss_type!r} is not available; choose one of {sorted(_LOSSES)}"
        ) from None
