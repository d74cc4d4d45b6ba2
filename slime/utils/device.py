"""The one seam between the GPU and the CPU path.

Production trains on CUDA. On a machine without a GPU the same megatron-core code runs on the CPU
with gloo, once the CUDA assumptions megatron-core hard-codes are redirected:

- tensors created with ``device="cuda"`` / ``torch.cuda.current_device()`` / ``.cuda()``,
- ``param.type() == "torch.cuda.FloatTensor"`` checks in the optimizer and grad clipping,
- the model-parallel RNG tracker reading and writing the CUDA generator state,
- ``torch.cuda.synchronize()`` / streams / events in the schedules and DDP buffers.

A ``TorchFunctionMode`` maps every CUDA device argument to the CPU, and a handful of ``torch.cuda``
functions are pointed at their CPU equivalents. Nothing else in the code base knows which path it
is on: callers ask :func:`setup_device` for the device and never branch on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
}

_cpu_mode: _CudaToCpuMode | None = None


def _as_cpu(device: Any) -> Any:
    """Maps a CUDA device (string, ``torch.device`` or bare ordinal) to the CPU; leaves others alone."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs:
            kwargs["device"] = _as_cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        if func in (torch.Tensor.to,) and len(args) > 1:
            args = (args[0], _as_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: on the CPU the recorded work is already done."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: on the CPU every op is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _NullEvent()  # MoE all-to-all waits on it


def _patch_torch_cuda() -> None:
    """Points the ``torch.cuda`` calls megatron-core makes at CPU equivalents."""
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.Stream = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_on_host


def _split_sizes_on_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """The MoE all-to-all dispatcher's device-to-host copy of its split sizes, for tensors already here.

    megatron-core only converts CUDA tensors to numpy; a CPU tensor would reach ``all_to_all_single``
    as a tensor, which it rejects as split sizes.
    """
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().numpy().copy()
    return tensor


def _quiet_cpu_noise() -> None:
    """Silences warnings that are only true on the CPU path and say nothing a user can act on."""
    warnings.filterwarnings(
        "ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed"
    )
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    # The RNG tracker checks that the CPU generator is untouched while it swaps in the "CUDA" state;
    # here both are the same generator, so the check always fires.
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )


def has_gpu() -> bool:
    """True when CUDA is usable in this process; ``SLIME_FORCE_CPU=1`` forces the CPU path."""
    return os.environ.get("SLIME_FORCE_CPU", "0") != "1" and torch.cuda.is_available()


@functools.cache
def setup_device(local_rank: int = 0) -> torch.device:
    """Returns the device this process computes on, redirecting megatron-core once when it is the CPU."""
    global _cpu_mode
    if has_gpu():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    _quiet_cpu_noise()
    _patch_torch_cuda()
    _cpu_mode = _CudaToCpuMode()
    _cpu_mode.__enter__()
    return torch.device("cpu")


def distributed_backend() -> str:
    """The torch.distributed backend for the trainer's own groups: NCCL on GPUs, gloo otherwise."""
    return "nccl" if has_gpu() else "gloo"


def kernel_overrides() -> dict[str, bool]:
    """TransformerConfig fields that need CUDA: fused kernels (apex / TE / jit), stream-ordered frees."""
    if has_gpu():
        return {}
    return {
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "moe_permute_fusion": False,
        # Megatron frees a sent activation's storage right after posting the send: safe behind NCCL's
        # stream order, but gloo's isend still reads it from a background thread, so the pipeline
        # waits for every send here. (Not freeing instead would route backward through
        # torch.autograd.backward, under which this module's CUDA->CPU mode is off.)
        "overlap_p2p_comm": False,
    }


def worker_env(processes_per_node: int) -> dict[str, str]:
    """Environment for worker processes: on the CPU, split the cores so workers do not oversubscribe.

    ``SLIME_WORKER_THREADS`` overrides the split (a benchmark gives each worker exactly one core).
    """
    if has_gpu():
        return {}
    split = max(1, (os.cpu_count() or 1) // max(processes_per_node, 1))
    threads = int(os.environ.get("SLIME_WORKER_THREADS") or split)
    return {"OMP_NUM_THREADS": str(threads), "SLIME_FORCE_CPU": os.environ.get("SLIME_FORCE_CPU", "0")}


# ---- releasing a process's device memory between uses (colocated training and rollout) ----------


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
