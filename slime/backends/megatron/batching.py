"""A rank's train data (a dict of per-sample lists) cut into micro-batches, packed or padded.

Packed (``--qkv-format thd``, the default): the sequences of a micro-batch lie end to end in one
``[1, T]`` row with no padding between them; ``cu_seqlens`` marks where each starts, so attention stays
inside a sequence and RoPE restarts at 0 in each (megatron-core's THD layout). Padded
(``--qkv-format bshd``): one right-padded row per sample; under causal attention a token never attends
to the padding after it, so the log-probs of real tokens are exactly those of the unpadded sequence.

Packed with ``--share-prompts-in-train``: the samples of a micro-batch that have the same prompt (a
GRPO group) share one segment, ``[prompt, response 1, response 2, ...]``, in which the prompt is
computed once and each response attends to the prompt and to itself only, at the positions it has in
its own sequence (``response_blocks``). Every response token then sees exactly the keys it sees
unpacked, so log-probs, loss and gradient are those of the plain layout (the prompt's gradient is the
sum of its samples', summed once); the forward and backward run over the prompt once instead of once
per sample (8 times, on the quickstart, where the prompt is 80 % of a sample's tokens).

Which samples share a micro-batch: ``--micro-batch-size`` consecutive samples, or with
``--use-dynamic-batch-size`` bins of at most ``--max-tokens-per-gpu`` tokens, as many on every
data-parallel rank (:func:`partition_by_token_budget`).

A vision-language model (``mrope``, read from the HF config) gets three rows of RoPE positions per
token (``mrope_positions``) and the images of each micro-batch: every sequence keeps the positions it
has alone, in either layout and in a shared segment, and the row's images come in the order of their
pad tokens, a shared prompt's once. Text and image samples mix freely; without ``mrope`` the text
layout is as it always was.

This module is pure torch (the Ray driver imports it); Megatron's side is ``packed_attention``.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from slime.backends.megatron.mrope_positions import MropeConfig, image_spans, mrope_positions
from slime.rollout.train_data import TrainData

SAMPLE_KEYS = ("tokens", "response_lengths", "loss_masks")
REQUIRED_KEYS = (*SAMPLE_KEYS, "loss_weights")
"""What a rank's train data must hold: ``tokens`` (prompt + response ids), ``response_lengths``,
``loss_masks`` (one 0/1 per response token) and ``loss_weights`` (the factor that turns a sample's token
sum into its share of the global loss; see ``slime.algorithms.aggregation``)."""
MULTIMODAL_KEY = "multimodal_train_inputs"
"""The optional per-sample key of a VLM's images: ``{"pixel_values": [patches, C*T*P*P],
"image_grid_thw": [n_images, 3]}``, or None for a text sample (``Sample.multimodal_train_inputs``)."""
IMAGE_KEYS = frozenset({"pixel_values", "image_grid_thw"})


@dataclass
class MicroBatch:
    """The model input of one micro-batch and the samples it holds.

    The logits that predict sample ``k``'s response tokens (``indices[k]`` of the rank's data) sit at
    ``tokens``' row ``predictor_rows`` and column ``predictor_columns``, every sample's response end to
    end; ``targets`` are those tokens, in the same order.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    """int64 ``[b, s]``; for a VLM ``[3, b, s]``, the temporal, height and width rows (MRoPE)."""
    total_lengths: list[int]
    response_lengths: list[int]
    samples: TrainData
    indices: list[int]
    predictor_rows: torch.Tensor
    predictor_columns: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    """Packed only: int32 segment boundaries in the row (a trailing pad segment included)."""
    max_seqlen: int = 0
    response_blocks: torch.Tensor | None = None
    """Packed with shared prompts only: per token of the row, 0 in a prompt (and in the padding) and
    ``i`` in the ``i``-th response of its segment, which attends to the prompt and to itself."""
    pixel_values: torch.Tensor | None = None
    """VLM only: the patches ``[sum of t*h*w, C*T*P*P]`` of the images whose pad tokens are in
    ``tokens``, image after image in the order their pads occur (row by row; a shared prompt's once);
    None when the micro-batch holds no image."""
    image_grid_thw: torch.Tensor | None = None
    """VLM only: int64 ``[n_images, 3]``, the grids of ``pixel_values``' images, in the same order."""
    image_mask: torch.Tensor | None = None
    """VLM only: bool ``[b, s]``, True at the image pad tokens the images' features replace (an image's
    run after ``<|vision_start|>``; a pad the model sampled elsewhere is a token like any other)."""
    token_positions: torch.Tensor | None = None
    """int64 ``[N, 2]`` on the CPU, N the samples' tokens end to end: the ``(row, column)`` of ``tokens``
    where each is computed (a shared prompt's tokens at its segment's prompt, for every sample of the
    group). MoE routing replay lays per-token routes out by it (``routing_replay``)."""

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def per_sample(
        self, key: str, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        """One tensor per sample for a per-sample key (e.g. ``loss_masks``, ``advantages``): lists are
        made one tensor and split (one op instead of one per sample), anything else one by one."""
        values = self.samples[key]
        if all(type(v) is list for v in values):
            flat = torch.tensor([x for v in values for x in v], dtype=dtype, device=device)
            return list(flat.split([len(v) for v in values]))
        return [torch.as_tensor(v, dtype=dtype, device=device) for v in values]

    def at_predictors(self, per_position: torch.Tensor) -> torch.Tensor:
        """``[b, s, ...]`` -> ``[N, ...]``: the entries at the positions that predict the N response
        tokens. A position predicts the token after it; a shared prompt's last one predicts the first
        token of each of its responses, so it is picked once for each."""
        return per_position[self.predictor_rows, self.predictor_columns]

    def split_responses(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``[N, ...]`` in response-token order -> one tensor per sample."""
        return list(flat.split(self.response_lengths))

    def response_slices(self, per_position: torch.Tensor) -> list[torch.Tensor]:
        """Per sample, the ``[b, s, ...]`` quantity at the positions that predict its response tokens."""
        return self.split_responses(self.at_predictors(per_position))


def check_train_data(data: TrainData, required: tuple[str, ...] = REQUIRED_KEYS) -> int:
    """Number of samples; fails loudly on missing keys or ragged lists (a driver bug, not user input)."""
    missing = [key for key in required if key not in data]
    if missing:
        raise KeyError(f"train data lacks {missing}; it has {sorted(data)}")
    sizes = {key: len(values) for key, values in data.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"train data lists differ in length: {sizes}")
    # The first token has no prediction; a longer "response" would read the previous packed sequence.
    for i, (tokens, response) in enumerate(zip(data["tokens"], data["response_lengths"], strict=True)):
        if not 0 < response < len(tokens):
            raise ValueError(f"sample {i}: response of {response} tokens in a sequence of {len(tokens)}")
    return sizes["tokens"]


def consecutive_groups(num_samples: int, size: int) -> list[list[int]]:
    """``--micro-batch-size`` consecutive samples per micro-batch (the last may hold fewer)."""
    return [list(range(start, min(start + size, num_samples))) for start in range(0, num_samples, size)]


def _first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, load in enumerate(loads) if load + lengths[i] <= budget), None)
        if slot is None:
            bins.append([i])
            loads.append(lengths[i])
        else:
            bins[slot].append(i)
            loads[slot] += lengths[i]
    return bins


def min_bin_count(lengths: Sequence[int], budget: int) -> int:
    """How many micro-batches of at most ``budget`` tokens this rank needs (first-fit decreasing)."""
    _check_fits(lengths, budget)
    return len(_first_fit_decreasing(lengths, budget))


def _check_fits(lengths: Sequence[int], budget: int) -> None:
    if lengths and max(lengths) > budget:
        raise ValueError(f"a sample of {max(lengths)} tokens exceeds the micro-batch budget of {budget}")


def partition_by_token_budget(lengths: Sequence[int], budget: int, num_bins: int) -> list[list[int]]:
    """Sample indices cut into exactly ``num_bins`` non-empty micro-batches of at most ``budget`` tokens.

    Every data-parallel rank must run the same number of micro-batches, so ``num_bins`` is the largest
    :func:`min_bin_count` over the ranks. Longest-first into the least-loaded bin balances the tokens;
    where that overflows the budget, first-fit decreasing packing is split (largest bins first) up to
    ``num_bins``, which stays under the budget. Indices are ascending within a bin, bins ordered by
    their first index.
    """
    _check_fits(lengths, budget)
    if not 1 <= num_bins <= len(lengths):
        raise ValueError(f"cannot cut {len(lengths)} samples into {num_bins} non-empty micro-batches")
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    if max(load for load, _ in heap) > budget:
        bins = _first_fit_decreasing(lengths, budget)
        if len(bins) > num_bins:
            raise ValueError(f"{len(lengths)} samples need {len(bins)} micro-batches of {budget} tokens")
        while len(bins) < num_bins:
            largest = max(bins, key=len)
            bins.remove(largest)
            bins.extend([largest[::2], largest[1::2]])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def make_micro_batches(
    data: TrainData,
    groups: list[list[int]],
    device: torch.device,
    packed: bool = True,
    pad_to_multiple: int = 1,
    pad_id: int = 0,
    share_prompts: bool = False,
    mrope: MropeConfig | None = None,
) -> list[MicroBatch]:
    """One micro-batch per group of sample indices.

    A packed row is padded at its end to a multiple of ``pad_to_multiple`` (the tensor-parallel size,
    so that sequence parallelism can split it) with one extra segment that no sample reads. With
    ``share_prompts`` the samples of a packed micro-batch that have the same prompt (and the same
    images in it) share it. ``mrope``: the model is a VLM; the micro-batches get MRoPE positions and
    the images of ``MULTIMODAL_KEY``.
    """
    check_train_data(data)
    if mrope is None and any(inputs is not None for inputs in data.get(MULTIMODAL_KEY, ())):
        raise ValueError("the train data holds images but the model is not a vision-language model")
    if packed:
        return [
            _packed(data, group, device, pad_to_multiple, pad_id, share_prompts, mrope) for group in groups
        ]
    return [_padded(data, group, device, pad_id, mrope) for group in groups]


@dataclass(frozen=True)
class _Layout:
    """One sample alone: its positions (``[1, L]``, or ``[3, L]`` for a VLM), where its images' pads
    lie and each image's grid and patches."""

    positions: torch.Tensor
    spans: list[tuple[int, int]]
    grids: list[torch.Tensor]
    pixels: list[torch.Tensor]

    def images_in(self, start: int, end: int) -> list[int]:
        """The images whose pads lie in ``[start, end)``; one cut by a bound is a data bug."""
        if any(s < end and e > start and not start <= s < e <= end for s, e in self.spans):
            raise ValueError(f"an image's pad tokens cross position {start} or {end} of the sequence")
        return [i for i, (s, e) in enumerate(self.spans) if start <= s and e <= end]

    def mask(self, start: int, end: int) -> torch.Tensor:
        """Bool ``[end - start]``: True at the image pad tokens of ``[start, end)``."""
        mask = torch.zeros(end - start, dtype=torch.bool)
        for i in self.images_in(start, end):
            mask[self.spans[i][0] - start : self.spans[i][1] - start] = True
        return mask

    def image_key(self, start: int, end: int) -> bytes:
        """A digest of the images in ``[start, end)``: equal prompt ids may hold different pictures."""
        digest = hashlib.sha256()
        for i in self.images_in(start, end):
            digest.update(self.grids[i].numpy().tobytes())
            digest.update(self.pixels[i].numpy().tobytes())
        return digest.digest()


def _layouts(samples: TrainData, mrope: MropeConfig | None) -> list[_Layout]:
    if mrope is None:
        return [_Layout(torch.arange(len(seq))[None], [], [], []) for seq in samples["tokens"]]
    layouts = []
    for seq, inputs in zip(
        samples["tokens"], samples.get(MULTIMODAL_KEY, [None] * len(samples["tokens"])), strict=True
    ):
        grids: torch.Tensor | None = None
        pixels: torch.Tensor | None = None
        if inputs is not None:
            if set(inputs) - IMAGE_KEYS:
                raise ValueError(
                    f"only images are supported; a sample has {sorted(set(inputs) - IMAGE_KEYS)}"
                )
            grids = torch.as_tensor(inputs["image_grid_thw"], dtype=torch.long).reshape(-1, 3).cpu()
            pixels = torch.as_tensor(inputs["pixel_values"]).cpu()
            if pixels.shape[0] != int(grids.prod(-1).sum()):
                raise ValueError(f"{pixels.shape[0]} patches for grids {grids.tolist()}")
        layouts.append(
            _Layout(
                mrope_positions(seq, grids, **asdict(mrope)),
                image_spans(seq, grids, **asdict(mrope)),
                list(grids) if grids is not None else [],
                list(pixels.split(grids.prod(-1).tolist()))
                if pixels is not None and grids is not None
                else [],
            )
        )
    return layouts


def _images(
    pieces: list[tuple[_Layout, int, int]], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``pixel_values`` and ``image_grid_thw`` of the images in the ``(sample, start, end)`` pieces of
    a micro-batch, in the order the pieces lie in its rows; None, None without an image."""
    chosen = [(layout, i) for layout, start, end in pieces for i in layout.images_in(start, end)]
    if not chosen:
        return None, None
    pixels = torch.cat([layout.pixels[i] for layout, i in chosen])
    grids = torch.stack([layout.grids[i] for layout, i in chosen])
    return pixels.to(device), grids.to(device)


def _image_mask(rows: list[list[torch.Tensor]], width: int, device: torch.device) -> torch.Tensor:
    """Bool ``[len(rows), width]`` from each row's piece masks laid end to end (False after them)."""
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, pieces in enumerate(rows):
        joined = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool)
        mask[row, : len(joined)] = joined
    return mask.to(device)


def _select(data: TrainData, group: list[int]) -> TrainData:
    return {key: [values[i] for i in group] for key, values in data.items()}


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _responses(samples: TrainData) -> list[int]:
    pairs = zip(samples["tokens"], samples["response_lengths"], strict=True)
    return [token for seq, n in pairs for token in seq[-n:]]


def _padded(
    data: TrainData, group: list[int], device: torch.device, pad_id: int, mrope: MropeConfig | None
) -> MicroBatch:
    samples = _select(data, group)
    lengths = [len(t) for t in samples["tokens"]]
    responses = list(samples["response_lengths"])
    tokens = torch.full((len(group), max(lengths)), pad_id, dtype=torch.long)
    for row, seq in enumerate(samples["tokens"]):
        tokens[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    layouts = _layouts(samples, mrope)
    # The padding after a sequence continues its positions (read by no real token under causal masking).
    padding = [torch.arange(tokens.shape[1] - len(seq)) for seq in samples["tokens"]]
    per_row = [
        torch.cat([x.positions, (x.positions.max() + 1 + pad).expand(len(x.positions), -1)], 1)
        for x, pad in zip(layouts, padding, strict=True)
    ]
    positions = torch.stack(per_row, 1) if mrope is not None else torch.cat(per_row)  # [3, b, s] or [b, s]
    whole = [(x, 0, len(seq)) for x, seq in zip(layouts, samples["tokens"], strict=True)]
    pixel_values, image_grid_thw = _images(whole, device)
    image_mask = None
    if pixel_values is not None:
        image_mask = _image_mask([[x.mask(0, end)] for x, _, end in whole], tokens.shape[1], device)
    rows = [row for row, n in enumerate(responses) for _ in range(n)]
    token_positions = torch.cat(
        [torch.stack([torch.full((n,), row), torch.arange(n)], 1) for row, n in enumerate(lengths)]
    )
    pairs = zip(lengths, responses, strict=True)
    columns = [c for total, n in pairs for c in range(total - n - 1, total - 1)]
    return MicroBatch(
        tokens=tokens.to(device),
        position_ids=positions.to(device),
        total_lengths=lengths,
        response_lengths=responses,
        samples=samples,
        indices=list(group),
        predictor_rows=_long(rows, device),
        predictor_columns=_long(columns, device),
        targets=_long(_responses(samples), device),
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        image_mask=image_mask,
        token_positions=token_positions,
    )


def prompt_segments(
    samples: TrainData, share: bool, image_keys: Sequence[bytes] | None = None
) -> list[list[int]]:
    """The samples (positions in ``samples``) of each packed segment, in order of first appearance:
    one sample each, or with ``share`` every sample of one prompt (its tokens before the response,
    and ``image_keys[k]``, sample ``k``'s prompt images, when given)."""
    if not share:
        return [[k] for k in range(len(samples["tokens"]))]
    by_prompt: dict[tuple[tuple[int, ...], bytes], list[int]] = {}
    for k, (seq, n) in enumerate(zip(samples["tokens"], samples["response_lengths"], strict=True)):
        key = (tuple(seq[: len(seq) - n]), image_keys[k] if image_keys is not None else b"")
        by_prompt.setdefault(key, []).append(k)
    return list(by_prompt.values())


def _packed(
    data: TrainData,
    group: list[int],
    device: torch.device,
    multiple: int,
    pad_id: int,
    share: bool,
    mrope: MropeConfig | None,
) -> MicroBatch:
    samples = _select(data, group)
    tokens, responses = samples["tokens"], list(samples["response_lengths"])
    # A text row's positions are plain ranges, built as Python ints and made a tensor once (a quickstart
    # step's 128 samples cost ~5 ms of small tensor ops otherwise); a VLM's come from its layouts.
    layouts = _layouts(samples, mrope) if mrope is not None else None
    prompts = [len(seq) - n for seq, n in zip(tokens, responses, strict=True)]
    keys = None
    if share and layouts is not None:
        keys = [x.image_key(0, p) for x, p in zip(layouts, prompts, strict=True)]
    flat: list[int] = []
    text_positions: list[int] = []  # the text row's positions (each sequence counts from 0)
    positions: list[torch.Tensor] = []  # a VLM row's [3, n] pieces: each sequence's own positions
    pieces: list[tuple[_Layout, int, int]] = []  # what of which sample a VLM row holds, in order

    def place(k: int, begin: int, end: int) -> None:
        """Sample ``k``'s tokens ``[begin, end)`` go next in the row: their positions (and images)."""
        if layouts is None:
            text_positions.extend(range(begin, end))
        else:
            positions.append(layouts[k].positions[:, begin:end])
            pieces.append((layouts[k], begin, end))

    blocks: list[int] = []
    segments: list[int] = []
    predictors: list[list[int]] = [[] for _ in tokens]
    columns_of: list[list[int]] = [[] for _ in tokens]  # where each sample's tokens lie in the row
    for members in prompt_segments(samples, share, keys):
        start = len(flat)
        prompt = prompts[members[0]]
        flat += tokens[members[0]][:prompt]
        place(members[0], 0, prompt)
        blocks += [0] * prompt
        for block, k in enumerate(members, 1):
            at = len(flat)
            flat += tokens[k][prompt:]
            place(k, prompt, len(tokens[k]))
            blocks += [block] * responses[k]
            predictors[k] = [start + prompt - 1, *range(at, at + responses[k] - 1)]
            columns_of[k] = [*range(start, start + prompt), *range(at, at + responses[k])]
        segments.append(len(flat) - start)
    pad = -len(flat) % multiple
    if pad:
        segments.append(pad)
        flat += [pad_id] * pad
        if layouts is None:
            text_positions.extend(range(pad))
        else:
            positions.append(torch.arange(pad).expand(len(positions[0]), pad))
        blocks += [0] * pad
    row = torch.cat(positions, 1) if layouts is not None else torch.tensor([text_positions])
    pixel_values, image_grid_thw = _images(pieces, device)
    image_mask = None
    if pixel_values is not None:
        image_mask = _image_mask([[x.mask(a, b) for x, a, b in pieces]], len(flat), device)
    bounds = torch.tensor([0, *segments], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    shared = len(segments) - bool(pad) < len(tokens)
    columns = [c for per_sample in predictors for c in per_sample]
    columns_in_row = torch.tensor([c for per_sample in columns_of for c in per_sample], dtype=torch.long)
    return MicroBatch(
        tokens=torch.tensor([flat], dtype=torch.long).to(device),
        position_ids=(row[:, None] if mrope is not None else row).to(device),  # [3, 1, T] or [1, T]
        total_lengths=[len(t) for t in tokens],
        response_lengths=responses,
        samples=samples,
        indices=list(group),
        predictor_rows=torch.zeros(len(columns), dtype=torch.long, device=device),
        predictor_columns=_long(columns, device),
        targets=_long(_responses(samples), device),
        cu_seqlens=bounds.to(device),
        max_seqlen=max(segments),
        response_blocks=_long(blocks, device) if shared else None,
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        image_mask=image_mask,
        token_positions=torch.stack([torch.zeros_like(columns_in_row), columns_in_row], 1),
    )


def pad_to_shape(batch: MicroBatch, rows: int, length: int, pad_id: int = 0) -> MicroBatch:
    """``batch`` with its token rows padded to ``[rows, length]``; the padding is read by no sample.

    The interleaved (virtual-stage) pipeline schedule exchanges activations of one fixed shape, so
    there every micro-batch of a step is padded to the largest. A packed row gets one more segment
    (its own attention span), a padded layout more columns and empty rows.
    """
    extra_rows, extra_cols = rows - batch.tokens.shape[0], length - batch.tokens.shape[1]
    if extra_rows < 0 or extra_cols < 0:
        raise ValueError(f"cannot pad a {list(batch.tokens.shape)} micro-batch to {[rows, length]}")
    if extra_rows == extra_cols == 0:
        return batch
    if batch.packed and extra_rows:
        raise ValueError("a packed micro-batch is one row")
    device = batch.tokens.device
    tokens = torch.nn.functional.pad(batch.tokens, (0, extra_cols, 0, extra_rows), value=pad_id)
    if batch.image_mask is not None:
        wider_mask = torch.nn.functional.pad(batch.image_mask, (0, extra_cols, 0, extra_rows))
        batch = replace(batch, image_mask=wider_mask)
    vlm = batch.position_ids.dim() == 3  # [3, b, s]
    if batch.packed:
        assert batch.cu_seqlens is not None  # what packed means
        extra = torch.arange(extra_cols, device=device).expand(*batch.position_ids.shape[:-1], extra_cols)
        positions = torch.cat([batch.position_ids, extra], dim=-1)
        bounds = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + extra_cols])
        blocks = batch.response_blocks
        if blocks is not None:
            blocks = torch.nn.functional.pad(blocks, (0, extra_cols))
        return replace(
            batch, tokens=tokens, position_ids=positions, cu_seqlens=bounds,
            max_seqlen=max(batch.max_seqlen, extra_cols), response_blocks=blocks,
        )  # fmt: skip
    if not vlm:
        positions = torch.arange(length, device=device).expand(rows, length)
        return replace(batch, tokens=tokens, position_ids=positions)
    # Each row's padding continues its positions, as in ``make_micro_batches``; new rows count from 0.
    last = batch.position_ids.amax(dim=(0, 2), keepdim=True)  # [1, b, 1]
    after = (last + 1 + torch.arange(extra_cols, device=device)).expand(3, -1, -1)
    wider = torch.cat([batch.position_ids, after], dim=2)
    new_rows = torch.arange(length, device=device).expand(3, extra_rows, length)
    return replace(batch, tokens=tokens, position_ids=torch.cat([wider, new_rows], dim=1))


def interleaved_count(count: int, num_samples: int, pipeline_size: int) -> int:
    """The micro-batch count nearest ``count`` that megatron-core's interleaved schedule runs: a
    multiple of the pipeline size (rounded up while there are samples for it, else down)."""
    if num_samples < pipeline_size:
        raise ValueError(
            f"{num_samples} samples cannot fill the {pipeline_size} micro-batches that virtual pipeline "
            "stages need at least; raise the batch or drop --num-layers-per-virtual-pipeline-stage"
        )
    up = -(-count // pipeline_size) * pipeline_size
    return up if up <= num_samples else num_samples // pipeline_size * pipeline_size


def even_groups(num_samples: int, count: int) -> list[list[int]]:
    """Consecutive samples cut into ``count`` groups whose sizes differ by at most one."""
    size, extra = divmod(num_samples, count)
    starts = [k * size + min(k, extra) for k in range(count + 1)]
    return [list(range(starts[k], starts[k + 1])) for k in range(count)]
