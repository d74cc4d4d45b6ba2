"""Packed (THD) micro-batches in megatron-core: their ``PackedSeqParams``, and local attention taught them.

The model always receives a packed micro-batch the same way: one ``[1, T]`` row plus ``PackedSeqParams``
(``qkv_format="thd"``, ``cu_seqlens``). megatron-core then applies RoPE per sequence from
``cu_seqlens`` (positions restart at 0 in every sequence, exactly as unpacked) and hands the packed
q/k/v to the core attention. Transformer Engine's attention (``--transformer-impl transformer_engine``,
the GPU path) consumes THD natively. megatron-core's local ``DotProductAttention`` (``--transformer-impl
local``, the CPU path) refuses ``packed_seq_params``; :class:`PackedDotProductAttention` gives it the
exact equivalent. Which attention runs is the layer spec's choice (``model.py``); nothing else branches
on it.

Segments with a shared prompt (``--share-prompts-in-train``, ``batching``) are the local attention's
alone: their tokens' positions are not their offsets in the segment and their mask is not causal.
The trainer declares them for the run of a schedule (:func:`shared_prompt_layouts`); the RoPE and the
attention of every layer then look them up by their ``cu_seqlens``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

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
    """megatron-core's local attention, accepting THD input: causal attention over the packed row's
    sequences as one right-padded batch, so every token sees exactly the keys of its own unpacked
    sequence and no score is computed across sequences (what variable-length flash attention does on
    a GPU). One batched call instead of one per sequence: the per-sequence loop cost a third of a
    quickstart step in Python overhead (``bench/step_profile.py``).

    It also takes the per-head key and value sizes that multi-latent attention gives its core
    attention (Transformer Engine's takes them; megatron-core's local one has only ``kv_channels``):
    the keys' size only shows in the softmax scale, which MLA passes itself, and the values' sets the
    width of the output.
    """

    hidden_size_per_partition: int  # megatron-core's: the width of the output on this rank

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
        # THD q/k/v are [T, heads, dim]. Right-padding every sequence to the longest and running the
        # local kernel once over [s, b=n, heads, dim] with its causal mask is exact: a real query at
        # position j only sees keys 0..j of its own sequence, all real; the padded rows are dropped.
        # A segment with a shared prompt brings its own mask, causal and blind to the other responses.
        rows = packed_rows(packed_seq_params.cu_seqlens_q)
        padded = [pad_sequences(t, rows) for t in (query, key, value)]
        if self._fused_applies(query, attention_bias):
            out = self._fused(padded[0], padded[1], padded[2], rows.hidden)
        else:
            out = super().forward(*padded, rows.hidden, attn_mask_type, attention_bias)
        return out.flatten(0, 1)[rows.index].unsqueeze(1)

    def _fused_applies(self, query: torch.Tensor, attention_bias: torch.Tensor | None) -> bool:
        """Where torch's fused attention computes what megatron-core's local kernel does: a causal
        layer (the kernel masks causally only then; ``_fused`` does without a mask of its own), fp32,
        no attention bias or dropout, no learnable softmax offset, no sliding window, and no
        query-key layer scaling (its ``coeff`` only matters in half precision)."""
        softmax = self.scale_mask_softmax
        return (
            self.attn_mask_type == AttnMaskType.causal
            and query.dtype == torch.float32
            and attention_bias is None
            and (self.attention_dropout.p == 0.0 or not self.training)
            and self.softmax_offset is None
            and softmax.scale is None
            and getattr(softmax, "window_size", None) is None
        )

    def _fused(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """``[s, b, heads, dim]`` q/k/v (fewer key/value heads under GQA, each shared by consecutive
        query heads, as megatron-core repeats them) -> ``[s, b, heads * value dim]``. One op forward
        and backward where the local kernel runs about ten: this attention was 10% of a quickstart
        train step (py-spy, 2026-12-02). Causal without ``hidden``, else what it leaves visible."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if hidden is None else ~hidden,
            is_causal=hidden is None,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


@dataclass(frozen=True)
class PackedRows:
    """Where each token of a packed row goes in the right-padded ``[max_len, num_seqs]`` layout."""

    cu_seqlens: torch.Tensor  # the boundaries these rows were computed from
    position: torch.Tensor | None  # [T]: each packed token's RoPE position; None: MRoPE's, per token
    index: torch.Tensor  # [T]: offset in its segment * num_seqs + segment, per packed token
    max_len: int
    num_seqs: int
    hidden: torch.Tensor | None = None  # [num_seqs, 1, max_len, max_len]: True where a key is hidden
    shared: bool = False  # the segments share prompts: positions and mask are the layout's own


def rows_of(
    cu_seqlens: torch.Tensor, positions: torch.Tensor | None = None, blocks: torch.Tensor | None = None
) -> PackedRows:
    """The padded layout of ``cu_seqlens``'s segments; given the tokens' ``positions`` (None for
    multimodal RoPE) and response ``blocks`` (``MicroBatch.response_blocks``), also the mask of their
    shared prompts: a query sees the keys at or before it that are in a prompt or in its own response."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    num_seqs = len(lengths)
    sequence = torch.repeat_interleave(torch.arange(num_seqs, device=cu_seqlens.device), lengths)
    offset = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - cu_seqlens[sequence]
    index = offset * num_seqs + sequence
    max_len = int(lengths.max())
    if blocks is None:
        return PackedRows(cu_seqlens, offset, index, max_len, num_seqs)
    padded = blocks.new_zeros(max_len * num_seqs).index_copy(0, index, blocks).view(max_len, num_seqs).T
    columns = torch.arange(max_len, device=blocks.device)
    later = columns[None, :] > columns[:, None]
    key, query = padded[:, None, :], padded[:, :, None]
    hidden = later[None] | ((key != 0) & (key != query))
    return PackedRows(cu_seqlens, positions, index, max_len, num_seqs, hidden[:, None], shared=True)


_last_rows: list[PackedRows] = []
_shared_rows: dict[int, PackedRows] = {}


def packed_rows(cu_seqlens: torch.Tensor) -> PackedRows:
    """The rows of ``cu_seqlens``: a declared shared-prompt layout's, else its segments' own. Every
    layer's attention and RoPE (queries and keys) of a micro-batch ask for the same boundaries tensor,
    so the last answer is kept and given again for it."""
    shared = _shared_rows.get(id(cu_seqlens))
    if shared is not None and shared.cu_seqlens is cu_seqlens:
        return shared
    if _last_rows and _last_rows[0].cu_seqlens is cu_seqlens:
        return _last_rows[0]
    rows = rows_of(cu_seqlens)
    _last_rows[:] = [rows]
    return rows


@contextlib.contextmanager
def shared_prompt_layouts(batches: Sequence[MicroBatch]) -> Iterator[None]:
    """Declares the shared-prompt segments of ``batches`` while a schedule runs over them (the
    recomputation of activations in the backward pass asks for them again)."""
    for batch in batches:
        if batch.response_blocks is not None:
            assert batch.cu_seqlens is not None  # response blocks only in a packed micro-batch
            # A VLM's [3, b, s] positions become one RoPE frequency per token in the model itself.
            positions = batch.position_ids[0] if batch.position_ids.dim() == 2 else None
            rows = rows_of(batch.cu_seqlens, positions, batch.response_blocks)
            _shared_rows[id(batch.cu_seqlens)] = rows
    try:
        yield
    finally:
        _shared_rows.clear()


def pad_sequences(packed: torch.Tensor, rows: PackedRows) -> torch.Tensor:
    """``[T, heads, dim]`` -> ``[max_len, num_seqs, heads, dim]``, zeros after each sequence's end."""
    flat = packed.new_zeros((rows.max_len * rows.num_seqs, *packed.shape[1:]))
    return flat.index_copy(0, rows.index, packed).view(rows.max_len, rows.num_seqs, *packed.shape[1:])


def use_batched_thd_rope() -> None:
    """Replaces megatron-core's baseline THD RoPE, which slices the frequencies sequence by sequence
    (a Python loop of a few ops per sequence, per layer, for queries and keys: a tenth of a
    quickstart train step), by one gather of every token's position, where that is the same maths:
    without context parallelism and with frequencies per position (positions restart at 0 in every
    sequence). Anything else goes to megatron-core's own. Transformer Engine's fused THD RoPE never
    reaches either."""
    if hasattr(rope_utils._apply_rotary_pos_emb_thd, "baseline"):
        return
    baseline = rope_utils._apply_rotary_pos_emb_thd

    def batched(
        t,
        cu_seqlens,
        freqs,
        rotary_interleaved=False,
        multi_latent_attention=False,
        mscale=1.0,
        cp_group=None,
    ):
        rows = packed_rows(cu_seqlens)
        # A shared prompt's positions are the layout's (context parallelism is refused with it);
        # multimodal RoPE's frequencies are the tokens' own already, which megatron-core's takes.
        if rows.position is None or (
            not rows.shared
            and (cp_group is None or cp_group.size() > 1 or freqs.size(0) == int(cu_seqlens[-1]))
        ):
            return baseline(
                t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group
            )
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            freqs[rows.position],
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
        ).squeeze(1)

    # megatron-core's own, for the check that both agree (an attribute of the function: its __dict__)
    batched.__dict__["baseline"] = baseline
    rope_utils._apply_rotary_pos_emb_thd = batched
