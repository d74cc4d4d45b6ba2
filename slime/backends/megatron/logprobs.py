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


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(target)`` and entropy at each position of ``logits[..., V/tp]`` (targets: global ids)."""
    logits = _mask_padded_vocab(logits.float() / temperature, vocab_size)
    log_z = _log_normalizer(logits)
    local = logits.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * local
    in_shard = (targets >= start) & (targets < start + local)
    local_ids = (targets - start).clamp(0, local - 1)
    gathered = logits.gather(-1, local_ids.unsqueeze(-1))
    target_logit = torch.where(in_shard.unsqueeze(-1), gathered, torch.zeros_like(gathered))
    target_logit = reduce_from_tensor_model_parallel_region(target_logit)
    logprobs = (target_logit - log_z).squeeze(-1)
    if not with_entropy:
        return logprobs, None
    probs = (logits - log_z).exp()
    expected_logit = reduce_from_tensor_model_parallel_region((probs * logits.nan_to_num(neginf=0.0)).sum(-1))
    entropy = log_z.squeeze(-1) - expected_logit
    return logprobs, entropy
