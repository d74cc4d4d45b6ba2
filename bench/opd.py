"""On-policy distillation on the quickstart task: does a teacher's per-token signal make GRPO learn faster?

One shared start, built once by the quickstart itself (``examples/quickstart/run.sh`` with
``NUM_RL_ROLLOUTS=--teacher-rollouts``): the tiny model, the "sort the digits" data, the SFT warm start
(``sft/``) and, as its GRPO phase trained for longer, the **teacher** (``grpo/``, its held-out eval
logged every 50 rollouts). Then, per seed, arms from that same SFT checkpoint with the quickstart's GRPO
flags, the same data order and sampling seed, evaluated on the same held-out set every
``--eval-interval`` rollouts; they differ only in the distillation flags:

- ``grpo``: GRPO alone;
- ``opd_kl<C>``: GRPO + ``--use-opd --opd-teacher-hf-checkpoint <teacher> --opd-kl-coef C`` (one per
  ``--kl-coefs``; the teacher's engine takes a logical GPU of its own). ``C = 0`` is the control: GRPO
  with the teacher only measuring the reverse KL (advantages unchanged);
- ``opd_only`` (``--opd-only``): the teacher is the only signal.

The claim checked: from the same start, the student's held-out eval rises faster with the teacher.
Curves of one seed are noisy (eval: one sample at temperature 1 per prompt of 256); several seeds show
the spread. A finished run is kept in ``<out>/runs/<name>.json`` and reused while its command line is
the same, so adding seeds or coefficients runs only the new arms (delete the file to rerun one).

    python bench/opd.py                                   # seed 0, 80 rollouts, kl-coef 1.0, opd_only
    python bench/opd.py --seeds 0 1 2 --kl-coefs 0 1 3    # the recorded result

Writes bench/results/opd.json (per arm and seed: eval curve, training reward, reverse KL and teacher
log-prob curves, wall time; the teacher's eval) and bench/results/opd.png. Each ``train.py`` is a
subprocess whose output goes to ``<out>/<run>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from estimators_curve import common_args, read_scalars, run  # noqa: E402  (the quickstart's flags and runner)

EVAL_TAG = "eval/sort"  # run.sh's evaluation set is named "sort"
CURVES = {
    "eval": EVAL_TAG,
    "reward": "rollout/raw_reward",
    "reverse_kl": "train/opd/reverse_kl",
    "teacher_logprob": "train/opd/teacher_logprob",
}


@dataclass
class Arm:
    """One RL run from the SFT start: its name and the flags it adds to the quickstart's GRPO phase."""

    name: str
    flags: list[str] = field(default_factory=list)


@dataclass
class ArmResult:
    arm: str
    seed: int
    wall_s: float
    curves: dict[str, list[tuple[int, float]]]
    eval_mean_after_start: float
    eval_final: float


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def commit() -> str:
    """HEAD's short hash, with ``+dirty`` when slime/ differs from it (the numbers are of this tree, not
    necessarily of the commit); ``unknown`` outside a git checkout (a ``git archive`` copy)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "slime"], cwd=REPO).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "")


def build_start(work: Path, seed: int, teacher_rollouts: int) -> Path:
    """The quickstart run as it is (base, data, SFT, then GRPO for ``teacher_rollouts`` as the teacher),
    under ``work/start``; skipped when the teacher is already there."""
    start = work / "start"
    if (start / "grpo" / "model.safetensors.index.json").exists():  # --save-hf writes it last
        log(f"start: reusing {start} (sft/ and the teacher grpo/)")
        return start
    shutil.rmtree(start, ignore_errors=True)  # a half-built start must not mix its TensorBoard events in
    log(f"start: examples/quickstart/run.sh, SFT then {teacher_rollouts} GRPO rollouts for the teacher")
    env = {**os.environ, "OUT": str(start), "SEED": str(seed), "NUM_RL_ROLLOUTS": str(teacher_rollouts)}
    started = time.perf_counter()
    with (work / "start.log").open("w") as f:
        result = subprocess.run(["bash", "examples/quickstart/run.sh"], cwd=REPO, env=env, stdout=f, stderr=f)
    if result.returncode:
        raise SystemExit(
            f"error: examples/quickstart/run.sh failed (exit {result.returncode}); see {work}/start.log"
        )
    log(f"start: built in {time.perf_counter() - started:.0f} s")
    return start


def grpo_flags(start: Path, num_rollout: int, eval_interval: int, student: str = "sft") -> list[str]:
    """The quickstart's GRPO phase (examples/quickstart/run.sh, step 2/3) from its SFT checkpoint, with
    evaluation every ``eval_interval`` rollouts and no checkpoint."""
    data = start / "data"
    return [
        "--hf-checkpoint", str(start / student),
        "--prompt-data", str(data / "train.jsonl"), "--label-key", "label", "--rm-type", "exact",
        "--eval-prompt-data", "sort", str(data / "eval.jsonl"), "--eval-interval", str(eval_interval),
        "--n-samples-per-eval-prompt", "1",
        "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "2",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--num-rollout", str(num_rollout),
        "--micro-batch-size", "32",
        "--rollout-temperature", "1.0", "--rollout-max-response-len", "8", "--rollout-skip-special-tokens",
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--share-prompts-in-train",
        "--lr", "1e-4", "--lr-warmup-iters", "10",
    ]  # fmt: skip


def arms(teacher: Path, kl_coefs: list[float], opd_only: bool) -> list[Arm]:
    distill = ["--use-opd", "--opd-teacher-hf-checkpoint", str(teacher)]
    result = [Arm("grpo")]
    result += [Arm(f"opd_kl{c:g}", [*distill, "--opd-kl-coef", str(c)]) for c in kl_coefs]
    if opd_only:
        result.append(Arm("opd_only", [*distill, "--opd-kl-coef", "1.0", "--opd-only"]))
    return result


def curves_of(tb: Path) -> dict[str, list[tuple[int, float]]]:
    return {name: read_scalars(tb, tag) for name, tag in CURVES.items() if read_scalars(tb, tag)}


def run_arm(
    work: Path, start: Path, arm: Arm, seed: int, num_rollout: int, eval_interval: int, student: str = "sft"
) -> ArmResult:
    """One arm's ``train.py`` run and its curves; a run already finished with the same command line
    (``<out>/runs/<name>.json``) is reused, so an interrupted or extended bench runs only what is new."""
    name = f"{arm.name}_s{seed}" if student == "sft" else f"{arm.name}_{student}_s{seed}"
    tb = work / "tb" / name
    command = [
        sys.executable, "train.py", *common_args(seed),
        *grpo_flags(start, num_rollout, eval_interval, student), *arm.flags, "--tb-dir", str(tb),
    ]  # fmt: skip
    record = work / "runs" / f"{name}.json"
    if record.exists():
        saved = json.loads(record.read_text())
        if saved["command"] == command:
            log(f"{name}: reusing {record}")
            return ArmResult(**saved["result"])
    log(f"{name}: {num_rollout} rollouts")
    shutil.rmtree(tb, ignore_errors=True)  # a curve from an earlier (or aborted) run must not mix in
    seconds = run(command, work / f"{name}.log")
    curves = curves_of(tb)
    evals = [value for _, value in curves.get("eval", [])]
    if len(evals) < 2:
        raise SystemExit(f"error: {tb} holds {len(evals)} {EVAL_TAG} points; see {work}/{name}.log")
    result = ArmResult(arm.name, seed, seconds, curves, sum(evals[1:]) / len(evals[1:]), evals[-1])
    record.parent.mkdir(exist_ok=True)
    record.write_text(json.dumps({"command": command, "result": asdict(result)}) + "\n")
    return result


def smoothed(values: list[float], window: int = 10) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def seed_mean(results: list[ArmResult], curve: str) -> tuple[list[int], list[float]]:
    """The arm's ``curve`` averaged over its seeds (every seed logs the same steps)."""
    runs = [r.curves[curve] for r in results if curve in r.curves]
    if not runs:
        return [], []
    steps = [step for step, _ in runs[0]]
    return steps, [sum(run[i][1] for run in runs) / len(runs) for i in range(len(steps))]


def summarize_arms(results: list[ArmResult]) -> dict[str, dict[str, float]]:
    """Per arm, over its seeds: mean eval after rollout 0 (the area under the eval curve, the measure of
    "rises faster"), final eval, wall time, and the reverse KL at the start and the end."""
    summary: dict[str, dict[str, float]] = {}
    for arm in dict.fromkeys(r.arm for r in results):
        runs = [r for r in results if r.arm == arm]
        summary[arm] = {
            "seeds": len(runs),
            "eval_mean_after_start": sum(r.eval_mean_after_start for r in runs) / len(runs),
            "eval_final": sum(r.eval_final for r in runs) / len(runs),
            "wall_s": sum(r.wall_s for r in runs) / len(runs),
        }
        kl = [[value for _, value in r.curves["reverse_kl"]] for r in runs if "reverse_kl" in r.curves]
        if kl:  # how far from the teacher the student starts and ends
            summary[arm]["reverse_kl_first10"] = sum(sum(v[:10]) / len(v[:10]) for v in kl) / len(kl)
            summary[arm]["reverse_kl_last20"] = sum(sum(v[-20:]) / len(v[-20:]) for v in kl) / len(kl)
    return summary


def plot(results: list[ArmResult], teacher_eval: list[tuple[int, float]], out: Path) -> None:
    """Eval, training reward and reverse KL per arm: the mean over seeds bold, each seed faint."""
    fig, (ax_eval, ax_reward, ax_kl) = plt.subplots(1, 3, figsize=(16, 4.8))
    arm_names = list(dict.fromkeys(r.arm for r in results))
    seeds = sorted({r.seed for r in results})
    for index, arm in enumerate(arm_names):
        color = f"C{index}"
        runs = [r for r in results if r.arm == arm]
        for seed_run in runs:
            ax_eval.plot(*zip(*seed_run.curves["eval"], strict=True), color=color, lw=0.8, alpha=0.35)
        steps, evals = seed_mean(runs, "eval")
        ax_eval.plot(
            steps,
            evals,
            "o-",
            color=color,
            lw=2,
            ms=4,
            label=f"{arm} ({sum(evals[1:]) / len(evals[1:]):.3f})",
        )
        if arm != "opd_only":  # --opd-only trains on reward 0; its raw reward is not the task's
            _, rewards = seed_mean(runs, "reward")
            ax_reward.plot(smoothed(rewards), color=color, lw=2, label=arm)
        kl_steps, kl = seed_mean(runs, "reverse_kl")
        if kl:
            ax_kl.plot(kl_steps, smoothed(kl, 5), color=color, lw=2, label=arm)
    if teacher_eval:
        ax_eval.axhline(
            teacher_eval[-1][1], color="black", lw=1, ls=":", label=f"teacher ({teacher_eval[-1][1]:.3f})"
        )
    ax_eval.set(
        xlabel="rollout", ylabel=f"{EVAL_TAG}: exact match, 1 sample at T=1 per prompt",
        title="held-out eval (legend: mean after rollout 0)",
    )  # fmt: skip
    ax_reward.set(
        xlabel="rollout", ylabel="sampled exact-match reward", title="training reward (10-rollout mean)"
    )
    ax_kl.set(
        xlabel="train step",
        ylabel="log π_student − log π_teacher (5-step mean)",
        title="reverse KL to the teacher",
    )
    for ax in (ax_eval, ax_reward, ax_kl):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        "On-policy distillation, quickstart sort task (tiny Qwen2, same SFT start), "
        f"mean of seeds {', '.join(map(str, seeds))}"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "outputs" / "opd", help="working directory of the runs"
    )
    parser.add_argument(
        "--results", type=Path, default=REPO / "bench" / "results", help="where opd.json/png go"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="seeds of the arms (the start uses 0)"
    )
    parser.add_argument("--rollouts", type=int, default=80, help="RL rollouts per arm")
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument(
        "--student",
        choices=["sft", "base"],
        default="sft",
        help="where the arms start: the SFT checkpoint, or the untrained base (no reward at first)",
    )
    parser.add_argument(
        "--teacher-rollouts", type=int, default=400, help="GRPO rollouts that make the teacher"
    )
    parser.add_argument("--kl-coefs", type=float, nargs="+", default=[1.0], help="one GRPO+OPD arm per value")
    parser.add_argument(
        "--no-opd-only", dest="opd_only", action="store_false", help="skip the --opd-only arm"
    )
    args = parser.parse_args()
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    start = build_start(work, 0, args.teacher_rollouts)
    teacher_eval = read_scalars(start / "tb" / "grpo", EVAL_TAG)
    log(f"teacher ({start / 'grpo'}): {EVAL_TAG} " + " → ".join(f"{v:.3f}" for _, v in teacher_eval))
    results: list[ArmResult] = []
    for seed in args.seeds:
        for arm in arms(start / "grpo", args.kl_coefs, args.opd_only):
            result = run_arm(work, start, arm, seed, args.rollouts, args.eval_interval, args.student)
            results.append(result)
            evals = " → ".join(f"{v:.3f}" for _, v in result.curves["eval"])
            after = result.eval_mean_after_start
            log(
                f"{arm.name} seed {seed}: {EVAL_TAG} {evals} (mean after 0 {after:.3f}), {result.wall_s:.0f}s"
            )
    args.results.mkdir(parents=True, exist_ok=True)
    stem = "opd" if args.student == "sft" else f"opd_{args.student}"
    png = args.results / f"{stem}.png"
    plot(results, teacher_eval, png)
    report = {
        "task": "examples/quickstart sort digits, tiny qwen2: SFT warm start, then GRPO with and without OPD",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "rollouts": args.rollouts,
        "eval_interval": args.eval_interval,
        "seeds": args.seeds,
        "student": args.student,
        "teacher": {"rollouts": args.teacher_rollouts, "eval": teacher_eval},
        "summary": summarize_arms(results),
        "results": [asdict(r) for r in results],
    }
    (args.results / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.results / f'{stem}.json'} and {png}")


if __name__ == "__main__":
    main()
