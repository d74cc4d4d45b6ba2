"""Per-token log-probs and entropy from vocab-parallel logits.

The rollout engine reports ``log_softmax(logits / temperature)`` of each sampled token over the
model's real vocabulary; the trainer recomputes exactly that quantity. Logits arrive split along the
vocab across tensor-parallel ranks, and the rows Megatron added to pad the vocab are masked out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch.utils.checkpoint import checkpoint


def _mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    local = logits.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    valid = torch.arange(start, start + local, device=logits.device) < vocab_size
    return logits.masked_fill(~valid, float("-inf"))


def _log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """log Σ exp(logits) over the full vocab; the max is a constant shift, so it carries no gradient."""
    max_logit = logits.detach().max(dim=-1, keepdim=True).values
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    sum_exp = reduce_from_tensor_model_parallel_region((logits - max_logit).exp().sum(dim=-1, keepdim=True))
    return sum_exp.log() + max_logit


LOGPROB_CHUNK_TOKENS = 1024
"""Positions per piece of the log-prob computation: its fp32 temporaries are [chunk, V/tp], not
[T, V/tp] (at 8k tokens and a 152k vocabulary one such copy is 4.9 GB)."""

CHECKPOINT_MIN_ELEMENTS = 1 << 22
"""Pieces of at least this many logits (16 MB per fp32 temporary) are checkpointed under autograd;
smaller ones keep their temporaries, which cost less than recomputing them in the backward pass
(on the quickstart's 128-token vocabulary the recomputation was about 3% of a train step)."""


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    checkpoint_min_elements: int = CHECKPOINT_MIN_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(target)`` and entropy at each position of ``logits[b, s, V/tp]`` (targets: global ids).

    Computed ``chunk_tokens`` positions at a time. With gradients each piece of at least
    ``checkpoint_min_elements`` logits is checkpointed: its temporaries are recomputed in the
    backward pass, one piece at a time, instead of being kept for every position. Every
    tensor-parallel rank walks the same pieces in the same order (their shapes, so whether they are
    checkpointed, are the same on every rank), so the collectives inside match, in the forward and
    in the recomputation.
    """
    grad = torch.is_grad_enabled() and logits.requires_grad
    compute = _piece_with_entropy if with_entropy else _piece
    rows_logprobs, rows_entropy = [], []
    for row in range(logits.shape[0]):
        pieces = []
        for start in range(0, logits.shape[1], chunk_tokens):
            end = start + chunk_tokens
            args = (logits[row, start:end], targets[row, start:end], vocab_size, temperature)
            if grad and args[0].numel() >= checkpoint_min_elements:
                pieces.append(checkpoint(compute, *args, use_reentrant=False))
            else:
                pieces.append(compute(*args))
        rows_logprobs.append(torch.cat([p[0] for p in pieces]))
        if with_entropy:
            rows_entropy.append(torch.cat([p[1] for p in pieces]))
    logprobs = torch.stack(rows_logprobs)
    return logprobs, torch.stack(rows_entropy) if with_entropy else None


def _piece(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float):
    logits = _mask_padded_vocab(logits.float() / temperature, vocab_size)
    return (_target_logprobs(logits, targets, _log_normalizer(logits)),)


def _piece_with_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float):
    logits = _mask_padded_vocab(logits.float() / temperature, vocab_size)
    log_z = _log_normalizer(logits)
    probs = (logits - log_z).exp()
    expected_logit = reduce_from_tensor_model_parallel_region((probs * logits.nan_to_num(neginf=0.0)).sum(-1))
    return _target_logprobs(logits, targets, log_z), log_z.squeeze(-1) - expected_logit


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    local = logits.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * local
    in_shard = (targets >= start) & (targets < start + local)
    local_ids = (targets - start).clamp(0, local - 1)
    gathered = logits.gather(-1, local_ids.unsqueeze(-1))
    target_logit = torch.where(in_shard.unsqueeze(-1), gathered, torch.zeros_like(gathered))
    target_logit = reduce_from_tensor_model_parallel_region(target_logit)
    return (target_logit - log_z).squeeze(-1)
