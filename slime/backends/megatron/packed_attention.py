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
import functools
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
        # A segment with a shared prompt brings its own mask, causal and blind to the other responses;
        # with long responses, fused attention runs prompt by prompt and response by response instead.
        rows = packed_rows(packed_seq_params.cu_seqlens_q)
        fused = self._fused_applies(query, attention_bias)
        if fused and rows.by_units:
            out = shared_prompt_attention(query, key, value, rows.units, self.softmax_scale)
            return out.flatten(1).unsqueeze(1)
        padded = [pad_sequences(t, rows) for t in (query, key, value)]
        if fused:
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


UNITS_PAY_OFF = 2.0
"""How many times the units' padded score area a shared-prompt layout's segments must cover before
fused attention runs unit by unit. Measured on 2 cores (2026-12-05, tiny model, 8 responses to a
15-token prompt; train step units / segments): 8-token responses (area ratio 2.0) 58 / 58 ms, 16 (4.6)
89 / 100, 32 (5.4) 159 / 226, 49 (5.9) 249 / 330; the quickstart's 6-token ones (1.5) 48 / 45."""


@dataclass(frozen=True)
class PackedRows:
    """Where each token of a packed row goes in the right-padded ``[max_len, num_seqs]`` layout."""

    cu_seqlens: torch.Tensor  # the boundaries these rows were computed from
    position: torch.Tensor | None  # [T]: each packed token's RoPE position; None: MRoPE's, per token
    index: torch.Tensor  # [T]: offset in its segment * num_seqs + segment, per packed token
    max_len: int
    num_seqs: int
    sequence: torch.Tensor  # [T]: each packed token's segment
    blocks: torch.Tensor | None = None  # [T]: shared-prompt segments' response blocks (0: the prompt)

    @property
    def shared(self) -> bool:
        """The segments share prompts: positions and visibility are the layout's own."""
        return self.blocks is not None

    @functools.cached_property
    def hidden(self) -> torch.Tensor | None:
        """``[num_seqs, 1, max_len, max_len]``, True where a key is hidden from a query in the padded
        layout: a query sees the keys at or before it that are in a prompt or in its own response.
        (Only megatron-core's local kernel takes it: where torch's fused attention applies, a shared
        layout's attention runs as :class:`SharedPromptUnits`.)"""
        if self.blocks is None:
            return None
        flat = self.blocks.new_zeros(self.max_len * self.num_seqs).index_copy(0, self.index, self.blocks)
        padded = flat.view(self.max_len, self.num_seqs).T
        columns = torch.arange(self.max_len, device=self.blocks.device)
        later = columns[None, :] > columns[:, None]
        key, query = padded[:, None, :], padded[:, :, None]
        return (later[None] | ((key != 0) & (key != query)))[:, None]

    @functools.cached_property
    def units(self) -> SharedPromptUnits:
        assert self.blocks is not None  # only a shared-prompt layout has units
        return SharedPromptUnits.of(self.cu_seqlens, self.sequence, self.blocks)

    @functools.cached_property
    def by_units(self) -> bool:
        """Whether fused attention runs unit by unit: a shared-prompt layout whose segments' padded
        score area is at least ``UNITS_PAY_OFF`` times its units'. Many small units cost more per
        score (a launch per unit and head, the gathers and their backward), so short responses keep
        the segment layout."""
        if self.blocks is None:
            return False
        units = self.units
        unit_area = units.query_index.numel() * units.key_index.shape[1]
        return self.num_seqs * self.max_len**2 >= UNITS_PAY_OFF * unit_area


@dataclass(frozen=True)
class SharedPromptUnits:
    """A shared-prompt micro-batch as attention units: each segment's prompt, which attends causally to
    itself, and each response, which attends to its segment's whole prompt and causally to itself.

    These are exactly the keys each query sees in the segment's ``[prompt, response 1, ...]`` layout,
    but a unit's keys are its prompt and its own tokens only, so the work grows with the responses'
    number times their length, not with the square of their sum: on the quickstart's task with
    64-token responses (segments of about 410 tokens) the segment layout's attention was 89 ms of a
    325 ms train step (2026-12-05). Padding slots (index ``T``) read an appended zero row; a padded
    query sees its unit's keys, so no softmax row is empty, and its output is never read."""

    query_index: torch.Tensor  # [U, Lq]: the packed token of each unit's queries, T past its end
    key_index: torch.Tensor  # [U, Lk]: its keys: the segment's prompt (for a response), then itself
    visible: torch.Tensor  # [U, 1, Lq, Lk]: True where a query sees a key
    output_index: torch.Tensor  # [T]: each packed token's place in the [U * Lq] outputs

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, sequence: torch.Tensor, blocks: torch.Tensor) -> SharedPromptUnits:
        """From the segments' boundaries and each packed token's segment and block (a segment starts
        with its prompt, block 0)."""
        total = len(blocks)
        device = blocks.device
        starts_unit = torch.ones(total, dtype=torch.bool, device=device)
        starts_unit[1:] = (sequence[1:] != sequence[:-1]) | (blocks[1:] != blocks[:-1])
        unit = starts_unit.cumsum(0) - 1
        first = starts_unit.nonzero().flatten()  # [U]: each unit's first packed token
        length = torch.bincount(unit, minlength=len(first))
        prompt_unit = unit[cu_seqlens.long()[sequence[first]]]  # the unit of its segment's prompt
        is_response = blocks[first] != 0
        prompt_start = first[prompt_unit]
        prompt_length = torch.where(is_response, length[prompt_unit], 0)
        width_q = int(length.max())
        width_k = int((prompt_length + length).max())
        i = torch.arange(width_q, device=device)
        query_index = torch.where(i[None] < length[:, None], first[:, None] + i[None], total)
        j = torch.arange(width_k, device=device)[None]
        own = j - prompt_length[:, None]
        key_index = torch.where(
            j < prompt_length[:, None],
            prompt_start[:, None] + j,
            torch.where(own < length[:, None], first[:, None] + own, total),
        )
        last_seen = prompt_length[:, None] + torch.minimum(i[None], length[:, None] - 1)  # [U, Lq]
        visible = j[:, None, :] <= last_seen[:, :, None]
        offset = torch.arange(total, device=device) - first[unit]
        return cls(query_index, key_index, visible[:, None], unit * width_q + offset)


def shared_prompt_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    units: SharedPromptUnits,
    scale: float | None = None,
) -> torch.Tensor:
    """Packed ``[T, heads, dim]`` q/k/v (fewer key/value heads under GQA) -> ``[T, heads, value dim]``,
    each unit of a shared-prompt layout attending as :class:`SharedPromptUnits` says, in one fused call."""

    def gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # -> [U, heads, width, dim]
        rows = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
        # index_select: its backward is one index_add, several times cheaper on the CPU than the
        # accumulating index_put of plain indexing
        picked = rows.index_select(0, index.flatten()).view(*index.shape, *t.shape[1:])
        return picked.permute(0, 2, 1, 3)

    q = gather(query, units.query_index)
    k, v = gather(key, units.key_index), gather(value, units.key_index)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=units.visible, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )  # [U, heads, Lq, dim]
    return out.transpose(1, 2).flatten(0, 1).index_select(0, units.output_index)


def rows_of(
    cu_seqlens: torch.Tensor, positions: torch.Tensor | None = None, blocks: torch.Tensor | None = None
) -> PackedRows:
    """The padded layout of ``cu_seqlens``'s segments; given the tokens' ``positions`` (None for
    multimodal RoPE) and response ``blocks`` (``MicroBatch.response_blocks``), a shared-prompt layout
    (its visibility: ``PackedRows.hidden`` and ``PackedRows.units``)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    num_seqs = len(lengths)
    sequence = torch.repeat_interleave(torch.arange(num_seqs, device=cu_seqlens.device), lengths)
    offset = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - cu_seqlens[sequence]
    index = offset * num_seqs + sequence
    max_len = int(lengths.max())
    if blocks is None:
        return PackedRows(cu_seqlens, offset, index, max_len, num_seqs, sequence)
    return PackedRows(cu_seqlens, positions, index, max_len, num_seqs, sequence, blocks)


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
