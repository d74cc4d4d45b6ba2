"""Grouping named tensors into buckets of bounded size (``--update-weight-buffer-size``).

One HTTP call and one round of broadcasts per bucket: big enough to amortise the call, small
enough that the trainer never holds a second copy of the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

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
