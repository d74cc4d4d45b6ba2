"""A rank's train data (a dict of per-sample lists) cut into padded micro-batches.

Sequences are right-padded: under causal attention a token never attends to the padding after it,
so the log-probs of real tokens are exactly those of the unpadded sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TrainData = dict[str, list]
"""Per-sample lists, all of one length. Required keys: ``tokens`` (prompt + response ids),
``response_lengths``, ``loss_masks`` (one 0/1 per response token) and ``loss_weights`` (the factor
that turns a sample's token sum into its share of the global loss; see ``slime.algorithms.aggregation``).
Algorithms add their own per-sample keys (``advantages``, ``old_log_probs``, ...)."""

SAMPLE_KEYS = ("tokens", "response_lengths", "loss_masks")
REQUIRED_KEYS = (*SAMPLE_KEYS, "loss_weights")


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    position_ids: torch.Tensor
    total_lengths: list[int]
    response_lengths: list[int]
    samples: TrainData

    def per_sample(
        self, key: str, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        """One tensor per sample for a per-sample key (e.g. ``loss_masks``, ``advantages``)."""
        return [torch.as_tensor(v, dtype=dtype, device=device) for v in self.samples[key]]

    def response_slices(self, per_position: torch.Tensor) -> list[torch.Tensor]:
        """The response part of a ``[b, s-1]`` tensor of next-token quantities, one tensor per sample."""
        out = []
        for row, total, response in zip(per_position, self.total_lengths, self.response_lengths, strict=True):
            out.append(row[total - response - 1 : total - 1])
        return out


def check_train_data(data: TrainData, required: tuple[str, ...] = REQUIRED_KEYS) -> int:
    """Number of samples; fails loudly on missing keys or ragged lists (a driver bug, not user input)."""
    missing = [key for key in required if key not in data]
    if missing:
        raise KeyError(f"train data lacks {missing}; it has {sorted(data)}")
    sizes = {key: len(values) for key, values in data.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"train data lists differ in length: {sizes}")
    return sizes["tokens"]


def make_micro_batches(
    data: TrainData, micro_batch_size: int, device: torch.device, pad_id: int = 0
) -> list[MicroBatch]:
    """Consecutive groups of ``micro_batch_size`` samples, padded to the longest in each group."""
    n = check_train_data(data)
    batches = []
    for start in range(0, n, micro_batch_size):
        index = range(start, min(start + micro_batch_size, n))
        samples = {key: [values[i] for i in index] for key, values in data.items()}
        lengths = [len(t) for t in samples["tokens"]]
        tokens = torch.full((len(index), max(lengths)), pad_id, dtype=torch.long)
        for row, seq in enumerate(samples["tokens"]):
            tokens[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        batches.append(
            MicroBatch(
                tokens=tokens.to(device),
                position_ids=positions.to(device),
                total_lengths=lengths,
                response_lengths=list(samples["response_lengths"]),
                samples=samples,
            )
        )
    return batches
