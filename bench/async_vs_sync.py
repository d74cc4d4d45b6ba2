"""Wall-clock per rollout: ``train_async.py`` vs ``train.py`` on the same config, on the CPU.

One torch engine and one Megatron trainer rank, each limited to one compute thread
(``SLIME_WORKER_THREADS=1``), so on a two-core machine generation and training get a core each. The
rollout is sized so that generating it and training on it take about the same time: then the
synchronous loop pays for both one after the other and the overlapped one for the longer of the two,
an ideal speedup of 2x minus the weight push and the loop's own overhead.

Per rollout means ``perf/step_time`` (the loop's wall-clock from one logged rollout to the next),
the median over rollouts 1.. (rollout 0 has nothing to overlap with). Runs alternate sync, async,
sync, async..., because the machines this runs on are shared; the speedup is the ratio of the
medians over all runs of each loop, and each pair's ratio is reported too.

    python bench/async_vs_sync.py                       # 8 prompts x 8 samples, 64 new tokens
    python bench/async_vs_sync.py --repeats 5 --num-rollout 20

Writes bench/results/async_vs_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.make_tiny_model import make_tiny_model  # noqa: E402

SCRIPTS = {"sync": "train.py", "async": "train_async.py"}


def model_args() -> list[str]:
    script = REPO / "scripts/models/tiny-qwen2.sh"
    command = f'source {shlex.quote(str(script))}; printf "%s\\n" "${{MODEL_ARGS[@]}}"'
    return subprocess.run(["bash", "-c", command], check=True, capture_output=True, text=True).stdout.split()


def write_task(path: Path, num_prompts: int = 64) -> None:
    """Reverse a few letters; exact-match reward (the reward does not matter for timing)."""
    words = [chr(97 + i % 26) + chr(97 + (3 * i) % 26) + chr(97 + (7 * i) % 26) for i in range(num_prompts)]
    path.write_text("".join(json.dumps({"input": w, "label": w[::-1]}) + "\n" for w in words))


def read_scalars(tb_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run_loop(mode: str, flags: list[str], work: Path, index: int) -> dict:
    tb = work / f"tb_{mode}_{index}"
    env = {**os.environ, "SLIME_WORKER_THREADS": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, SCRIPTS[mode], *flags, "--tb-dir", str(tb)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{SCRIPTS[mode]} failed:\n{result.stderr[-3000:]}")
    wall = time.perf_counter() - start
    scalars = read_scalars(tb)
    steps = scalars["perf/step_time"][1:]
    out = {
        "mode": mode,
        "process_wall_s": wall,
        "step_time_s": scalars["perf/step_time"],
        "median_step_s": statistics.median(steps),
        "mean_generation_s": statistics.mean(scalars["perf/generation_time"][1:]),
        "mean_train_s": statistics.mean(scalars["perf/train_time"][1:]),
        "mean_update_weights_s": statistics.mean(scalars["perf/update_weights_time"][1:]),
    }
    if "rollout/staleness" in scalars:
        out["max_staleness"] = max(scalars["rollout/staleness"])
    print(json.dumps({k: v for k, v in out.items() if k != "step_time_s"}), flush=True)
    return out


def overlap_bound(run: dict) -> float:
    """The speedup a synchronous run's own times allow: its step over the step minus the shorter of
    generation and training (what a perfect overlap on free cores would hide)."""
    step = run["median_step_s"]
    return step / (step - min(run["mean_generation_s"], run["mean_train_s"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollout-batch-size", type=int, default=8)
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-response-len", type=int, default=64)
    parser.add_argument("--num-steps-per-rollout", type=int, default=4)
    parser.add_argument("--num-rollout", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each loop, alternating")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/async_vs_sync.json")
    opts = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="async_vs_sync_") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model")
        write_task(work / "train.jsonl")
        samples = opts.rollout_batch_size * opts.n_samples_per_prompt
        flags = [
            *model_args(),
            "--hf-checkpoint", str(model),
            "--prompt-data", str(work / "train.jsonl"), "--label-key", "label", "--rm-type", "exact",
            "--rollout-batch-size", str(opts.rollout_batch_size),
            "--n-samples-per-prompt", str(opts.n_samples_per_prompt),
            "--rollout-max-response-len", str(opts.max_response_len),
            "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1",
            "--num-steps-per-rollout", str(opts.num_steps_per_rollout),
            "--micro-batch-size", str(samples // opts.num_steps_per_rollout),
            "--lr", "1e-5", "--lr-decay-style", "constant",
            "--num-rollout", str(opts.num_rollout),
            "--log-level", "WARNING",
        ]  # fmt: skip
        load_before = os.getloadavg()
        runs = [run_loop(mode, flags, work, i) for i in range(opts.repeats) for mode in ("sync", "async")]
        load_after = os.getloadavg()

    def medians(mode: str) -> list[float]:
        return [run["median_step_s"] for run in runs if run["mode"] == mode]

    sync_runs = [run for run in runs if run["mode"] == "sync"]
    sync_s = statistics.median(medians("sync"))
    async_s = statistics.median(medians("async"))
    result = {
        "benchmark": "wall-clock per rollout, train_async.py vs train.py",
        "config": {
            "model": "tiny qwen2 (scripts/models/tiny-qwen2.sh)",
            "engines": 1,
            "trainer_ranks": 1,
            "threads_per_worker": 1,
            "rollout_batch_size": opts.rollout_batch_size,
            "n_samples_per_prompt": opts.n_samples_per_prompt,
            "max_response_len": opts.max_response_len,
            "num_steps_per_rollout": opts.num_steps_per_rollout,
            "num_rollout": opts.num_rollout,
            "async_buffer_size": 1,
            "update_weights_interval": 1,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1m_before": load_before[0],
            "load_avg_1m_after": load_after[0],
        },
        "sync_median_step_s": sync_s,
        "async_median_step_s": async_s,
        "speedup": sync_s / async_s,
        "pair_speedups": [s / a for s, a in zip(medians("sync"), medians("async"), strict=True)],
        "overlap_bound_from_sync_runs": statistics.median(overlap_bound(r) for r in sync_runs),
        "target_speedup": 1.5,
        "runs": runs,
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"sync {sync_s:.3f} s/rollout, async {async_s:.3f} s/rollout, speedup {sync_s / async_s:.2f}x")
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
