"""Weight updates: the trainer->engine process group, the tensor payload encoding, loading by HF name.

Process group: ``slime.weight_sync.process_group`` (shared with the trainer side).

Tensor payload. `serialized_named_tensors` (one base64 string per TP rank) is SGLang's
MultiprocessingSerializer encoding, implemented once in `slime.weight_sync.ipc`: CUDA tensors travel as
CUDA IPC handles, CPU tensors as shared-memory file names, so the engine maps the trainer's buffer and
copies it into its parameters; only a restricted unpickler reads it.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slime.weight_sync import ipc
from slime.weight_sync.process_group import WeightGroup, broadcast_from_rank0

logger = logging.getLogger(__name__)

# Checkpoint keys that are derived buffers rather than weights; safetensors files may carry them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def receive_tensors(
    group: WeightGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: torch.device,
    flattened: bool,
    timeout_s: float,
    staging: ipc.StagingBuffer | None = None,
    stop: Callable[[], BaseException | None] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Receive the tensors of one update_weights_from_distributed call, in the order rank 0 sends them.

    One broadcast per tensor, or with `flattened` (load_format "flattened_bucket") one uint8 broadcast
    holding every tensor's bytes back to back in the given order, as SGLang's FlattenedTensorBucket.
    A flattened bucket lands in `staging` when given (warm pages, reused by the next call: the
    tensors must be loaded before it), else in a fresh buffer. `stop` ends a wait early (see
    `slime.weight_sync.process_group.wait_for_work`).
    """
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must have the same length")
    torch_dtypes = [parse_dtype(d) for d in dtypes]
    if not flattened:
        tensors = []
        for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            broadcast_from_rank0(group, tensor, timeout_s, stop)
            tensors.append((name, tensor))
        return tensors
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, torch_dtypes, strict=True)]
    total = sum(sizes)
    buffer = (
        staging.take(total, device)
        if staging is not None
        else torch.empty(total, dtype=torch.uint8, device=device)
    )
    broadcast_from_rank0(group, buffer, timeout_s, stop)
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
    """Encode `(name, tensor)` pairs as one `serialized_named_tensors` entry (`slime.weight_sync.ipc`).

    `flattened` packs them into one buffer per call (load_format "flattened_bucket"; one dtype).
    """
    pairs = [(name, tensor.detach().contiguous()) for name, tensor in named_tensors]
    if flattened:
        return ipc.serialize(ipc.FlattenedBucket.from_named_tensors(pairs).payload())
    return ipc.serialize(pairs)


def deserialize_named_tensors(
    data: str | bytes, load_format: str | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Decode one entry into `(name, tensor)` pairs that map the sender's memory (copy them at once)."""
    try:
        payload = ipc.deserialize(data)
    except (pickle.UnpicklingError, ValueError, EOFError) as exc:
        raise ValueError(f"serialized_named_tensors entry could not be decoded: {exc}") from exc
    return ipc.named_tensors_from_payload(payload, load_format)


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


@dataclass(frozen=True)
class ExpertSlice:
    """One expert's HF weight (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) inside a fused tensor.

    transformers 5 holds a MoE layer's experts as two 3-D parameters, ``gate_up_proj`` [E, 2I, H]
    (gate rows first, then up: the forward chunks the projection in two) and ``down_proj`` [E, H, I],
    or with ``is_transposed`` [E, H, 2I] and [E, I, H]. Trainers and SGLang name the experts one by
    one, so each such name is a view of its parameter: expert ``e``, in HF's [out, in] orientation,
    and for gate/up one half of the rows.
    """

    param: torch.nn.Parameter
    expert: int
    transposed: bool
    half: int | None  # 0: gate rows, 1: up rows of gate_up_proj; None: all of down_proj

    def view(self, full: torch.Tensor) -> torch.Tensor:
        weight = full[self.expert]
        if self.transposed:
            weight = weight.transpose(0, 1)
        if self.half is not None:
            rows = weight.shape[0] // 2
            weight = weight[self.half * rows : (self.half + 1) * rows]
        return weight


def expert_slices(model: torch.nn.Module) -> dict[str, ExpertSlice]:
    """Per-expert HF names of every fused expert module (``gate_up_proj`` and ``down_proj``, 3-D)."""
    slices: dict[str, ExpertSlice] = {}
    for prefix, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
            continue
        if gate_up.dim() != 3 or down.dim() != 3:
            continue
        transposed = bool(getattr(module, "is_transposed", False))
        for e in range(gate_up.shape[0]):
            slices[f"{prefix}.{e}.gate_proj.weight"] = ExpertSlice(gate_up, e, transposed, 0)
            slices[f"{prefix}.{e}.up_proj.weight"] = ExpertSlice(gate_up, e, transposed, 1)
            slices[f"{prefix}.{e}.down_proj.weight"] = ExpertSlice(down, e, transposed, None)
    return slices


def checkpoint_renames(model: torch.nn.Module) -> list[tuple[re.Pattern[str], str]]:
    """transformers' own checkpoint-name -> module-name renamings for ``model``, when it has some.

    A VLM's checkpoint (and so the trainer, and SGLang's ``load_weights``) names its tensors
    ``visual.*`` and ``model.layers.*``, while transformers 5 holds them as ``model.visual.*`` and
    ``model.language_model.*``; ``from_pretrained`` renames with these ``WeightRenaming`` patterns
    (``transformers/conversion_mapping.py``, by class name then model type), and so does the engine.
    """
    from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping

    mapping = get_checkpoint_conversion_mapping(type(model).__name__)
    if mapping is None:
        mapping = get_checkpoint_conversion_mapping(getattr(model.config, "model_type", None)) or []
    renames = []
    for transform in mapping:
        if isinstance(transform, WeightRenaming):
            for source, target in zip(transform.source_patterns, transform.target_patterns, strict=False):
                renames.append((re.compile(source), target))
    return renames


class WeightStore:
    """The model's parameters by HF name: validated loading, reading, and memory release/resume.

    A name is a parameter's own, one expert's slice of a fused expert parameter (``ExpertSlice``), or a
    checkpoint name that ``renames`` (``checkpoint_renames``) turns into a parameter's.
    Released parameters keep their Parameter objects (tied weights stay tied) but point at empty
    storage; loading a released parameter allocates it again, so weights can be pushed before or after
    `resume()`.
    """

    def __init__(
        self, model: torch.nn.Module, renames: list[tuple[re.Pattern[str], str]] | None = None
    ) -> None:
        self.model = model
        self.renames = renames or []
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        # Persistent buffers are checkpoint tensors too: DeepSeek-V3's e_score_correction_bias is one
        # in transformers (a parameter in SGLang's model); weight pushes and reads name it like the rest.
        for name, tensor in model.state_dict(keep_vars=True).items():
            self.params.setdefault(name, tensor)
        self.slices = expert_slices(model)
        self._released: dict[int, tuple[torch.Size, torch.dtype, torch.device]] = {}

    @property
    def released(self) -> bool:
        return bool(self._released)

    def _known(self, name: str) -> bool:
        return name in self.params or name in self.slices

    def module_name(self, name: str) -> str:
        """``name`` as the model holds it: itself when known, else its first checkpoint renaming."""
        if self._known(name):
            return name
        for pattern, target in self.renames:
            if pattern.search(name):
                return pattern.sub(target, name, count=1)
        return name

    def check(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError naming the first problems (unknown names, shape mismatches) before any copy."""
        unknown = [
            n
            for n, _ in named_tensors
            if not self._known(self.module_name(n)) and not n.endswith(_IGNORED_SUFFIXES)
        ]
        if unknown:
            raise ValueError(f"unknown parameter names (HF names expected): {unknown[:5]}")
        wrong = [
            f"{n}: got {list(t.shape)}, expected {list(self._shape(self.module_name(n)))}"
            for n, t in named_tensors
            if self._known(self.module_name(n)) and tuple(t.shape) != tuple(self._shape(self.module_name(n)))
        ]
        if wrong:
            raise ValueError(f"shape mismatch: {wrong[:5]}")

    def _full_shape(self, param: torch.Tensor) -> torch.Size:
        return self._released.get(id(param), (param.shape,))[0]

    def _shape(self, name: str) -> torch.Size:
        if name in self.params:
            return self._full_shape(self.params[name])
        piece = self.slices[name]
        return piece.view(torch.empty(self._full_shape(piece.param), device="meta")).shape

    def _allocated(self, param: torch.Tensor) -> torch.Tensor:
        """``param``, given storage again if it was released (its other values are undefined)."""
        if id(param) in self._released:
            shape, dtype, device = self._released.pop(id(param))
            param.data = torch.empty(shape, dtype=dtype, device=device)
        return param

    @torch.no_grad()
    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the parameters (dtype and device converted); returns how many were loaded."""
        self.check(named_tensors)
        named_tensors = [(self.module_name(n), t) for n, t in named_tensors]
        count = 0
        for name, tensor in named_tensors:
            if name in self.params:
                target = self._allocated(self.params[name]).data
            elif name in self.slices:
                piece = self.slices[name]
                target = piece.view(self._allocated(piece.param).data)
            else:
                continue
            target.copy_(tensor.to(target.device))
            count += 1
        return count

    def get(self, name: str, truncate_size: int) -> list[Any]:
        """SGLang's get_weights_by_name: `param.float().tolist()[:truncate_size]` (rows for a matrix)."""
        name = self.module_name(name)
        if not self._known(name):
            raise KeyError(f"no parameter named {name!r}")
        piece = self.slices.get(name)
        param = self.params[name] if piece is None else piece.param
        if id(param) in self._released:
            raise RuntimeError(f"{name} is released (release_memory_occupation); resume or update it first")
        value = param.detach() if piece is None else piece.view(param.detach())
        return value.float().cpu().tolist()[:truncate_size]

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
