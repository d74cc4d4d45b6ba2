"""Weight updates: the trainer->engine process group, the tensor payload encoding, loading by HF name.

Process group: ``slime.weight_sync.process_group`` (shared with the trainer side).

Tensor payload. Real SGLang passes `serialized_named_tensors` (one base64 string per TP rank) made by its
MultiprocessingSerializer: a ForkingPickler dump whose CUDA tensors travel as CUDA IPC handles. On CPU
there is no IPC handle to share, so `serialize_named_tensors` / `deserialize_named_tensors` define this
engine's encoding: base64 of `torch.save({"format", "names", "tensors"})` (or a flattened uint8 bucket
plus metadata), read back with `torch.load(weights_only=True)` (no arbitrary pickle). The colocated
path should call this pair and nothing else, so that switching it to shared-memory handles later
changes one place.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime.weight_sync.process_group import broadcast_from_rank0

logger = logging.getLogger(__name__)

PAYLOAD_FORMAT = "slime.torch_engine.named_tensors.v1"
BUCKET_FORMAT = "slime.torch_engine.flattened_bucket.v1"
# Checkpoint keys that are derived buffers rather than weights; safetensors files may carry them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def receive_tensors(
    group: dist.ProcessGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: torch.device,
    flattened: bool,
    timeout_s: float,
) -> list[tuple[str, torch.Tensor]]:
    """Receive the tensors of one update_weights_from_distributed call, in the order rank 0 sends them.

    One broadcast per tensor, or with `flattened` (load_format "flattened_bucket") one uint8 broadcast
    holding every tensor's bytes back to back in the given order, as SGLang's FlattenedTensorBucket.
    """
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must have the same length")
    torch_dtypes = [parse_dtype(d) for d in dtypes]
    if not flattened:
        tensors = []
        for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            broadcast_from_rank0(group, tensor, timeout_s)
            tensors.append((name, tensor))
        return tensors
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, torch_dtypes, strict=True)]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    broadcast_from_rank0(group, buffer, timeout_s)
    tensors, offset = [], 0
    for name, dtype, shape, size in zip(names, torch_dtypes, shapes, sizes, strict=True):
        tensors.append((name, buffer[offset : offset + size].view(dtype).reshape(shape)))
        offset += size
    return tensors


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' -> torch.bfloat16 (the trainer sends str(dtype) without 'torch.')."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# ---- tensor payload (update_weights_from_tensor) ------------------------------------------------


def serialize_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], flattened: bool = False
) -> str:
    """Encode `(name, tensor)` pairs as one `serialized_named_tensors` entry (a base64 string).

    `flattened` packs every tensor's bytes into one uint8 tensor plus metadata (SGLang's
    "flattened_bucket" load format: one buffer instead of many small tensors). Tensors are moved to CPU.
    """
    pairs = [(name, tensor.detach().cpu().contiguous()) for name, tensor in named_tensors]
    if flattened:
        metadata, chunks, offset = [], [], 0
        for name, tensor in pairs:
            raw = tensor.reshape(-1).view(torch.uint8)
            metadata.append(
                {
                    "name": name,
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "shape": list(tensor.shape),
                    "start": offset,
                    "end": offset + raw.numel(),
                }
            )
            chunks.append(raw)
            offset += raw.numel()
        flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        payload: dict[str, Any] = {"format": BUCKET_FORMAT, "metadata": metadata, "flattened_tensor": flat}
    else:
        payload = {"format": PAYLOAD_FORMAT, "names": [n for n, _ in pairs], "tensors": [t for _, t in pairs]}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Decode one `serialize_named_tensors` entry back into `(name, tensor)` pairs (CPU tensors)."""
    raw = base64.b64decode(data)
    payload = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") not in (PAYLOAD_FORMAT, BUCKET_FORMAT):
        raise ValueError("serialized_named_tensors entry is not in the torch engine's format")
    if payload["format"] == PAYLOAD_FORMAT:
        return list(zip(payload["names"], payload["tensors"], strict=True))
    flat = payload["flattened_tensor"]
    return [
        (m["name"], flat[m["start"] : m["end"]].view(parse_dtype(m["dtype"])).reshape(m["shape"]))
        for m in payload["metadata"]
    ]


# ---- loading into the model ---------------------------------------------------------------------


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every `*.safetensors` file in `model_path` (an HF checkpoint directory)."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_path}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                yield name, handle.get_tensor(name)


class WeightStore:
    """The model's parameters by HF name: validated loading, reading, and memory release/resume.

    Released parameters keep their Parameter objects (tied weights stay tied) but point at empty
    storage; loading a released parameter allocates it again, so weights can be pushed before or after
    `resume()`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self._released: dict[int, tuple[torch.Size, torch.dtype, torch.device]] = {}

    @property
    def released(self) -> bool:
        return bool(self._released)

    def check(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError naming the first problems (unknown names, shape mismatches) before any copy."""
        unknown = [n for n, _ in named_tensors if n not in self.params and not n.endswith(_IGNORED_SUFFIXES)]
        if unknown:
            raise ValueError(f"unknown parameter names (HF names expected): {unknown[:5]}")
        wrong = [
            f"{n}: got {list(t.shape)}, expected {list(self._shape(n))}"
            for n, t in named_tensors
            if n in self.params and tuple(t.shape) != tuple(self._shape(n))
        ]
        if wrong:
            raise ValueError(f"shape mismatch: {wrong[:5]}")

    def _shape(self, name: str) -> torch.Size:
        param = self.params[name]
        return self._released.get(id(param), (param.shape,))[0]

    @torch.no_grad()
    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the parameters (dtype and device converted); returns how many were loaded."""
        self.check(named_tensors)
        count = 0
        for name, tensor in named_tensors:
            param = self.params.get(name)
            if param is None:
                continue
            if id(param) in self._released:
                shape, dtype, device = self._released.pop(id(param))
                param.data = torch.empty(shape, dtype=dtype, device=device)
            param.data.copy_(tensor.to(param.device))
            count += 1
        return count

    def get(self, name: str, truncate_size: int) -> list[Any]:
        """SGLang's get_weights_by_name: `param.float().tolist()[:truncate_size]` (rows for a matrix)."""
        if name not in self.params:
            raise KeyError(f"no parameter named {name!r}")
        param = self.params[name]
        if id(param) in self._released:
            raise RuntimeError(f"{name} is released (release_memory_occupation); resume or update it first")
        return param.detach().float().cpu().tolist()[:truncate_size]

    def release(self) -> None:
        """Free every parameter's storage (the GPU-memory release SGLang's memory saver does)."""
        for param in {id(p): p for p in self.params.values()}.values():
            if id(param) not in self._released:
                self._released[id(param)] = (param.shape, param.dtype, param.device)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def resume(self) -> None:
        """Give released parameters storage again (zeros: the old values are gone until an update)."""
        for param in {id(p): p for p in self.params.values()}.values():
            if id(param) in self._released:
                shape, dtype, device = self._released.pop(id(param))
                param.data = torch.zeros(shape, dtype=dtype, device=device)
