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

This module is pure torch (the Ray driver imports it); Megatron's side is ``packed_attention``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from slime.config.errors import ConfigError
from slime.rollout.train_data import TrainData

SAMPLE_KEYS = ("tokens", "response_lengths", "loss_masks")
REQUIRED_KEYS = (*SAMPLE_KEYS, "loss_weights")
"""What a rank's train data must hold: ``tokens`` (prompt + response ids), ``response_lengths``,
``loss_masks`` (one 0/1 per response token) and ``loss_weights`` (the factor that turns a sample's token
sum into its share of the global loss; see ``slime.algorithms.aggregation``)."""


@dataclass
class MicroBatch:
    """The model input of one micro-batch and the samples it holds.

    The logits that predict sample ``k``'s response tokens (``indices[k]`` of the rank's data) sit at
    ``tokens``' row ``predictor_rows`` and column ``predictor_columns``, every sample's response end to
    end; ``targets`` are those tokens, in the same order.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
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

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def per_sample(
        self, key: str, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        """One tensor per sample for a per-sample key (e.g. ``loss_masks``, ``advantages``)."""
        return [torch.as_tensor(v, dtype=dtype, device=device) for v in self.samples[key]]

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


def check_token_budget(tokens: Sequence[Sequence[int]], max_tokens_per_gpu: int | None) -> None:
    """Refuses a rollout whose longest sample alone exceeds ``--max-tokens-per-gpu`` (None: no budget).
    Checked on the driver when the data arrives: sample lengths are only known then."""
    longest = max((len(t) for t in tokens), default=0)
    if max_tokens_per_gpu is not None and longest > max_tokens_per_gpu:
        raise ConfigError(
            "--max-tokens-per-gpu",
            f"{max_tokens_per_gpu} is below the longest sample ({longest} tokens); "
            f"raise it to at least {longest}",
        )


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
) -> list[MicroBatch]:
    """One micro-batch per group of sample indices.

    A packed row is padded at its end to a multiple of ``pad_to_multiple`` (the tensor-parallel size,
    so that sequence parallelism can split it) with one extra segment that no sample reads. With
    ``share_prompts`` the samples of a packed micro-batch that have the same prompt share it.
    """
    check_train_data(data)
    if packed:
        return [_packed(data, group, device, pad_to_multiple, pad_id, share_prompts) for group in groups]
    return [_padded(data, group, device, pad_id) for group in groups]


def _select(data: TrainData, group: list[int]) -> TrainData:
    return {key: [values[i] for i in group] for key, values in data.items()}


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _responses(samples: TrainData) -> list[int]:
    pairs = zip(samples["tokens"], samples["response_lengths"], strict=True)
    return [token for seq, n in pairs for token in seq[-n:]]


def _padded(data: TrainData, group: list[int], device: torch.device, pad_id: int) -> MicroBatch:
    samples = _select(data, group)
    lengths = [len(t) for t in samples["tokens"]]
    responses = list(samples["response_lengths"])
    tokens = torch.full((len(group), max(lengths)), pad_id, dtype=torch.long)
    for row, seq in enumerate(samples["tokens"]):
        tokens[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    rows = [row for row, n in enumerate(responses) for _ in range(n)]
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
    )


def prompt_segments(samples: TrainData, share: bool) -> list[list[int]]:
    """The samples (positions in ``samples``) of each packed segment, in order of first appearance:
    one sample each, or with ``share`` every sample of one prompt (its tokens before the response)."""
    if not share:
        return [[k] for k in range(len(samples["tokens"]))]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for k, (seq, n) in enumerate(zip(samples["tokens"], samples["response_lengths"], strict=True)):
        by_prompt.setdefault(tuple(seq[: len(seq) - n]), []).append(k)
    return list(by_prompt.values())


def _packed(
    data: TrainData, group: list[int], device: torch.device, multiple: int, pad_id: int, share: bool
) -> MicroBatch:
    samples = _select(data, group)
    tokens, responses = samples["tokens"], list(samples["response_lengths"])
    flat: list[int] = []
    positions: list[int] = []
    blocks: list[int] = []
    segments: list[int] = []
    predictors: list[list[int]] = [[] for _ in tokens]
    for members in prompt_segments(samples, share):
        start = len(flat)
        prompt = len(tokens[members[0]]) - responses[members[0]]
        flat += tokens[members[0]][:prompt]
        positions += range(prompt)
        blocks += [0] * prompt
        for block, k in enumerate(members, 1):
            at = len(flat)
            flat += tokens[k][prompt:]
            positions += range(prompt, len(tokens[k]))
            blocks += [block] * responses[k]
            predictors[k] = [start + prompt - 1, *range(at, at + responses[k] - 1)]
        segments.append(len(flat) - start)
    pad = -len(flat) % multiple
    if pad:
        segments.append(pad)
        flat += [pad_id] * pad
        positions += range(pad)
        blocks += [0] * pad
    bounds = torch.tensor([0, *segments], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    shared = len(segments) - bool(pad) < len(tokens)
    columns = [c for per_sample in predictors for c in per_sample]
    return MicroBatch(
        tokens=torch.tensor([flat], dtype=torch.long).to(device),
        position_ids=torch.tensor([positions], dtype=torch.long).to(device),
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
    if batch.packed:
        assert batch.cu_seqlens is not None  # what packed means
        positions = torch.cat([batch.position_ids, torch.arange(extra_cols, device=device)[None]], dim=1)
        bounds = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + extra_cols])
        blocks = batch.response_blocks
        if blocks is not None:
            blocks = torch.nn.functional.pad(blocks, (0, extra_cols))
        return replace(
            batch, tokens=tokens, position_ids=positions, cu_seqlens=bounds,
            max_seqlen=max(batch.max_seqlen, extra_cols), response_blocks=blocks,
        )  # fmt: skip
    positions = torch.arange(length, device=device).expand(rows, length)
    return replace(batch, tokens=tokens, position_ids=positions)


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
