"""Slot-based KV cache for continuous batching on top of an unmodified transformers model.

Why not `transformers.DynamicCache`: it appends one column for the whole batch (`torch.cat`, a copy of
the entire cache every step) and it has no notion of requests joining or leaving a batch. Here each
running request owns one *slot* (a row of a preallocated `[rows, kv_heads, columns, head_dim]` buffer
per layer) and keeps its tokens at columns `0 .. len-1`, i.e. column == position:

- prefill of new requests runs them left-padded to a common width (so the model computes logits for
  the last column only) and copies each row's real tokens into columns `0 .. len-1` of a fresh slot;
  attention within a prefill uses the new keys directly (fresh slots have no past);
- a decode step writes each request's new key/value at its own column (one scatter per layer), and
  attention runs over columns `0 .. max(len)` with a mask that hides each row's columns past its own
  position;
- finished requests leave by moving the running requests past the new end into their holes (one
  copy per layer for all of them), so the running batch is always the contiguous rows `0 .. n-1`
  and the model sees views, never copies.

The scheduler states what the next forward does through `ForwardPlan`; the model calls `update()` per
layer exactly as it would on a DynamicCache. Buffers grow by doubling and are dropped by `clear()`
(releasing the kv_cache memory, a retraction, an error); a flush keeps them, as SGLang keeps its pool.
Requires the transformers >= 5 Cache API (`Cache(layers=...)`, `CacheLayerMixin`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # pragma: no cover - depends on the installed transformers
    raise ImportError("the torch engine needs transformers >= 5 (Cache with CacheLayerMixin layers)") from exc


@dataclass
class ForwardPlan:
    """Where the next forward reads and writes: rows `start .. end-1`, attention over `kv_length` columns.

    `decode_positions` is None for a prefill (row i's tokens are left-padded by `prefill_pads[i]` and land
    at columns `0 .. q-1-pad`) and a `[end - start]` long tensor for a decode step (one new token per row,
    at that row's column).
    """

    start: int = 0
    end: int = 0
    kv_length: int = 0
    decode_positions: torch.Tensor | None = None
    prefill_pads: list[int] | None = None


def _grow(size: int, needed: int, limit: int | None) -> int:
    while size < needed:
        size *= 2
    return size if limit is None else max(needed, min(size, limit))


class _SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values, for all slots."""

    is_sliding = False
    is_compileable = False

    def __init__(self, plan: ForwardPlan, max_rows: int | None, max_columns: int | None) -> None:
        super().__init__()
        self.plan = plan
        self.max_rows = max_rows
        self.max_columns = max_columns

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows = _grow(4, self.plan.end, self.max_rows)
        columns = _grow(64, self.plan.kv_length, self.max_columns)
        _, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.keys = key_states.new_zeros((rows, h, columns, dk))
        self.values = value_states.new_zeros((rows, h, columns, dv))
        self.device = key_states.device
        self.is_initialized = True

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` and ``values``, which exist once ``lazy_initialization`` ran."""
        assert self.keys is not None and self.values is not None, "used before lazy_initialization"
        return self.keys, self.values

    def _ensure_capacity(self, rows_needed: int, columns_needed: int) -> None:
        rows, _, columns, _ = self._buffers()[0].shape
        if rows >= rows_needed and columns >= columns_needed:
            return
        new_rows = _grow(rows, rows_needed, self.max_rows)
        new_columns = _grow(columns, columns_needed, self.max_columns)
        for attr in ("keys", "values"):
            old = getattr(self, attr)
            new = old.new_zeros((new_rows, old.shape[1], new_columns, old.shape[3]))
            new[:rows, :, :columns] = old
            setattr(self, attr, new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._ensure_capacity(plan.end, plan.kv_length)
        keys, values = self._buffers()
        rows = slice(plan.start, plan.end)
        if plan.decode_positions is None:
            q = key_states.shape[2]
            for i, pad in enumerate(plan.prefill_pads or [0] * (plan.end - plan.start)):
                keys[plan.start + i, :, : q - pad] = key_states[i, :, pad:]
                values[plan.start + i, :, : q - pad] = value_states[i, :, pad:]
            return key_states, value_states
        else:
            index = torch.arange(plan.start, plan.end, device=keys.device)
            keys[index, :, plan.decode_positions] = key_states[:, :, 0]
            values[index, :, plan.decode_positions] = value_states[:, :, 0]
        return keys[rows, :, : plan.kv_length], values[rows, :, : plan.kv_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.kv_length, 0

    def get_seq_length(self) -> int:
        return self.plan.kv_length

    def get_max_length(self) -> int:
        return -1

    def copy_rows(self, sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        self._ensure_capacity(int(targets.max()) + 1, length)
        keys, values = self._buffers()
        keys[targets, :, :length] = keys[sources, :, :length]
        values[targets, :, :length] = values[sources, :, :length]

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def nbytes(self) -> int:
        keys, values = self.keys, self.values  # read once: another thread may reset() meanwhile
        if keys is None or values is None:
            return 0
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()


class SlotKVCache(Cache):
    """The model-facing cache object; the scheduler sets `plan` before every forward."""

    def __init__(self, num_layers: int, max_rows: int | None = None, max_columns: int | None = None) -> None:
        self.plan = ForwardPlan()
        layers = [_SlotLayer(self.plan, max_rows, max_columns) for _ in range(num_layers)]
        super().__init__(layers=list(layers))
        self.slot_layers = layers  # the layers of ``self.layers``, typed as this cache's own

    def set_prefill(self, start: int, end: int, length: int, pads: list[int]) -> None:
        """Next forward: prompts left-padded to `length` (row i by `pads[i]`) for fresh slots `start ..`."""
        self.plan.start, self.plan.end, self.plan.kv_length = start, end, length
        self.plan.decode_positions, self.plan.prefill_pads = None, pads

    def set_decode(self, num_rows: int, positions: torch.Tensor, kv_length: int) -> None:
        """Next forward: one token per slot `0 .. num_rows-1`, written at column `positions[row]`."""
        self.plan.start, self.plan.end = 0, num_rows
        self.plan.kv_length = kv_length
        self.plan.decode_positions = positions

    def copy_rows(self, copies: list[tuple[int, int, int]]) -> None:
        """For each ``(source, target, length)``: slot ``target`` gets the first ``length`` columns of
        slot ``source`` (a request with the same tokens, just prefilled; or one that changes slot).
        No target is also a source."""
        if not copies or not self.slot_layers[0].is_initialized:
            return
        sources = torch.tensor([c[0] for c in copies])
        targets = torch.tensor([c[1] for c in copies])
        length = max(c[2] for c in copies)  # columns past a row's own length are never read
        for layer in self.slot_layers:
            layer.copy_rows(sources, targets, length)

    def clear(self) -> None:
        """Drop every buffer (flush_cache, release of the kv_cache memory)."""
        for layer in self.layers:
            layer.reset()

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.slot_layers)
