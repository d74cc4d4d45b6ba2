"""Packed (THD) micro-batches in megatron-core: their ``PackedSeqParams``, and local attention taught them.

The model always receives a packed micro-batch the same way: one ``[1, T]`` row plus ``PackedSeqParams``
(``qkv_format="thd"``, ``cu_seqlens``). megatron-core then applies RoPE per sequence from
``cu_seqlens`` (positions restart at 0 in every sequence, exactly as unpacked) and hands the packed
q/k/v to the core attention. Transformer Engine's attention (``--transformer-impl transformer_engine``,
the GPU path) consumes THD natively. megatron-core's local ``DotProductAttention`` (``--transformer-impl
local``, the CPU path) refuses ``packed_seq_params``; :class:`PackedDotProductAttention` gives it the
exact equivalent. Which attention runs is the layer spec's choice (``model.py``); nothing else branches
on it.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from slime.backends.megatron.batching import MicroBatch


def packed_seq_params(batch: MicroBatch) -> PackedSeqParams | None:
    """The THD description of a packed micro-batch (None for a padded one)."""
    if not batch.packed:
        return None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens,
        cu_seqlens_kv=batch.cu_seqlens,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
    )


class PackedDotProductAttention(DotProductAttention):
    """megatron-core's local attention, accepting THD input: causal attention run on each sequence of
    the packed row in turn, so every token sees exactly the keys of its own unpacked sequence and no
    score is computed across sequences (what variable-length flash attention does on a GPU).

    It also takes the per-head key and value sizes that multi-latent attention gives its core
    attention (Transformer Engine's takes them; megatron-core's local one has only ``kv_channels``):
    the keys' size only shows in the softmax scale, which MLA passes itself, and the values' sets the
    width of the output.
    """

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            heads_here = self.hidden_size_per_partition // self.hidden_size_per_attention_head
            self.hidden_size_per_partition = v_channels * heads_here

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        # THD q/k/v are [T, heads, dim]; the local kernel wants [s, b=1, heads, dim] and returns
        # [s, 1, hidden], the shape megatron-core gives a THD result anyway.
        bounds = packed_seq_params.cu_seqlens_q
        lengths = (bounds[1:] - bounds[:-1]).tolist()
        parts = zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True)
        return torch.cat(
            [
                super(PackedDotProductAttention, self).forward(
                    q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None, attn_mask_type, attention_bias
                )
                for q, k, v in parts
            ]
        )
