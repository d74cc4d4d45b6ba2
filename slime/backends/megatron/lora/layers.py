"""Low-rank adapters on megatron-core's tensor-parallel linears, written for their parallel layouts.

A linear ``W`` gets ``W x + scaling · B (A dropout(x))``. The adapter splits as its base does:

* column-parallel (``linear_qkv``, ``linear_fc1``; ``W`` split by output rows): B is split by its rows
  like ``W``, A is replicated. The rank-r activation ``A x`` is the same on every tensor-parallel rank;
  each rank's B sees only its rows, so the gradient of ``A x`` is all-reduced in the backward
  (``copy_to_tensor_model_parallel_region``), as megatron-core does for the base's input.
* row-parallel (``linear_proj``, ``linear_fc2``; ``W`` split by input columns, input already split):
  A is split by its columns like ``W``, B is replicated. ``A x`` is a partial sum on each rank and is
  all-reduced before B (``reduce_from_tensor_model_parallel_region``), as the base's output is; the
  update is added to the reduced output, so the base's bias (added after its reduce) is added once.

The adapters live inside their base linear (``<linear>.lora_A.weight``, ``<linear>.lora_B.weight``),
so they follow their layer onto its pipeline stage and into its checkpoint shard. A is initialised
like PEFT's (Kaiming-uniform, ``a = sqrt(5)``) from a generator seeded by the run seed and the global
layer name, so every rank, every parallel layout and every pipeline split draws the same full A;
B starts at zero, so before the first step the model is exactly the base model.
"""

from __future__ import annotations

import math
import zlib
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from slime.backends.megatron.lora.targets import targeted_layers
from slime.backends.megatron.sharding import unwrap
from slime.config.settings.lora import LoraSettings


class _LoraWeight(torch.nn.Module):
    """One adapter matrix, as a module so that its parameter is named ``lora_A.weight`` as in PEFT."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


def attach_lora(chunks: list[torch.nn.Module], lora: LoraSettings, seed: int, gated: bool) -> int:
    """Freezes every parameter of ``chunks`` and adds trainable adapters to the targeted linears of
    every decoder layer; the number of adapted linears. Call before the DDP wrapping, so DDP gives the
    frozen parameters no gradient buffer and the optimizer no state."""
    count = 0
    for chunk in chunks:
        chunk.requires_grad_(False)
        model = unwrap(chunk)
        for layer in model.decoder.layers if model.decoder is not None else []:
            for path in targeted_layers(lora.target_modules):
                try:
                    base = layer.get_submodule(path)
                except AttributeError:
                    continue  # an MoE layer's MLP (validate refuses MLP targets on MoE models)
                name = f"decoder.layers.{layer.layer_number - 1}.{path}"
                _add_adapter(base, name, lora, seed, gated_fc1=gated and path == "mlp.linear_fc1")
                count += 1
    return count


def _parallel_mode(base: torch.nn.Module) -> str:
    if isinstance(base, ColumnParallelLinear):
        assert not base.gather_output, "LoRA: a column-parallel linear with a gathered output"
        return "column"
    if isinstance(base, RowParallelLinear):
        assert base.input_is_parallel, "LoRA: a row-parallel linear with an unsplit input"
        return "row"
    raise TypeError(f"LoRA adapts the local spec's Column/RowParallelLinear, not {type(base).__name__}")


def initial_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The full ``[rank, in_features]`` A of the linear ``name``, the same on every rank and layout."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(rank, in_features)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


def _add_adapter(base: Any, name: str, lora: LoraSettings, seed: int, gated_fc1: bool) -> None:
    mode = _parallel_mode(base)
    assert not base.sequence_parallel, "LoRA with sequence parallelism (validate refuses it)"
    size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    weight = base.weight
    out_features, in_features = weight.shape  # this rank's
    a = initial_a(name, lora.rank, in_features * (size if mode == "row" else 1), seed)
    if mode == "row":
        a = a.chunk(size, dim=1)[rank]
    like = {"device": weight.device, "dtype": weight.dtype}
    base.lora_A = _LoraWeight(a.to(**like))
    base.lora_B = _LoraWeight(torch.zeros(out_features, lora.rank, **like))
    base.lora_dropout = torch.nn.Dropout(lora.dropout)
    split, dim = (base.lora_B.weight, 0) if mode == "column" else (base.lora_A.weight, 1)
    tensor_parallel.set_tensor_model_parallel_attributes(split, True, dim, 1)
    for param in (base.lora_A.weight, base.lora_B.weight):
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    base.register_forward_hook(partial(_add_update, mode=mode, scaling=lora.scaling))
    _checkpoint_adapter_shards(base, mode, gated_fc1)


def _add_update(
    module: Any, args: tuple, output: tuple[torch.Tensor, torch.Tensor | None], *, mode: str, scaling: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward hook: the base's ``(output, bias)`` with the adapter's update added to the output."""
    out, bias = output
    x = args[0]
    if mode == "row" and x.is_cuda and module.training and module.lora_dropout.p > 0:
        with tensor_parallel.get_cuda_rng_tracker().fork():  # each rank's input slice its own mask
            x = module.lora_dropout(x)
    else:
        x = module.lora_dropout(x)
    low = F.linear(x, module.lora_A.weight)
    if mode == "column":
        low = tensor_parallel.copy_to_tensor_model_parallel_region(low)
    else:
        low = tensor_parallel.reduce_from_tensor_model_parallel_region(low)
    return out + scaling * F.linear(low, module.lora_B.weight), bias


def _checkpoint_adapter_shards(base: Any, mode: str, gated_fc1: bool) -> None:
    """The base linear's distributed-checkpoint entries take its own split axis for the base weight
    only (``{"weight": 0}`` / ``{"weight": 1}``) and would save the adapter's split matrix as
    replicated: give it its axis, and in a gated MLP's ``linear_fc1`` the ``[gate_r; up_r]`` rows
    of B the same gate/up factory megatron-core gives the weight."""
    original = base.sharded_state_dict
    axis = {"lora_B.weight": 0} if mode == "column" else {"lora_A.weight": 1}

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        state = original(prefix, sharded_offsets, metadata)
        own = base.state_dict(prefix="", keep_vars=True)
        adapter = {key: value for key, value in own.items() if key.startswith("lora_")}
        dp_cp_group = (metadata or {}).get("dp_cp_group") or mpu.get_data_parallel_group(
            with_context_parallel=True
        )
        state.update(
            make_sharded_tensors_for_checkpoint(
                adapter, prefix, axis, sharded_offsets, tp_group=base.tp_group, dp_cp_group=dp_cp_group
            )
        )
        if gated_fc1:
            key = f"{prefix}lora_B.weight"
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets)
        return state

    base.sharded_state_dict = sharded_state_dict
