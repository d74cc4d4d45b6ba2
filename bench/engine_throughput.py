"""Decode throughput of the torch engine (over HTTP, concurrent requests) vs batched `model.generate`.

Same model, same prompts, same number of new tokens per request, greedy with EOS suppressed, so both
produce the same tokens (checked). `--waves` x `--batch` requests are served with at most `--batch`
sequences in flight: the engine gets them all at once with `--max-running-requests batch`, while
`generate` takes them `batch` at a time (static batching, the way one uses it). Two cases: every
request asks for the same number of tokens, and the numbers vary. A `generate` batch runs until its
longest row is done, so in the varied case its useful tokens per second (the sum of what the requests
asked for, over wall time) drop, while continuous batching hands a finished request's slot to the next
one at once. The engine runs in its own process and `generate` here, one after the other, never at the
same time (an idle engine uses no CPU); runs alternate and the best of `--repeats` counts, because
the machines this runs on are shared.

    python bench/engine_throughput.py                    # tiny qwen2, batch 16 x 4 waves
    python bench/engine_throughput.py --hidden-size 512 --num-layers 4 --batch 32

Writes bench/results/engine_throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slime.backends.engine_server import start_engine_server  # noqa: E402
from slime.backends.torch_engine.launcher import serving  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402


def run_engine(url: str, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list[list[int]]]:
    """All requests at once from one asyncio client (a pooled aiohttp session, like a rollout loop)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> list[int]:
        params = {"max_new_tokens": lengths[i], "min_new_tokens": lengths[i], "temperature": 0}
        body = {"input_ids": prompts[i], "sampling_params": params}
        async with session.post(f"{url}/generate", json=body) as reply:
            reply.raise_for_status()
            return (await reply.json())["output_ids"]

    async def everything() -> tuple[float, list[list[int]]]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(None)) as session:
            start = time.perf_counter()
            outputs = await asyncio.gather(*(one(session, i) for i in range(len(prompts))))
            return time.perf_counter() - start, list(outputs)

    return asyncio.run(everything())


def run_generate(
    model, prompts: list[list[int]], lengths: list[int], pad_id: int, batch: int
) -> tuple[float, list[list[int]]]:
    """Static batching: `generate` over consecutive groups of `batch` requests."""
    start = time.perf_counter()
    outputs: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        outputs += generate_batch(model, prompts[i : i + batch], lengths[i : i + batch], pad_id)
    return time.perf_counter() - start, outputs


def generate_batch(model, prompts: list[list[int]], lengths: list[int], pad_id: int) -> list[list[int]]:
    """One batched, left-padded `generate` up to the longest request; a row's first `length` tokens count."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    longest = max(lengths)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=pad_id,
        )
    return [out[i, width : width + n].tolist() for i, n in enumerate(lengths)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="sequences in flight")
    parser.add_argument("--waves", type=int, default=4, help="requests = waves x batch")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="equal case; varied: 16 .. 2x this")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs (shared CPUs are noisy)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads, both sides (1 resists CPU contention)"
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "engine_throughput.json"))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    total = args.batch * args.waves
    prompts = [[rng.randrange(3, 90) for _ in range(args.prompt_len)] for _ in range(total)]
    cases = {
        "equal": [args.max_new_tokens] * total,
        "varied": [rng.randrange(16, 2 * args.max_new_tokens + 1) for _ in range(total)],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "model",
            hidden_size=args.hidden_size,
            intermediate_size=4 * args.hidden_size,
            num_layers=args.num_layers,
            max_position_embeddings=args.prompt_len + 2 * args.max_new_tokens + 8,
        )
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        results: dict = {}
        flags = ["--max-running-requests", str(args.batch), "--log-level", "warning", "--random-seed", "0"]
        engine = start_engine_server(
            "torch engine",
            serving(model_dir, *flags),
            Path(tmp) / "engine.log",
            timeout_s=300,
            env={"OMP_NUM_THREADS": str(args.threads)},
        )
        url = engine.url
        try:
            run_engine(url, prompts[:2], [8, 8])  # warm-up
            run_generate(model, prompts[:2], [8, 8], 0, args.batch)
            for name, lengths in cases.items():
                # Alternate the two (the idle engine uses no CPU), so load from other processes on a
                # shared machine hits both alike; keep the best run of each.
                engine_runs, generate_runs = [], []
                for _ in range(args.repeats):
                    engine_runs.append(run_engine(url, prompts, lengths))
                    generate_runs.append(run_generate(model, prompts, lengths, 0, args.batch))
                (engine_s, engine_out), (generate_s, generate_out) = min(engine_runs), min(generate_runs)
                useful = sum(lengths)
                same = sum(a == b for a, b in zip(engine_out, generate_out, strict=True))
                steps = sum(max(lengths[i : i + args.batch]) for i in range(0, len(lengths), args.batch))
                results[name] = {
                    "max_new_tokens": lengths,
                    "useful_tokens": useful,
                    "engine_wall_s": engine_s,
                    "generate_wall_s": generate_s,
                    "engine_tokens_per_s": useful / engine_s,
                    "generate_tokens_per_s": useful / generate_s,
                    "ratio_engine_over_generate": generate_s / engine_s,
                    "generate_decode_steps": steps,
                    "identical_outputs": f"{same}/{len(lengths)}",
                }
        finally:
            engine.stop()

    report = {
        "what": "useful decode tokens/s: torch engine over HTTP vs batched model.generate",
        "model": {"arch": "qwen2", "hidden_size": args.hidden_size, "num_layers": args.num_layers},
        "batch": args.batch,
        "requests": total,
        "prompt_len": args.prompt_len,
        "greedy": True,
        "repeats_best_of": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cases": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for name, entry in results.items():
        print(
            f"{name:7s} engine {entry['engine_tokens_per_s']:8.1f} tok/s   generate "
            f"{entry['generate_tokens_per_s']:8.1f} tok/s   "
            f"ratio {entry['ratio_engine_over_generate']:.2f}   "
            f"identical {entry['identical_outputs']}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
