"""Between a rank's local Megatron parameters and global, unsharded tensors.

Pipeline stages number their layers locally (``decoder.layers.0`` on every stage); tensor-parallel
ranks hold slices of some tensors along ``param.partition_dim``. The gated MLP's ``linear_fc1``
(dense, shared or expert) is the one tensor whose slices are not contiguous: every rank holds
``[gate_r; up_r]``.

MoE experts are numbered locally too: expert-parallel rank ``r`` of ``E`` holds the ``L = N / E``
experts ``r * L ... r * L + L - 1`` as ``local_experts.0 ... L - 1`` (SequentialMLP) or
``linear_fc1.weight0 ...`` (TEGroupedMLP); global names carry the global expert index. Experts are
sliced over the expert tensor-parallel group, which need not be the dense one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_INDEX = (
    re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\."),  # SequentialMLP
    re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight(\d+)$"),  # TEGroupedMLP
)
_GATED_FC1 = re.compile(r"linear_fc1\.weight\d*$")


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    model: Any = chunk  # each wrapper's ``module``; torch types a submodule as ``Tensor | Module``
    while hasattr(model, "module"):
        model = model.module
    return model


def _expert_index(name: str) -> re.Match | None:
    """The match of the expert number in an expert parameter's name; None for every other parameter."""
    for pattern in _EXPERT_INDEX:
        match = pattern.search(name)
        if match:
            return match
    return None


def _renumber_expert(name: str, match: re.Match, index: int) -> str:
    return name[: match.start(1)] + str(index) + name[match.end(1) :]


def _num_local_experts(chunk: torch.nn.Module) -> int:
    experts = unwrap(chunk).config.num_moe_experts or 0
    return experts // mpu.get_expert_model_parallel_world_size()


def _checkpoint_buffers(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers that HF checkpoints hold as tensors: the MoE router's ``expert_bias`` (DeepSeek-V3's
    ``e_score_correction_bias``), which routes but is not trained by the optimizer."""
    for name, buffer in chunk.named_buffers():
        if name.endswith("router.expert_bias") and buffer is not None:
            yield name, buffer


def named_global_params(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global name, local tensor)`` for one model chunk's parameters (and the buffers HF keeps as
    weights, ``_checkpoint_buffers``), layers and experts renumbered globally."""
    model = unwrap(chunk)
    global_index = [layer.layer_number - 1 for layer in model.decoder.layers] if model.decoder else []
    expert_offset = mpu.get_expert_model_parallel_rank() * _num_local_experts(chunk)
    for name, param in [*chunk.named_parameters(), *_checkpoint_buffers(chunk)]:
        name = _strip_wrappers(name)
        match = _LOCAL_LAYER.match(name)
        if match:
            name = f"decoder.layers.{global_index[int(match.group(1))]}." + name[match.end() :]
        expert = _expert_index(name)
        if expert:
            name = _renumber_expert(name, expert, expert_offset + int(expert.group(1)))
        yield name, param


def _is_gated_fc1(name: str, gated: bool) -> bool:
    return gated and _GATED_FC1.search(name) is not None


def _tp_size_rank_group(name: str) -> tuple[int, int, dist.ProcessGroup]:
    """The tensor-parallel group that slices ``name``: the expert one for experts, else the dense one."""
    if _expert_index(name):
        return (
            mpu.get_expert_tensor_parallel_world_size(),
            mpu.get_expert_tensor_parallel_rank(),
            mpu.get_expert_tensor_parallel_group(),
        )
    return (
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_tensor_model_parallel_group(),
    )


def _partition_dim(param: torch.Tensor) -> int:
    """The dimension megatron-core slices a tensor-parallel weight along (an attribute it sets on it)."""
    return param.partition_dim  # type: ignore[attr-defined]  # megatron-core's own attribute


def _is_tp_sharded(name: str, param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and _tp_size_rank_group(name)[0] > 1


def shard_for_this_rank(name: str, full: torch.Tensor, param: torch.Tensor, gated: bool) -> torch.Tensor:
    """This tensor-parallel rank's slice of the full tensor ``name``."""
    if not _is_tp_sharded(name, param):
        return full
    size, rank, _ = _tp_size_rank_group(name)
    if _is_gated_fc1(name, gated):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=_partition_dim(param))[rank]


def gather_full(name: str, param: torch.Tensor, gated: bool) -> torch.Tensor:
    """The full tensor ``name`` assembled from every tensor-parallel rank's slice (a collective)."""
    local = param.detach()
    if not _is_tp_sharded(name, param):
        return local
    size, _, group = _tp_size_rank_group(name)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if _is_gated_fc1(name, gated):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=_partition_dim(param))


def gathered_global_tensors(chunk: torch.nn.Module, gated: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full tensor of ``chunk`` by global name, the experts of every expert-parallel rank included.

    Collective over the tensor-parallel groups and, for experts, the expert-parallel group: each local
    expert ``i`` is all-gathered, so every rank yields the same tensors (experts ``e * L + i``).
    """
    num_local = _num_local_experts(chunk)
    ep_size = mpu.get_expert_model_parallel_world_size()
    for name, param in named_global_params(chunk):
        full = gather_full(name, param, gated)
        expert = _expert_index(name)
        if expert is None or ep_size == 1:
            yield name, full
            continue
        parts = [torch.empty_like(full) for _ in range(ep_size)]
        dist.all_gather(parts, full.contiguous(), group=mpu.get_expert_model_parallel_group())
        local = int(expert.group(1)) - mpu.get_expert_model_parallel_rank() * num_local
        for ep_rank, part in enumerate(parts):
            yield _renumber_expert(name, expert, ep_rank * num_local + local), part
