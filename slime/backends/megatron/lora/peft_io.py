"""The adapter as HF PEFT writes it (interface 2), out of and into the Megatron adapters.

PEFT keeps one adapter per HF module (``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``.lora_B.weight`` ``[out, r]``); Megatron's fused ``linear_qkv`` / ``linear_fc1`` keep one for the
fused rows. Out, every module of a fused layer gets the layer's A and its own rows of B, split by the
converter that splits the fused weight (so GQA's grouped q/k/v rows and ``[gate; up]`` come out in
HF order); in, the converter fuses the modules' B rows, and their A must be one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from slime.backends.megatron.conversion import ModelConverter
from slime.backends.megatron.lora.targets import peft_target_modules
from slime.backends.megatron.sharding import gather_full, named_global_params, shard_for_this_rank
from slime.config.settings.lora import LoraSettings
from slime.weight_sync.senders import is_stage_leader, walks_hf_weights

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_A, _B = ".lora_A.weight", ".lora_B.weight"


def _adapted_linears(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(global name of the base weight, local A, local B)`` of every adapted linear of ``chunk``."""
    params = dict(named_global_params(chunk))
    for name, a in params.items():
        if name.endswith(_A):
            path = name.removesuffix(_A)
            yield path + ".weight", a, params[path + _B]


@torch.no_grad()
def iter_lora_weights(
    chunks: list[torch.nn.Module], converter: ModelConverter, gated: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's adapters as full HF PEFT tensors (a collective over tensor-parallel ranks,
    every one of which yields all of them). A tensor may be a view of a live parameter: copy to keep."""
    for chunk in chunks:
        for weight_name, a, b in _adapted_linears(chunk):
            # The adapter's split matrix is split as the base weight is: gather it under that name.
            full_a, full_b = gather_full(weight_name, a, gated), gather_full(weight_name, b, gated)
            for hf_name, rows in converter.hf_from_megatron(weight_name, full_b):
                module = PEFT_PREFIX + hf_name.removesuffix(".weight")
                yield module + _A, full_a
                yield module + _B, rows


def gather_lora_weights(
    chunks: list[torch.nn.Module], converter: ModelConverter, gated: bool
) -> dict[str, torch.Tensor] | None:
    """Every pipeline stage's adapters on global rank 0 (None elsewhere), as CPU copies; a collective.
    Adapters are small (rank × width per linear), so each stage leader sends its stage's at once."""
    stage: dict[str, torch.Tensor] = {}
    if walks_hf_weights():
        stage = {n: t.to("cpu", copy=True) for n, t in iter_lora_weights(chunks, converter, gated)}
    rank = dist.get_rank()
    parts: list[dict[str, torch.Tensor] | None] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(stage if is_stage_leader() else None, parts, dst=0)
    if parts is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part or {})
    return merged


def peft_config(lora: LoraSettings, base_model: str) -> dict:
    """``adapter_config.json`` (interface 2)."""
    return {
        "peft_type": "LORA",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": peft_target_modules(lora.target_modules),
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
    }


def write_peft_adapter(
    directory: str | Path, weights: dict[str, torch.Tensor], lora: LoraSettings, base_model: str
) -> str:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (what ``PeftModel.from_pretrained``
    and SGLang's ``--lora-paths`` read) into ``directory``; its path."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    (target / CONFIG_FILE).write_text(json.dumps(peft_config(lora, base_model), indent=2) + "\n")
    contiguous = {name: tensor.contiguous() for name, tensor in sorted(weights.items())}
    save_file(contiguous, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    return str(target)


@torch.no_grad()
def load_peft_adapter(
    chunks: list[torch.nn.Module],
    directory: str | Path,
    converter: ModelConverter,
    gated: bool,
    lora: LoraSettings,
) -> None:
    """Copies a PEFT adapter (``--lora-adapter-path``) into this rank's shards of the Megatron adapters.
    Every adapter tensor must find its place and every adapted linear its tensors: a mismatch in
    rank, alpha or modules is an error (the trainer does not start)."""
    root = Path(directory)
    config = json.loads((root / CONFIG_FILE).read_text())
    if (config.get("r"), float(config.get("lora_alpha", 0))) != (lora.rank, lora.alpha):
        raise ValueError(
            f"--lora-adapter-path {root}: r={config.get('r')} lora_alpha={config.get('lora_alpha')}, "
            f"but --lora-rank {lora.rank} --lora-alpha {lora.alpha}; set them to the adapter's"
        )
    weights = load_file(str(root / WEIGHTS_FILE))
    used: set[str] = set()
    for chunk in chunks:
        for weight_name, a, b in _adapted_linears(chunk):
            full_b, modules = _fused_b(converter, weight_name, weights, root)
            full_as = [_tensor(weights, module + _A, root) for module in modules]
            if any(not torch.equal(other, full_as[0]) for other in full_as[1:]):
                names = ", ".join(m.removeprefix(PEFT_PREFIX) for m in modules)
                raise ValueError(
                    f"--lora-adapter-path {root}: {names} have different lora_A; Megatron's fused layer "
                    "shares one A (an adapter trained by slime, or with tied A, loads)"
                )
            a.copy_(shard_for_this_rank(weight_name, full_as[0], a, gated))
            b.copy_(shard_for_this_rank(weight_name, full_b, b, gated))
            used.update(m + suffix for m in modules for suffix in (_A, _B))
    # Each rank sees its own stage's layers; the adapter's other tensors are for other stages.
    unused = _unused_on_every_rank(set(weights) - used)
    if unused:
        raise ValueError(
            f"--lora-adapter-path {root}: {len(unused)} tensors fit no adapted layer (e.g. {unused[0]}); "
            "set --target-modules to the adapter's target_modules"
        )


def _fused_b(
    converter: ModelConverter, weight_name: str, weights: dict[str, torch.Tensor], root: Path
) -> tuple[torch.Tensor, list[str]]:
    """The fused B of the Megatron linear ``weight_name`` from its HF modules' B rows (the converter
    fuses them as it fuses the weights), and those modules' PEFT names."""
    modules: list[str] = []

    def rows_of(hf_name: str) -> torch.Tensor:
        module = PEFT_PREFIX + hf_name.removesuffix(".weight")
        modules.append(module)
        return _tensor(weights, module + _B, root)

    return converter.megatron_from_hf(weight_name, rows_of), modules


def _tensor(weights: dict[str, torch.Tensor], name: str, root: Path) -> torch.Tensor:
    try:
        return weights[name]
    except KeyError:
        raise ValueError(
            f"--lora-adapter-path {root}: no {name}; set --target-modules to the adapter's target_modules"
        ) from None


def _unused_on_every_rank(unused: set[str]) -> list[str]:
    """The adapter tensors no rank used (each pipeline stage uses its own layers')."""
    everyone: list[set[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, unused)
    common = set.intersection(*(s or set() for s in everyone))
    return sorted(common)
