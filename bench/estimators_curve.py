"""Reward curves of grpo, dr_grpo and reinforce_plus_plus_baseline on the quickstart task, side by side.

The quickstart's recipe (examples/quickstart/run.sh): a tiny model, the "sort the digits" task, one SFT
warm start shared by every run, then one ``train.py`` RL run per estimator from the same SFT weights,
seed, data order and flags; only ``--advantage-estimator`` changes (and dr_grpo gets its
``--loss-agg-mode seq_mean_token_sum``). A benchmark, not a test: the curves are noisy (one seed) and
the runs take minutes each on a CPU.

    python bench/estimators_curve.py                      # 100 rollouts per estimator
    python bench/estimators_curve.py --num-rollout 200 --seed 1

Writes docs/estimators_reward_curve.png and bench/results/estimators_curve.json (per estimator: the
reward of every rollout, first-5 / last-5 mean and gain, wall time).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "quickstart"))
from plot_rewards import read_scalars, summarize  # noqa: E402

ESTIMATORS = {
    "grpo": [],
    "dr_grpo": ["--loss-agg-mode", "seq_mean_token_sum"],
    "reinforce_plus_plus_baseline": [],
}


def model_args() -> list[str]:
    script = REPO / "scripts" / "models" / "tiny-qwen2.sh"
    out = subprocess.run(
        ["bash", "-c", f'source {shlex.quote(str(script))}; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.splitlines()


def run(command: list[str], log: Path) -> float:
    """Runs one step of the recipe, its output to ``log``; returns its wall time in seconds."""
    start = time.perf_counter()
    with log.open("w") as f:
        result = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command[:3])} ... failed (exit {result.returncode}); see {log}")
    return time.perf_counter() - start


def common_args(seed: int) -> list[str]:
    return [
        *model_args(),
        "--seed", str(seed), "--rollout-seed", str(seed), "--rollout-shuffle",
        "--input-key", "prompt", "--lr-decay-style", "constant",
        "--adam-beta2", "0.98", "--weight-decay", "0.0",
    ]  # fmt: skip


def prepare(work: Path, seed: int) -> Path:
    """Tiny model, task data and the shared SFT warm start (skipped when already there)."""
    py = sys.executable
    sft = work / "sft"
    if (sft / "model.safetensors").exists():
        return sft
    seed_flag = ["--seed", str(seed)]
    run([py, "tools/make_tiny_model.py", "--out", str(work / "base"), *seed_flag], work / "make_model.log")
    run([py, "examples/quickstart/make_data.py", "--out", str(work / "data"), *seed_flag], work / "data.log")
    sft_flags = [
        "--hf-checkpoint", str(work / "base"),
        "--prompt-data", str(work / "data" / "sft.jsonl"), "--label-key", "response",
        "--loss-type", "sft_loss", "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--rollout-batch-size", "64", "--micro-batch-size", "64", "--num-rollout", "75", "--lr", "1e-3",
        "--save-hf", str(sft),
    ]  # fmt: skip
    run([py, "train.py", *common_args(seed), *sft_flags], work / "sft.log")
    return sft


def rl_run(work: Path, sft: Path, estimator: str, seed: int, num_rollout: int) -> dict:
    tb = work / "tb" / estimator
    shutil.rmtree(tb, ignore_errors=True)  # a curve from an earlier (or aborted) run must not mix in
    flags = [
        "--hf-checkpoint", str(sft),
        "--prompt-data", str(work / "data" / "train.jsonl"), "--label-key", "label", "--rm-type", "exact",
        "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--num-rollout", str(num_rollout),
        "--micro-batch-size", "32", "--rollout-temperature", "1.0", "--rollout-max-response-len", "8",
        "--rollout-skip-special-tokens", "--eps-clip", "0.2", "--lr", "1e-4", "--lr-warmup-iters", "10",
        "--advantage-estimator", estimator, *ESTIMATORS[estimator],
        "--tb-dir", str(tb),
    ]  # fmt: skip
    seconds = run([sys.executable, "train.py", *common_args(seed), *flags], work / f"{estimator}.log")
    curve = read_scalars(tb, "rollout/raw_reward")
    rewards = [value for _, value in curve]
    return {"rewards": rewards, **summarize(rewards), "wall_s": seconds}


def plot(results: dict[str, dict], out: Path, num_rollout: int, seed: int) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for estimator, result in results.items():
        rewards = result["rewards"]
        windows = [rewards[max(0, i - 9) : i + 1] for i in range(len(rewards))]
        smooth = [sum(window) / len(window) for window in windows]
        (line,) = ax.plot(smooth, lw=2, label=f"{estimator} (gain {result['gain']:+.2f})")
        ax.plot(rewards, lw=0.8, alpha=0.3, color=line.get_color())
    ax.set_xlabel("rollout (16 prompts × 8 samples)")
    ax.set_ylabel("exact-match reward (10-rollout mean)")
    ax.set_title(f"Estimators on the quickstart sort task, tiny model, seed {seed}, {num_rollout} rollouts")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-rollout", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=REPO / "outputs" / "estimators_curve")
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "estimators_reward_curve.png")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "estimators_curve.json")
    parser.add_argument("--estimators", nargs="+", choices=sorted(ESTIMATORS), default=list(ESTIMATORS))
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    sft = prepare(args.work_dir, args.seed)
    results = {}
    for estimator in args.estimators:
        results[estimator] = rl_run(args.work_dir, sft, estimator, args.seed, args.num_rollout)
        print(f"{estimator}: gain {results[estimator]['gain']:+.3f} in {results[estimator]['wall_s']:.0f} s")
    plot(results, args.png, args.num_rollout, args.seed)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "task": "examples/quickstart sort digits, tiny qwen2, SFT warm start then RL",
        "num_rollout": args.num_rollout,
        "seed": args.seed,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "results": results,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.png} and {args.json}")


if __name__ == "__main__":
    main()
