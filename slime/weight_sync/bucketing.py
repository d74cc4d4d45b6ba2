"""Grouping named tensors into buckets of bounded size (``--update-weight-buffer-size``).

One HTTP call and one transfer per bucket: big enough to amortise the call, small enough that the
trainer never holds a second copy of the whole model. Both live transports send each bucket as
flattened per-dtype buffers (SGLang's ``flattened_bucket`` load format).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from slime.weight_sync.ipc import FlattenedBucket, StagingBuffer, split_by_dtype

NamedTensors = list[tuple[str, torch.Tensor]]


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[NamedTensors]:
    """Consecutive buckets of at most ``max_bytes`` (a tensor larger than that travels alone)."""
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def iter_packed_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    max_bytes: int,
    staging: Sequence[StagingBuffer],
) -> Iterator[tuple[FlattenedBucket, bool]]:
    """Per-dtype buckets, each packed into one buffer, with whether it is the last: ``(bucket, is_last)``.

    Buckets go to ``staging[0], staging[1], ...`` in turn, so with two buffers the next bucket is
    packed while the caller's transfer of the current one is in flight. A buffer is packed again
    ``len(staging)`` buckets later: the caller must have finished with a bucket (its receivers have
    read it) before asking for the one after next. Looking one group ahead tells which is last,
    the bucket that carries the weight version.
    """
    groups = (group for bucket in iter_buckets(named_tensors, max_bytes) for group in split_by_dtype(bucket))
    current = next(groups, None)
    index = 0
    while current is not None:
        following = next(groups, None)
        yield staging[index % len(staging)].pack(current), following is None
        current, index = following, index + 1
