"""Training-step throughput with packed (THD) micro-batches vs padded ones, on a batch of varied lengths.

One Megatron trainer rank (in this process, on whatever device ``slime.utils.device`` picks), one
batch of samples whose lengths vary the way RL responses do, the same micro-batches (``--micro-batch-size``
consecutive samples) in both layouts: ``--qkv-format bshd`` pads every sample to the longest of its
micro-batch, ``thd`` lays them end to end. A third run packs by token budget
(``--use-dynamic-batch-size``, budget = micro-batch size x mean length). Useful tokens per second
(the batch's real tokens over the step's wall time) are measured side by side: runs alternate and the
median of ``--repeats`` counts, because the machines this runs on are shared.

On GPUs Transformer Engine attends within each packed sequence; on the CPU the local attention computes
the packed row under a block-diagonal mask, i.e. a (sum of lengths)^2 score matrix, so there packing
saves the padding of the linear layers but pays more in attention for long rows.

    python bench/packing_vs_padding.py
    python bench/packing_vs_padding.py --hidden-size 512 --num-samples 64 --micro-batch-size 16

Writes bench/results/packing_vs_padding.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slime.backends.megatron.policy_inputs import step_shard  # noqa: E402
from slime.config import parse_args  # noqa: E402
from slime.config.settings.trainer import TrainerSettings  # noqa: E402
from slime.utils.http import free_port  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402


def varied_batch(num_samples: int, max_len: int, seed: int) -> dict[str, list]:
    """Prompts of 32-96 tokens and long-tailed responses (most short, a few near ``max_len``)."""
    rng = random.Random(seed)
    data: dict[str, list] = {"tokens": [], "response_lengths": [], "loss_masks": []}
    for _ in range(num_samples):
        prompt = rng.randint(32, 96)
        response = min(max_len - prompt, int(rng.expovariate(1 / 120)) + 8)
        data["tokens"].append([rng.randint(3, 98) for _ in range(prompt + response)])
        data["response_lengths"].append(response)
        data["loss_masks"].append([1] * response)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machines are shared)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "packing_vs_padding.json"))
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)

    from slime.backends.megatron.trainer import MegatronTrainer

    workdir = Path(tempfile.mkdtemp(prefix="packing_bench_"))
    model = make_tiny_model(
        workdir / "model",
        hidden_size=opts.hidden_size,
        num_layers=opts.num_layers,
        intermediate_size=4 * opts.hidden_size,
        max_position_embeddings=opts.max_len,
    )
    data = varied_batch(opts.num_samples, opts.max_len, opts.seed)
    lengths = [len(t) for t in data["tokens"]]
    budget = opts.micro_batch_size * round(statistics.mean(lengths))
    args = parse_args(
        [
            "--hf-checkpoint", str(model),
            "--debug-train-only",
            "--loss-type", "sft_loss",
            "--rollout-batch-size", str(opts.num_samples),
            "--micro-batch-size", str(opts.micro_batch_size),
            "--lr", "1e-6",
            "--num-rollout", "1",
            "--seed", str(opts.seed),
        ]
    )  # fmt: skip
    settings = TrainerSettings.from_args(args)
    trainer = MegatronTrainer(settings, args, 0, 1, "127.0.0.1", free_port())
    shard = step_shard(data, 0, 1, 0, 1)
    modes = {
        "padded": {"qkv_format": "bshd", "use_dynamic_batch_size": False, "max_tokens_per_gpu": None},
        "packed": {"qkv_format": "thd", "use_dynamic_batch_size": False, "max_tokens_per_gpu": None},
        "packed_dynamic": {"qkv_format": "thd", "use_dynamic_batch_size": True, "max_tokens_per_gpu": budget},
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    shapes: dict[str, list[list[int]]] = {}
    for repeat in range(opts.repeats + 1):  # the first round warms up and is not counted
        for name, batching in modes.items():
            trainer.settings = dataclasses.replace(
                settings, batch=dataclasses.replace(settings.batch, **batching)
            )
            start = time.perf_counter()
            trainer.train_step(shard)
            if repeat:
                times[name].append(time.perf_counter() - start)
            shapes[name] = [list(b.tokens.shape) for b in trainer._micro_batches(shard)]
    trainer.close()

    real = sum(lengths)
    results = {}
    for name, runs in times.items():
        step = statistics.median(runs)
        computed = sum(rows * cols for rows, cols in shapes[name])
        results[name] = {
            "step_time_s": step,
            "tokens_per_s": real / step,
            "micro_batches": len(shapes[name]),
            "tokens_computed": computed,
            "padding_fraction": 1 - real / computed,
            "step_times_s": runs,
        }

    def ratio(name: str) -> float:
        return results[name]["tokens_per_s"] / results["padded"]["tokens_per_s"]

    report = {
        "benchmark": "packing_vs_padding",
        "device": str(trainer.device),
        "platform": platform.platform(),
        "torch_threads": opts.threads,
        "model": {"hidden_size": opts.hidden_size, "num_layers": opts.num_layers},
        "num_samples": opts.num_samples,
        "micro_batch_size": opts.micro_batch_size,
        "max_tokens_per_gpu": budget,
        "lengths": {"min": min(lengths), "max": max(lengths), "total": real},
        "repeats": opts.repeats,
        "results": results,
        "packed_over_padded_tokens_per_s": ratio("packed"),
        "packed_dynamic_over_padded_tokens_per_s": ratio("packed_dynamic"),
    }
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for name, result in results.items():
        print(
            f"{name:15s} {result['tokens_per_s']:9.0f} tokens/s  step {result['step_time_s'] * 1e3:7.1f} ms  "
            f"{result['micro_batches']} micro-batches, padding {result['padding_fraction']:.0%}"
        )
    print(f"packed / padded: {report['packed_over_padded_tokens_per_s']:.2f}x -> {out}")


if __name__ == "__main__":
    main()
