"""LoRA on the Megatron trainer, run in processes of their own (the CPU trainer setup patches
``torch.cuda`` for the whole process, so a test never runs it in pytest's).

``python -m tests.support.lora_megatron MODE MODEL_DIR OUT_DIR RANK WORLD PORT``; results go to
``OUT_DIR/rank<RANK>.pt``.

* ``train``: a ``MegatronTrainer`` with ``--lora-rank 8`` at tensor parallelism ``WORLD``: its logits at
  step 0 and those of the model without LoRA, what DDP and the optimizer hold, one SFT step, the PEFT
  adapter it exports (``--save-hf`` too), a distributed checkpoint, a second step; then a second
  trainer started from the exported adapter (``--lora-adapter-path``), which loads the checkpoint
  and takes the same second step.
* ``pp2`` / ``dp2``: one step with two pipeline stages / two data-parallel replicas, and the
  adapter collected on rank 0.
* ``memory``: parameter, gradient-buffer and optimizer-state bytes of one step, full and LoRA, of
  each model of MODEL_DIR (directories joined by ``os.pathsep``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch

RANK = 8
PROBE = torch.Generator().manual_seed(5)
TOKENS = torch.randint(3, 99, (1, 16), generator=PROBE)
"""The prompt whose logits every check compares."""


def lora_flags(world: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "--lora-rank",
        str(RANK),
        "--lora-alpha",
        "16",
        "--tensor-model-parallel-size",
        str(world),
        *extra,
    ]


def logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """``[s, vocab]`` fp32 logits of ``tokens``, gathered over tensor-parallel ranks, cut to the HF vocab."""
    from megatron.core import tensor_parallel

    model.eval()
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        out = model(tokens, positions, None)
        out = tensor_parallel.gather_from_tensor_model_parallel_region(out)
    return out[0, :, :99].float().clone()  # tiny vocab: 99 tokens padded to 112


def training_bytes(model: list[Any], optimizer: Any) -> dict[str, int]:
    """What training holds: every parameter, the trainable ones, DDP's gradient buffers, the optimizer's
    state tensors (Adam's moments; its fp32 main parameters are views of the fp32 model's here)."""

    def size(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    params = [p for chunk in model for p in chunk.parameters()]
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    moments = ("exp_avg", "exp_avg_sq")  # Adam's per-element state (its ``step`` is a scalar per tensor)
    state = [s[k] for o in inner for s in o.optimizer.state.values() for k in moments if k in s]
    out = {
        "params": sum(size(p) for p in params),
        "trainable_params": sum(size(p) for p in params if p.requires_grad),
        "grad_buffers": sum(size(b.grad_data) for chunk in model for b in chunk.buffers),
        "optimizer_state": sum(size(t) for t in state),
    }
    out["training"] = out["trainable_params"] + out["grad_buffers"] + out["optimizer_state"]
    return out


def step_shard(trainer: Any, args: Any, seed: int = 0) -> Any:
    """The first step's shard of an 8-sample SFT rollout, as the trainer group prepares it."""
    from slime.backends.megatron.policy_inputs import DataParallel, PolicyInputs
    from tests.support.trainers import sft_data

    inputs = PolicyInputs(trainer.settings, DataParallel.of_megatron(trainer.device), args)
    return inputs.shards(sft_data(8, seed=seed))[0]


def named(trainer: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model[0].module.named_parameters()}


def run_train(model_dir: Path, out_dir: Path, rank: int, world: int, port: int) -> dict[str, Any]:
    from slime.backends.megatron.hf_checkpoint import load_hf_weights
    from slime.backends.megatron.model import build_model_chunks
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.config.settings.lora import LoraSettings
    from slime.config.settings.trainer import TrainerSettings
    from tests.support.trainers import trainer_args

    args = trainer_args(model_dir, world=world, extra=lora_flags(world))
    settings = TrainerSettings.from_args(args)
    trainer = MegatronTrainer(settings, args, rank, world, "127.0.0.1", port)
    out: dict[str, Any] = {"step0_logits": logits(trainer.model[0])}
    base = build_model_chunks(
        dataclasses.replace(settings, lora=LoraSettings()), trainer.config, trainer.device
    )
    load_hf_weights(base, model_dir, trainer.converter, gated=True)
    out["base_logits"] = logits(base[0])
    del base
    ddp = trainer.model[0]
    buffered = {id(p) for buffer in ddp.buffers for p in buffer.params}
    out["buffered"] = sorted(n for n, p in ddp.module.named_parameters() if id(p) in buffered)
    out["requires_grad"] = sorted(n for n, p in ddp.module.named_parameters() if p.requires_grad)
    out["step0_export"] = {n: t.clone() for n, t in trainer.iter_lora_weights()}
    out["before"] = named(trainer)
    shard = step_shard(trainer, args)
    out["step1_metrics"] = trainer.train_step(shard)
    out["after"] = named(trainer)
    out["memory"] = training_bytes(trainer.model, trainer.optimizer)
    out["trained_logits"] = logits(trainer.model[0])
    out["step1_export"] = {n: t.clone() for n, t in trainer.iter_lora_weights()}
    out["state_dict"] = trainer.lora_state_dict()
    out["save_hf"] = trainer.save_hf(str(out_dir / "adapter"), 1 << 20)
    trainer.save(str(out_dir / "ckpt"), 0)
    second = step_shard(trainer, args, seed=1)
    trainer.train_step(second)
    out["step2"] = named(trainer)
    trainer.close()

    # A fresh trainer from the exported adapter: the trained adapters, then the checkpoint's optimizer.
    args = trainer_args(
        model_dir, world=world, extra=lora_flags(world, ("--lora-adapter-path", str(out_dir / "adapter")))
    )
    resumed = MegatronTrainer(TrainerSettings.from_args(args), args, rank, world, "127.0.0.1", port + 1)
    out["reloaded_export"] = {n: t.clone() for n, t in resumed.iter_lora_weights()}
    out["reloaded_logits"] = logits(resumed.model[0])
    out["unequal_a"] = refusal_of_unequal_a(resumed, out_dir / "adapter", out_dir / f"unequal_a{rank}")
    out["loaded_rollout"] = resumed.load(str(out_dir / "ckpt"))
    out["loaded"] = named(resumed)
    resumed.train_step(second)
    out["resumed_step2"] = named(resumed)
    resumed.close()
    return out


LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"], "dp2": []}
"""Two-rank layouts besides tensor parallelism: two pipeline stages, two data-parallel replicas."""


def run_layout(model_dir: Path, rank: int, world: int, port: int, flags: list[str]) -> dict[str, Any]:
    """One SFT step in another parallel layout: the adapters every stage exports, collected on rank 0."""
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.config.settings.trainer import TrainerSettings
    from tests.support.trainers import trainer_args

    args = trainer_args(
        model_dir, world=world, extra=["--lora-rank", str(RANK), "--lora-alpha", "16", *flags]
    )
    trainer = MegatronTrainer(TrainerSettings.from_args(args), args, rank, world, "127.0.0.1", port)
    trainer.train_step(step_shard(trainer, args))
    module = trainer.model[0].module
    out = {
        "state_dict": trainer.lora_state_dict(),
        "requires_grad": sorted(n for n, p in module.named_parameters() if p.requires_grad),
    }
    trainer.close()
    return out


def refusal_of_unequal_a(trainer: Any, adapter: Path, tampered: Path) -> str:
    """The error of loading ``adapter`` with one k_proj's A changed (PEFT trains q, k, v's A apart)."""
    from safetensors.torch import load_file

    from slime.backends.megatron.lora.peft_io import load_peft_adapter, write_peft_adapter

    weights = load_file(adapter / "adapter_model.safetensors")
    weights["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] += 1.0
    write_peft_adapter(
        tampered, weights, trainer.settings.lora, str(trainer.settings.checkpoint.hf_checkpoint)
    )
    try:
        load_peft_adapter(trainer.model, tampered, trainer.converter, True, trainer.settings.lora)
    except ValueError as error:
        return str(error)
    return ""


def run_memory(model_dirs: list[Path], rank: int, world: int, port: int) -> dict[str, Any]:
    """One step's bytes, the full model's and the LoRA model's (megatron-core built as the trainer does),
    for each model by its directory's name."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from slime.backends.megatron.config import transformer_config
    from slime.backends.megatron.hf_checkpoint import load_hf_weights
    from slime.backends.megatron.lora.layers import attach_lora
    from slime.backends.megatron.model import build_model_chunks, build_optimizer, wrap_for_training
    from slime.backends.megatron.trainer import converter_for
    from slime.config.settings.trainer import TrainerSettings
    from tests.support.trainers import trainer_args

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mpu.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    out: dict[str, dict[str, dict[str, int]]] = {}
    for model_dir, lora in ((m, lora) for m in model_dirs for lora in (False, True)):
        args = trainer_args(model_dir, world=world, model_flags=[], extra=lora_flags(world) if lora else [])
        settings = TrainerSettings.from_args(args)
        config = transformer_config(settings)
        chunks = build_model_chunks(settings, config, torch.device("cpu"))
        load_hf_weights(chunks, model_dir, converter_for(settings), gated=True)
        if lora:
            attach_lora(chunks, settings.lora, settings.seed, gated=True)
        model = wrap_for_training(settings, config, chunks)
        optimizer, _ = build_optimizer(settings, model)
        model[0].train()
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        positions = torch.arange(TOKENS.shape[1])[None]
        torch.logsumexp(model[0](TOKENS, positions, None), dim=-1).mean().backward()
        finalize_model_grads(model)
        assert optimizer.step()[0]
        out.setdefault(model_dir.name, {})["lora" if lora else "full"] = training_bytes(model, optimizer)
        del model, optimizer, chunks
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def main(mode: str, model_dir: Path, out_dir: Path, rank: int, world: int, port: int) -> None:
    from slime.utils.device import import_megatron_core, setup_device

    import_megatron_core()
    if mode == "train":
        results = run_train(model_dir, out_dir, rank, world, port)
    elif mode in LAYOUTS:
        results = run_layout(model_dir, rank, world, port, LAYOUTS[mode])
    else:
        assert setup_device(rank).type == "cpu"
        results = run_memory([Path(d) for d in str(model_dir).split(os.pathsep)], rank, world, port)
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("SLIME_FORCE_CPU", "1")
    mode, model, out, rank, world, port = sys.argv[1:7]
    main(mode, Path(model), Path(out), int(rank), int(world), int(port))


def tiny_qwen2(directory: Path, **sizes: Any) -> Path:
    """The tiny Qwen2 (GQA, q/k/v biases, tied embeddings) with its norms and biases redrawn."""
    from tests.support.models import redraw_norms_and_biases
    from tools.make_tiny_model import make_tiny_model

    return redraw_norms_and_biases(make_tiny_model(directory, **sizes), seed=3)


def run_ranks(mode: str, model_dir: Path | str, out_dir: Path, world: int) -> list[dict[str, Any]]:
    """Runs this module on ``world`` gloo ranks; each rank's results."""
    from tests.support.gloo_ranks import run_gloo_ranks

    return run_gloo_ranks("tests.support.lora_megatron", [mode, str(model_dir)], out_dir, world)
