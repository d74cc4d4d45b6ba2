"""Grouping named tensors into buckets of bounded size (``--update-weight-buffer-size``).

One HTTP call and one transfer per bucket: big enough to amortise the call, small enough that the
trainer never holds a second copy of the whole model. Both live transports send each bucket as
flattened per-dtype buffers (SGLang's ``flattened_bucket`` load format).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

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


def send_pipelined(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    max_bytes: int,
    staging: Sequence[StagingBuffer],
    start: Callable[[FlattenedBucket, str | None], Callable[[], None]],
    weight_version: str,
) -> int:
    """Packs the weights into buckets and ``start``s each (``start`` returns the call that waits for
    it); the next bucket is packed while the previous one is in flight. The last bucket carries
    ``weight_version``. The staging buffers are released at the end; returns the bytes sent."""
    num_bytes = 0
    in_flight: Callable[[], None] | None = None
    try:
        for bucket, is_last in iter_packed_buckets(named_tensors, max_bytes, staging):
            if in_flight is not None:
                in_flight()
            in_flight = start(bucket, weight_version if is_last else None)
            num_bytes += bucket.nbytes
        if in_flight is not None:
            in_flight()
    finally:
        for buffer in staging:
            buffer.release()
    return num_bytes
