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
import functools
import importlib.util
import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from slime.utils.hardware import has_gpu

logger = logging.getLogger(__name__)

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
        # Every torch call of the trainer passes through here: the common case (no device argument,
        # none of the three rewritten methods) returns at once, as it costs per op on small models.
        if func in _REWRITTEN or (kwargs and ("device" in kwargs or "pin_memory" in kwargs)):
            return _rewrite(func, args, kwargs or {})
        return func(*args, **kwargs) if kwargs else func(*args)


_REWRITTEN = frozenset((torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to))


def _rewrite(func: Any, args: tuple, kwargs: dict) -> Any:
    """``.cuda()`` is a no-op, ``.type()`` names the CUDA type, ``.to(cuda)`` and ``device=cuda`` stay
    on the CPU, ``pin_memory`` is dropped."""
    if func is torch.Tensor.cuda:
        return args[0]
    if func is torch.Tensor.type and len(args) == 1 and not kwargs:
        name = func(*args)
        return _CUDA_TYPE_NAMES.get(name, name)
    kwargs = dict(kwargs)
    if "device" in kwargs:
        kwargs["device"] = _as_cpu(kwargs["device"])
    kwargs.pop("pin_memory", None)
    if func is torch.Tensor.to and len(args) > 1:
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
    cuda: Any = torch.cuda  # CPU stand-ins replace its functions and classes, whatever their signatures
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

    # YaRN's RoPE (multi-latent attention) builds its tables under ``torch.device(current_device())``
    # unless told to use the CPU, and multi-latent attention never tells it; no argument rewrite
    # reaches a device context.
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    build_yarn = yarn.YarnRotaryEmbedding.__init__
    yarn.YarnRotaryEmbedding.__init__ = functools.partialmethod(build_yarn, use_cpu_initialization=True)


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


def import_megatron_core() -> None:
    """Imports megatron-core; on the CPU with its ``jit_fuser`` left as the plain function.

    megatron-core binds ``megatron.core.jit.jit_fuser`` to ``torch.compile`` at import and decorates a
    few element-wise helpers with it (the MoE router's expert-bias update, gelu variants, L2 norm).
    On the CPU that costs twice: importing dynamo and inductor was 2.1 s of megatron-core's 5 s import
    in every trainer process, and inductor builds C++ at a helper's first call (28 s of gcc in one
    DeepSeek-V3 run; 2026-12-02, 2 cores), for kernels over a few hundred elements. So a trainer rank
    imports megatron-core here before anything else does (``TrainerActor.init``), with ``torch.compile``
    returning what it is given; a process that imported it some other way (a test, a benchmark) gets
    dynamo disabled by ``setup_device`` instead. The helpers run eagerly: the same maths.
    """
    compile_ = torch.compile
    if not has_gpu():  # where megatron-core is imported already, this import changes nothing
        _quiet_cpu_noise()  # its import warns of every missing GPU extension
        torch.compile = _as_is
    try:
        import megatron.core.jit  # noqa: F401
    finally:
        torch.compile = compile_


def _as_is(model: Any = None, **_options: Any) -> Any:
    """``torch.compile``'s signature, compiling nothing: ``@_as_is`` and ``@_as_is(...)`` keep a function."""
    return model if model is not None else _as_is


def _no_compile_on_cpu() -> None:
    """See ``import_megatron_core``: for a process whose megatron-core was imported with torch.compile
    (which imported dynamo; without it, nothing here was compiled)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.config.disable = True


@functools.cache
def setup_device(local_rank: int = 0) -> torch.device:
    """Returns the device this process computes on, redirecting megatron-core once when it is the CPU."""
    global _cpu_mode
    if has_gpu():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    _quiet_cpu_noise()
    _patch_torch_cuda()
    _no_compile_on_cpu()
    _cpu_mode = _CudaToCpuMode()
    _cpu_mode.__enter__()
    return torch.device("cpu")


def distributed_backend() -> str:
    """The torch.distributed backend for the trainer's own groups: NCCL on GPUs, gloo otherwise."""
    return "nccl" if has_gpu() else "gloo"


# Fusions megatron-core takes from an extension it does not ship: the field, then every module of
# which one must import (Transformer Engine, or apex's CUDA extensions).
_FUSION_KERNELS: dict[str, tuple[str, ...]] = {
    "apply_rope_fusion": ("transformer_engine",),
    "moe_permute_fusion": ("transformer_engine",),
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda",),
    "masked_softmax_fusion": ("transformer_engine", "scaled_masked_softmax_cuda"),
    "persist_layer_norm": ("transformer_engine", "apex"),
}


def missing_fusion_kernels(available: Callable[[str], bool]) -> list[str]:
    """The fusion fields whose kernels none of their modules provides on this node.

    megatron-core fails on them only deep inside model building or the first step ("apply_rope_fusion
    is not available", "fused_weight_gradient_mlp_cuda module is not found"), while each has an
    unfused path that computes the same thing; a GPU node without TE or apex takes that path.
    """
    return [field for field, modules in _FUSION_KERNELS.items() if not any(map(available, modules))]


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def kernel_overrides() -> dict[str, bool]:
    """TransformerConfig fields that need CUDA: fused kernels (apex / TE / jit), stream-ordered frees.

    On a GPU only the fusions whose extension is not installed are turned off (with one warning)."""
    if has_gpu():
        missing = missing_fusion_kernels(_importable)
        if missing:
            logger.warning(
                "Transformer Engine / apex kernels not installed: %s off (unfused paths; install "
                "transformer_engine for speed)",
                ", ".join(missing),
            )
        return dict.fromkeys(missing, False)
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
