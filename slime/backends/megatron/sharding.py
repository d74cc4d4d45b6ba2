"""Between a rank's local Megatron parameters and global, unsharded tensors.

Pipeline stages number their layers locally (``decoder.layers.0`` on every stage); tensor-parallel
ranks hold slices of some tensors along ``param.partition_dim``. The gated MLP's ``linear_fc1``
is the one tensor whose slices are not contiguous: every rank holds ``[gate_r; up_r]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def named_global_params(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(global name, local parameter)`` for one model chunk, layers renumbered to global indices."""
    model = unwrap(chunk)
    global_index = [layer.layer_number - 1 for layer in model.decoder.layers] if model.decoder else []
    for name, param in chunk.named_parameters():
        name = _strip_wrappers(name)
        match = _LOCAL_LAYER.match(name)
        if match:
            name = f"decoder.layers.{global_index[int(match.group(1))]}." + name[match.end() :]
        yield name, param


def _is_gated_fc1(name: str, gated: bool) -> bool:
    return gated and name.endswith("mlp.linear_fc1.weight")


def _is_tp_sharded(param: torch.nn.Parameter) -> bool:
    return (
        bool(getattr(param, "tensor_model_parallel", False))
        and mpu.get_tensor_model_parallel_world_size() > 1
    )


def shard_for_this_rank(
    name: str, full: torch.Tensor, param: torch.nn.Parameter, gated: bool
) -> torch.Tensor:
    """This tensor-parallel rank's slice of the full tensor ``name``."""
    if not _is_tp_sharded(param):
        return full
    size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    if _is_gated_fc1(name, gated):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=param.partition_dim)[rank]


def gather_full(name: str, param: torch.nn.Parameter, gated: bool) -> torch.Tensor:
    """The full tensor ``name`` assembled from every tensor-parallel rank's slice (a collective)."""
    local = param.detach()
    if not _is_tp_sharded(param):
        return local
    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    if _is_gated_fc1(name, gated):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=param.partition_dim)
