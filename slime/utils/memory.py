"""A process's device memory released between uses (``--colocate``: the trainer and the engines take
turns on the same GPUs).

The CPU/GPU seam itself is ``slime.utils.device``; this module only asks whether there is a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import torch

from slime.utils.hardware import has_gpu


def _memory_saver() -> Any | None:
    """``torch_memory_saver`` when it can serve this process (CUDA and the package), else None."""
    if not has_gpu() or os.environ.get("SLIME_MEMORY_SAVER", "1") == "0":
        return None
    try:
        import torch_memory_saver
    except ImportError:
        return None
    # The module-level instance is ``torch_memory_saver`` in 0.0.8+ and ``memory_saver`` before.
    saver = getattr(torch_memory_saver, "torch_memory_saver", None) or torch_memory_saver.memory_saver
    if not getattr(saver, "_impl", None):
        saver.hook_mode = "torch"  # torch's pluggable allocator: no LD_PRELOAD needed
    return saver


def memory_region(tag: str) -> contextlib.AbstractContextManager:
    """Tensors allocated inside can be paused by ``DeviceMemory`` with ``tag`` (torch_memory_saver).

    Without torch_memory_saver it is a no-op: ``DeviceMemory`` then moves the tensors it is given.
    """
    saver = _memory_saver()
    return saver.region(tag=tag, enable_cpu_backup=True) if saver is not None else contextlib.nullcontext()


@dataclasses.dataclass
class MemoryEvent:
    """One transition of a ``DeviceMemory`` group: what moved, how many bytes, how long it took."""

    event: str  # "offload" | "onload"
    tag: str
    bytes: int
    seconds: float
    how: str  # "torch_memory_saver" | "storage_swap"
    at: float = dataclasses.field(default_factory=time.time)  # wall clock, comparable across processes


class DeviceMemory:
    """Named groups of a process's tensors that leave the device between uses and come back intact.

    On CUDA with torch_memory_saver, a group is the tag its tensors were allocated under
    (``memory_region``): ``offload`` pauses it (the physical memory is freed, the content kept in host
    memory, the virtual addresses stay), ``onload`` resumes it. Otherwise the fallback swaps storages:
    each distinct storage behind the given tensors is copied to host memory (pinned on CUDA) and
    resized to zero bytes, which frees it for every view at once (Megatron's parameters and gradients
    are views of contiguous buffers); ``onload`` re-grows it and copies the bytes back. On the CPU the
    fallback really frees the storages too. Either way an offloaded tensor has no memory behind it
    (using one is a memory error, as with torch_memory_saver), so callers check ``is_offloaded``
    first. Every transition is recorded in ``events``.
    """

    def __init__(self) -> None:
        self.saver = _memory_saver()
        self.events: list[MemoryEvent] = []
        self._offloaded: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}
        self._saver_bytes: dict[str, int] = {}

    def is_offloaded(self, tag: str) -> bool:
        return tag in self._offloaded or tag in self._saver_bytes

    def offload(self, tag: str, tensors: list[torch.Tensor], claimed: set[int] | None = None) -> int:
        """Moves ``tag``'s tensors off the device; returns the bytes freed (0 if already offloaded).

        ``claimed``: storage pointers another group owns (shared storages move once, with that group).
        """
        if self.is_offloaded(tag):
            return 0
        start = time.perf_counter()
        if self.saver is not None:
            nbytes = sum(s.nbytes() for s in _unique_storages(tensors, claimed).values())
            self.saver.pause(tag)
            torch.cuda.empty_cache()
            self._saver_bytes[tag] = nbytes
            self._record("offload", tag, nbytes, start, "torch_memory_saver")
            return nbytes
        moved = []
        for storage in _unique_storages(tensors, claimed).values():
            size = storage.nbytes()
            if size == 0:
                continue
            pinned = storage.device.type == "cuda"
            host = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=pinned)
            host.copy_(_bytes_of(storage), non_blocking=True)
            moved.append((storage, host))
        if moved and moved[0][0].device.type == "cuda":
            torch.cuda.synchronize()
        for storage, _ in moved:
            storage.resize_(0)
        if has_gpu():
            torch.cuda.empty_cache()
        self._offloaded[tag] = moved
        nbytes = sum(host.numel() for _, host in moved)
        self._record("offload", tag, nbytes, start, "storage_swap")
        return nbytes

    def onload(self, tag: str) -> int:
        """Brings ``tag``'s tensors back, content intact; returns the bytes restored (0 if not offloaded)."""
        start = time.perf_counter()
        if tag in self._saver_bytes:
            assert self.saver is not None  # only the saver paused it
            self.saver.resume(tag)
            nbytes = self._saver_bytes.pop(tag)
            self._record("onload", tag, nbytes, start, "torch_memory_saver")
            return nbytes
        moved = self._offloaded.pop(tag, None)
        if moved is None:
            return 0
        for storage, host in moved:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=True)
        if moved and moved[0][0].device.type == "cuda":
            torch.cuda.synchronize()
        nbytes = sum(host.numel() for _, host in moved)
        self._record("onload", tag, nbytes, start, "storage_swap")
        return nbytes

    def _record(self, event: str, tag: str, nbytes: int, start: float, how: str) -> None:
        self.events.append(MemoryEvent(event, tag, nbytes, time.perf_counter() - start, how))


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _unique_storages(
    tensors: list[torch.Tensor], claimed: set[int] | None
) -> dict[int, torch.UntypedStorage]:
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in storages and key not in (claimed or ()):
            storages[key] = storage
    return storages


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
