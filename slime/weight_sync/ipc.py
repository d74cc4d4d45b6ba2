"""Tensors handed to another process on the same machine without copying them through a socket.

This is the one encoding of ``/update_weights_from_tensor``'s ``serialized_named_tensors`` entries,
used by the colocated updater, the torch engine, the GPU check and the benchmark. It is SGLang's own
(``MultiprocessingSerializer`` in ``sglang/srt/utils/common.py``, 0.5.23): a ``ForkingPickler`` dump,
base64 encoded. With ``torch.multiprocessing``'s reductions registered, a CUDA tensor pickles as a
CUDA IPC handle and a CPU tensor as the name of a shared-memory file (``file_system`` sharing: a name
any process can open, unlike a file descriptor), so the receiver maps the sender's memory instead of
receiving its bytes.

With ``load_format="flattened_bucket"`` the payload is ``{"flattened_tensor": uint8 tensor,
"metadata": [...]}``: many tensors in one buffer, one handle. SGLang reads each metadata entry's
``name, shape, dtype, start_idx, end_idx, numel`` attributes; ``types.SimpleNamespace`` carries them,
because SGLang's restricted unpickler admits it and slime's trainer does not need SGLang installed.
Every bucket holds tensors of a single dtype, so every slice is aligned for its ``view``.

Receiving goes through ``SafeUnpickler``: only the torch rebuild functions, dtypes and containers such
a payload consists of are admitted (the same list SGLang admits), never an arbitrary global.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing  # registers the tensor and storage reductions with ForkingPickler

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass
class FlattenedBucket:
    """Tensors of one dtype packed back to back into one uint8 buffer (SGLang's FlattenedTensorBucket)."""

    flattened_tensor: torch.Tensor
    metadata: list[SimpleNamespace]

    @classmethod
    def from_named_tensors(
        cls, named_tensors: NamedTensors, out: torch.Tensor | None = None
    ) -> FlattenedBucket:
        """Packs the tensors (into ``out``, a uint8 tensor of at least their size, when given).

        Each tensor is copied straight into its slice (a non-contiguous one too), so packing reads
        and writes every byte once: no contiguous copy, no concatenation of intermediates.
        """
        if not named_tensors:
            raise ValueError("cannot flatten an empty bucket")
        dtypes = {tensor.dtype for _, tensor in named_tensors}
        if len(dtypes) != 1:
            raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
        metadata, offset = [], 0
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            metadata.append(
                SimpleNamespace(
                    name=name,
                    shape=tensor.shape,
                    dtype=tensor.dtype,
                    start_idx=offset,
                    end_idx=offset + nbytes,
                    numel=nbytes,
                )
            )
            offset += nbytes
        device = named_tensors[0][1].device
        flat = torch.empty(offset, dtype=torch.uint8, device=device) if out is None else out[:offset]
        bucket = cls(flat, metadata)
        with torch.no_grad():
            for (_, view), (_, tensor) in zip(bucket.named_tensors(), named_tensors, strict=True):
                view.copy_(tensor)
        return bucket

    @property
    def nbytes(self) -> int:
        return self.flattened_tensor.numel()

    def payload(self) -> dict[str, Any]:
        return {"flattened_tensor": self.flattened_tensor, "metadata": self.metadata}

    def named_tensors(self) -> NamedTensors:
        """Views of the buffer, one per tensor (no copy)."""
        flat = self.flattened_tensor
        return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in self.metadata]


class StagingBuffer:
    """One packing buffer reused by consecutive buckets (and updates), grown when a bucket needs more.

    ``shared`` (the colocated handoff): on the CPU it lives in shared memory from the start, so
    serializing a bucket packed into it copies nothing. Rewriting warm pages is several times faster
    than faulting in fresh ones, so host memory is kept between updates; ``release`` frees device
    memory only, because under --colocate the trainer must hand the GPU back while the engines
    generate. Reuse is safe because a bucket's receivers have read it before it is packed again.
    """

    def __init__(self, shared: bool = True) -> None:
        self.shared = shared
        self._buffer: torch.Tensor | None = None

    def pack(self, named_tensors: NamedTensors) -> FlattenedBucket:
        total = sum(t.numel() * t.element_size() for _, t in named_tensors)
        return FlattenedBucket.from_named_tensors(
            named_tensors, out=self.take(total, named_tensors[0][1].device)
        )

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The first ``nbytes`` of the buffer (its old contents), reallocated if too small or elsewhere."""
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = None  # freed before the larger one is allocated
            self._buffer = (
                _shareable_bytes(nbytes, device)
                if self.shared
                else torch.empty(nbytes, dtype=torch.uint8, device=device)
            )
        return self._buffer[:nbytes]

    def release(self) -> None:
        if self._buffer is not None and self._buffer.device.type != "cpu":
            self._buffer = None

    def free(self) -> None:
        """Drops the buffer wherever it lives. A shared one's file in /dev/shm goes with its last
        mapping; left to the process's end it would outlive a SIGKILL (Ray kills an actor and torch's
        shared-memory manager, the process that would have unlinked it, together)."""
        self._buffer = None


def _shareable_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer whose handle pickles without a copy: device memory, or a shared-memory file."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with _file_system_sharing():
        storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def split_by_dtype(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[NamedTensors]:
    """The tensors grouped by dtype, each group in its original order (first-seen dtype first)."""
    groups: dict[torch.dtype, NamedTensors] = {}
    for name, tensor in named_tensors:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    yield from groups.values()


_cuda_reductions_patched = False


def _use_sglang_cuda_reductions() -> None:
    """With SGLang installed, CUDA handles name the GPU by UUID rather than by index.

    A multi-GPU engine sees several GPUs while a trainer rank sees only its own, so the bare index in
    torch's handle could name another GPU on the receiving side; SGLang's patch (which its server
    applies too) makes both sides agree.
    """
    global _cuda_reductions_patched
    if _cuda_reductions_patched:
        return
    _cuda_reductions_patched = True
    with contextlib.suppress(ImportError):
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU storages shared as named files while pickling (restored afterwards: the setting is global)."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def serialize(obj: Any) -> str:
    """One ``serialized_named_tensors`` entry: the tensors inside ``obj`` travel as handles, not bytes.

    The sender must keep the tensors alive until the receiver has answered (it maps their memory).
    """
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in _tensors_in(obj)):
        _use_sglang_cuda_reductions()
        torch.cuda.current_stream().synchronize()  # the receiver reads on its own stream: finish writing
    buffer = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _tensors_in(obj: Any) -> Iterator[Any]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)


class SafeUnpickler(pickle.Unpickler):
    """Admits only what a tensor payload is made of (a subset of SGLang's SafeUnpickler list)."""

    ALLOWED = frozenset(
        {
            ("builtins", name)
            for name in ("bool", "bytes", "dict", "float", "int", "list", "str", "tuple", "slice")
        }
        | {("collections", "OrderedDict"), ("types", "SimpleNamespace"), ("copyreg", "__newobj__")}
        | {
            ("torch.multiprocessing.reductions", name)
            for name in (
                "rebuild_tensor",
                "rebuild_cuda_tensor",
                "rebuild_typed_storage",
                "rebuild_typed_storage_child",
                "rebuild_storage_filename",
                "rebuild_storage_empty",
                "rebuild_meta_tensor",
            )
        }
        | {("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}
        | {("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype")}
        | {
            ("torch", "UntypedStorage"),
            ("torch.storage", "UntypedStorage"),
            ("torch.storage", "TypedStorage"),
        }
        | {("torch._utils", "_rebuild_tensor_v2"), ("torch.nn.parameter", "Parameter")}
    )

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.ALLOWED or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a tensor payload")


def deserialize(data: str | bytes) -> Any:
    """The object ``serialize`` encoded; its tensors map the sender's memory (copy before it frees them)."""
    return SafeUnpickler(io.BytesIO(base64.b64decode(data))).load()


def named_tensors_from_payload(payload: Any, load_format: str | None) -> NamedTensors:
    """``(name, tensor)`` pairs of a deserialized entry: a flattened bucket or a plain list of pairs."""
    if load_format == "flattened_bucket":
        if not isinstance(payload, dict) or not {"flattened_tensor", "metadata"} <= payload.keys():
            raise ValueError("a flattened_bucket entry must hold flattened_tensor and metadata")
        return FlattenedBucket(payload["flattened_tensor"], list(payload["metadata"])).named_tensors()
    if not isinstance(payload, (list, tuple)) or not all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[1], torch.Tensor)
        for pair in payload
    ):
        raise ValueError("an entry without load_format flattened_bucket must be a list of (name, tensor)")
    return [(str(name), tensor) for name, tensor in payload]
