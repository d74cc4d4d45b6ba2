"""LoRA against full fine-tuning: what a weight push moves and how long it takes, and what training holds.

- push: the trainer's updaters into a real torch engine started as a LoRA run starts it
  (``--enable-lora --max-lora-rank R --lora-target-modules all``). Full: ``TensorWeightUpdater``, the
  colocated handoff of every HF tensor. LoRA: ``LoraWeightUpdater`` with the same transport (unload,
  then the whole adapter from tensors, sha256-checked by the engine) and without it (an HF PEFT
  directory the engine loads). Each is fed by a stand-in trainer holding the model's HF tensors or a
  rank-R all-linear adapter of the same model (fresh values each round, read back from the engine).
  Rounds alternate; the best of ``--repeats`` counts (shared machines).
- memory: one trainer rank's training bytes (trainable parameters, DDP gradient buffers, Adam's two
  moments) after one optimizer step, megatron-core built as the trainer builds it, full vs LoRA
  (``tests/support/lora_megatron.py``, the worker the LoRA unit tests use).

    python bench/lora.py                  # the tiny model and a wider one (8 layers, hidden 1024)

Writes bench/results/lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slime.backends.engine_server import start_engine_server  # noqa: E402
from slime.backends.torch_engine.launcher import serving  # noqa: E402
from slime.backends.torch_engine.weights import iter_safetensors  # noqa: E402
from slime.config.settings.lora import ALL_LINEAR, LoraSettings  # noqa: E402
from slime.config.settings.weight_sync import WeightSyncSettings  # noqa: E402
from slime.engine_client.weight_updates import weight_update_session  # noqa: E402
from slime.utils.http import free_port, post_json_sync  # noqa: E402
from slime.weight_sync.lora import LoraWeightUpdater  # noqa: E402
from slime.weight_sync.tensor import TensorWeightUpdater  # noqa: E402

RESULTS = REPO / "bench" / "results" / "lora.json"
MODELS = {"tiny": {}, "wide": {"num_layers": 8, "hidden_size": 1024, "intermediate_size": 2816}}


class StandIn:
    """What the updaters read from a trainer rank: full HF tensors (``iter_hf_weights``) or the adapter
    (``lora_state_dict``), refilled with fresh values each round."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def refill(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for tensor in self.tensors.values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)

    def iter_hf_weights(self):
        return iter(self.tensors.items())

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors


def adapter_of(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """A rank-``rank`` adapter on every attention and MLP projection of the HF ``state``, PEFT-named."""
    adapter = {}
    for name, weight in state.items():
        module = name.removesuffix(".weight")
        if weight.dim() == 2 and module.rsplit(".", 1)[-1] in ALL_LINEAR:
            out_features, in_features = weight.shape
            adapter[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(rank, in_features)
            adapter[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(out_features, rank)
    return adapter


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def bench_push(model: Path, rank: int, repeats: int, work: Path) -> dict:
    state = {name: tensor.clone().float() for name, tensor in iter_safetensors(str(model))}
    full, lora = StandIn(state), StandIn(adapter_of(state, rank))
    flags = ("--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", "all")
    engine = start_engine_server("torch engine", serving(model, *flags), work / "engine.log", timeout_s=300)
    lora_settings = LoraSettings(rank=rank, alpha=2.0 * rank)
    tensor_sync = WeightSyncSettings("tensor", bucket_bytes=64 * 2**20, timeout_s=300.0, lora=lora_settings)
    disk_sync = WeightSyncSettings(
        "distributed",
        bucket_bytes=64 * 2**20,
        timeout_s=300.0,
        disk_dir=str(work / "adapters"),
        lora=lora_settings,
    )
    updaters = {
        "full_tensor": TensorWeightUpdater(tensor_sync, full),
        "lora_tensor": LoraWeightUpdater(tensor_sync, lora_settings, str(model), lora),
        "lora_directory": LoraWeightUpdater(disk_sync, lora_settings, str(model), lora),
    }
    for updater in updaters.values():
        updater.connect([engine.url])
    best = dict.fromkeys(updaters, float("inf"))
    try:
        for round_ in range(repeats):
            for index, (key, updater) in enumerate(updaters.items()):
                (full if key == "full_tensor" else lora).refill(3 * round_ + index)
                start = time.perf_counter()
                with weight_update_session([engine.url] if key == "full_tensor" else [], 300):
                    updater.update(f"{key}{round_}")
                best[key] = min(best[key], time.perf_counter() - start)
                if key != "full_tensor":  # the engine serves exactly the adapter that was pushed
                    name, tensor = next(iter(lora.tensors.items()))
                    body = {
                        "lora_name": lora_settings.adapter_name,
                        "name": name,
                        "truncate_size": tensor.numel(),
                    }
                    served = torch.tensor(post_json_sync(f"{engine.url}/get_lora_weights_by_name", body))
                    assert torch.equal(served.flatten(), tensor.flatten()), key
    finally:
        for updater in updaters.values():
            updater.disconnect()
        engine.stop()
    return {
        "lora_rank": rank,
        "full_bytes": nbytes(state),
        "lora_bytes": nbytes(lora.tensors),
        "bytes_ratio": nbytes(lora.tensors) / nbytes(state),
        "seconds_best": best,
        "time_ratio_tensor": best["lora_tensor"] / best["full_tensor"],
    }


def bench_memory(models: dict[str, Path], work: Path) -> dict:
    from tests.support.lora_megatron import run_ranks

    joined = os.pathsep.join(str(path) for path in models.values())
    (result,) = run_ranks("memory", joined, work / "memory", world=1)
    return {
        name: {
            **result[path.name],
            "training_ratio": result[path.name]["lora"]["training"] / result[path.name]["full"]["training"],
        }
        for name, path in models.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--repeats", type=int, default=3)
    cli = parser.parse_args()
    from tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="slime_bench_lora_"))
    models = {name: make_tiny_model(work / name, **sizes) for name, sizes in MODELS.items()}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    push = {
        name: bench_push(path, cli.rank, cli.repeats, work / f"{name}_push") for name, path in models.items()
    }
    dist.destroy_process_group()
    memory = bench_memory(models, work)
    shutil.rmtree(work)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d"),
        "models": {
            name: {"sizes": MODELS[name], "push": push[name], "memory": memory[name]} for name in models
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name in models:
        p, m = push[name], memory[name]
        seconds = p["seconds_best"]
        print(
            f"{name}: push bytes LoRA/full {p['bytes_ratio']:.4f} ({p['lora_bytes']} / {p['full_bytes']}), "
            f"seconds full {seconds['full_tensor']:.3f} vs LoRA {seconds['lora_tensor']:.3f} "
            f"(directory {seconds['lora_directory']:.3f}); training bytes LoRA/full {m['training_ratio']:.4f}"
        )


if __name__ == "__main__":
    main()
