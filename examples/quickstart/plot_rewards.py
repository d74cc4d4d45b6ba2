"""Reward curve of a run, read back from its TensorBoard events, as a PNG (and the numbers as JSON).

The quickstart's success criterion is computed here too: mean raw reward of the last 5 rollouts
minus that of the first 5.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in events.Scalars(tag)]


def summarize(rewards: list[float], window: int = 5) -> dict[str, float]:
    first = sum(rewards[:window]) / window
    last = sum(rewards[-window:]) / window
    return {"first5_mean_reward": first, "last5_mean_reward": last, "gain": last - first}


def plot(tb_dir: Path, out: Path) -> dict[str, float]:
    curve = read_scalars(tb_dir, "rollout/raw_reward")
    if len(curve) < 10:
        raise SystemExit(f"error: {tb_dir} holds {len(curve)} rollout/raw_reward points; need at least 10")
    steps, rewards = zip(*curve, strict=True)
    summary = summarize(list(rewards))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, lw=1, alpha=0.5, label="rollout reward")
    smooth = [
        sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))
    ]
    ax.plot(steps, smooth, lw=2, label="10-rollout mean")
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    for tag in sorted(t for t in events.Tags()["scalars"] if t.startswith("eval/") and t.count("/") == 1):
        points = events.Scalars(tag)
        ax.plot([p.step for p in points], [p.value for p in points], "o-", label=tag)
    ax.set_xlabel("rollout")
    ax.set_ylabel("exact-match reward")
    first, last = summary["first5_mean_reward"], summary["last5_mean_reward"]
    ax.set_title(f"GRPO on the tiny model: first 5 rollouts {first:.2f} → last 5 {last:.2f}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tb-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    summary = plot(args.tb_dir, args.out)
    first, last = summary["first5_mean_reward"], summary["last5_mean_reward"]
    print(
        f"reward: first 5 rollouts {first:.3f}, last 5 {last:.3f}, gain {last - first:+.3f}; plot: {args.out}"
    )


if __name__ == "__main__":
    main()
