"""slime vs TRL's GRPOTrainer as the work grows: a grid of model sizes x response lengths, speed only.

``bench/peer_trl.py`` compares the two on the CPU quickstart (the tiny model, 8-token answers), where
fixed per-step costs weigh most. This grid runs the same two contenders, with the same recipe, at
3 model sizes x 2 response lengths and reports how the ratio ours / TRL moves:

- models: all made by ``tools/make_tiny_model.py`` (qwen2 architecture, character tokenizer, tied
  embeddings, vocabulary padded to 112), randomly initialised and **not** fine-tuned: ``tiny`` (its
  defaults: 2 layers, hidden 128, FFN 512, 4 heads / 2 KV groups, ~0.5M parameters), ``10M`` (4 layers,
  hidden 384, FFN 1792, 6 heads / 2 KV groups, ~9.9M) and ``50M`` (8 layers, hidden 768, FFN 2048,
  12 heads / 4 KV groups, ~50.4M). The Megatron flags are derived from each ``config.json``
  (``megatron_model_args``; for ``tiny`` they are checked against ``scripts/models/tiny-qwen2.sh``).
- response lengths: 8 and 64 new tokens (ours ``--rollout-max-response-len``, TRL
  ``max_completion_length``). An untrained model samples its EOS (``<|im_end|>``, 1 of 112 ids) only by
  chance, so most responses run to the limit; the mean length each side produced is recorded
  (``mean_response_len``: ours from ``rollout/response_length``, TRL from ``completions/mean_length``)
  and should be near the limit (at uniform logits about 7.8 of 8 and 49 of 64: the rest ended on EOS).
- data and recipe: ``examples/quickstart/make_data.py`` (sort 4-6 digits, exact-match reward),
  16 prompts x 8 samples per step, one optimizer step per rollout; ours is ``peer_trl.run_ours``
  (``train_async.py``, 1 trainer rank, ``--micro-batch-size 128``, ``--use-rollout-logprobs``,
  ``--share-prompts-in-train``, lr 1e-4 constant after 10 warm-up steps, ``--lr-decay-iters 11`` when
  a run has at most 10 steps), TRL is ``peer_trl.run_trl`` (``bench/peer_trl_trainer.py`` in its own
  venv); see ``peer_trl.py``'s docstring for every remaining difference. No evaluation and no final
  checkpoint on either side (``save_hf=False`` / ``--no-save``).

Per point (size x length) and per side, run one after the other (ours first), with ``--steps``
optimizer steps (fewer at points named by ``--point-steps``: 5 at 50M x 64 by default): the median
step time over steps 1..
(step 0 pays for warm-up), the process wall (start-up included), samples/s both ways
(``samples_per_s`` = 128 / median step, ``samples_per_s_wall`` = steps x 128 / process wall), the
peak summed RSS and PSS of the whole process tree (``peer_trl.TreeSampler``), and the mean response
length; ``ratio`` is ours / TRL for both samples/s figures. Also each model's parameter count (from its
safetensors; tied embeddings counted once).

The machine is shared: before each side the grid waits (at most ``--quiet-wait-s``, default 60 s) for
the CPUs to go idle, and records (``cpu_s``) the CPU-seconds the machine spent on other jobs while the
side ran (``ForeignCpu``). Another job on 2 cores slows both sides, TRL's (2 intra-op threads, which
spin at each barrier) far more than ours (1 thread per process): treat a point with tens of foreign
CPU-seconds as disturbed.

    .venv/bin/python bench/peer_trl_grid.py                        # the full grid
    .venv/bin/python bench/peer_trl_grid.py --steps 3 --sizes tiny --lengths 8 \\
        --work-dir /tmp/grid_dev --out /tmp/grid_dev/grid.json      # a smoke run
    .venv/bin/python bench/peer_trl_grid.py --sizes tiny --lengths 64 --update   # re-run one point
    .venv/bin/python bench/peer_trl_grid.py --replot bench/results/peer_trl_grid.json  # table + plot

Writes ``bench/results/peer_trl_grid.json`` and, next to it, ``peer_trl_grid.png`` (x: parameters,
log scale; y: ratio ours / TRL of samples/s; one line per response length; per-step and by-wall
panels). ``--work-dir`` (default ``outputs/peer_trl_grid``) keeps the data and the models between runs.
The TRL venv is made as ``peer_trl.py`` makes it when missing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import peer_trl  # noqa: E402

# name -> tools/make_tiny_model.py flags (qwen2, tied embeddings, head dim = hidden / heads).
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 2, "hidden_size": 128, "intermediate_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    "10M": {"num_layers": 4, "hidden_size": 384, "intermediate_size": 1792,
            "num_attention_heads": 6, "num_key_value_heads": 2},
    "50M": {"num_layers": 8, "hidden_size": 768, "intermediate_size": 2048,
            "num_attention_heads": 12, "num_key_value_heads": 4},
}  # fmt: skip
LENGTHS = (8, 64)
# The 50M model's 64-token steps take ~0.5-1 min a side on 2 cores: fewer of them keeps the grid short.
DEFAULT_POINT_STEPS = ("50M:64=5",)
MODEL_SEED = 0


def make_model(work: Path, name: str, python: str) -> Path:
    """The ``name`` model in ``work/models/name`` (make_tiny_model.py returns an existing one as is)."""
    out = work / "models" / name
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in SIZES[name].items()]
    peer_trl.run_logged(
        [python, "tools/make_tiny_model.py", "--out", str(out), "--seed", str(MODEL_SEED), *flags],
        work / f"logs/make_model_{name}.log",
    )
    return out


def make_data(work: Path, seed: int, python: str) -> Path:
    data = work / "data"
    if not (data / "train.jsonl").is_file():
        peer_trl.run_logged(
            [python, "examples/quickstart/make_data.py", "--out", str(data), "--seed", str(seed)],
            work / "logs/make_data.log",
        )
    return data


def megatron_model_args(model: Path) -> list[str]:
    """Megatron-core flags for a qwen2 checkpoint made by make_tiny_model.py, read from its config.json
    (the shape of ``scripts/models/tiny-qwen2.sh``)."""
    config = json.loads((model / "config.json").read_text())
    if config["model_type"] != "qwen2" or not config.get("tie_word_embeddings", False):
        raise ValueError(f"{model}: expected a qwen2 model with tied embeddings")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return [
        "--swiglu",
        "--num-layers", str(config["num_hidden_layers"]),
        "--hidden-size", str(config["hidden_size"]),
        "--ffn-hidden-size", str(config["intermediate_size"]),
        "--num-attention-heads", str(config["num_attention_heads"]),
        "--group-query-attention",
        "--num-query-groups", str(config["num_key_value_heads"]),
        "--kv-channels", str(head_dim),
        "--use-rotary-position-embeddings",
        "--rotary-base", f"{rope_theta(config):g}",
        "--disable-bias-linear",
        "--add-qkv-bias",
        "--normalization", "RMSNorm",
        "--norm-epsilon", f"{config['rms_norm_eps']:g}",
        "--vocab-size", str(config["vocab_size"]),
        "--max-position-embeddings", str(config["max_position_embeddings"]),
    ]  # fmt: skip


def rope_theta(config: dict[str, Any]) -> float:
    if "rope_theta" in config:
        return config["rope_theta"]
    return (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)


def parameter_count(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                total += math.prod(f.get_slice(key).get_shape())
    return total


def same_flags(a: list[str], b: list[str]) -> bool:
    """Flag lists equal up to how numbers are spelled (1e-06 vs 1e-6)."""

    def norm(token: str) -> str | float:
        try:
            return float(token)
        except ValueError:
            return token

    return [norm(t) for t in a] == [norm(t) for t in b]


def side_summary(raw: dict[str, Any], lengths: list[float] | None) -> dict[str, Any]:
    keep = (
        "wall_s", "step_median_s", "samples_per_s", "samples_per_s_wall", "peak_memory_gib",
        "peak_memory_pss_gib", "num_processes", "memory_at_peak_mib", "step_times_s", "command", "log",
        # ours
        "first_request_s", "rollout_median_s", "train_median_s", "sync_median_s", "peak_memory_reported_gib",
        # TRL
        "setup_s", "generation_median_s", "rest_median_s", "torch_threads", "clipped_ratios",
    )  # fmt: skip
    out = {key: raw[key] for key in keep if key in raw}
    out["response_lengths"] = lengths
    out["mean_response_len"] = statistics.mean(lengths) if lengths else None
    return out


def wait_quiet(max_wait_s: float, busy_below: float = 20.0, window_s: float = 3.0) -> dict[str, Any]:
    """Waits (at most ``max_wait_s``) until the machine's CPU use over ``window_s`` is below
    ``busy_below`` percent: another job on the 2 cores slows either side, TRL's 2 threads most."""

    def busy_now() -> float:
        cpu = psutil.cpu_times_percent(interval=window_s)
        return 100.0 - cpu.idle - getattr(cpu, "iowait", 0.0) - getattr(cpu, "steal", 0.0)

    start = time.perf_counter()
    busy = busy_now()
    while busy >= busy_below and time.perf_counter() - start < max_wait_s:
        busy = busy_now()
    waited = round(time.perf_counter() - start, 1)
    return {"waited_s": waited, "cpu_percent": busy, "quiet": busy < busy_below}


class ForeignCpu:
    """CPU-seconds the machine spent on other jobs while the block ran: its busy time (all but idle,
    iowait and steal) less the user + system time of this process and every descendant of it, each
    as last seen by a sampler (every ``interval_s``; Ray's daemons are not reaped by their parent, so
    ``os.times()`` cannot count them). Short-lived descendants and each one's last interval are missed,
    so ``foreign`` is an upper bound: a few seconds on a quiet machine. ``niced`` is the machine's
    niced CPU time: Ray runs its workers at nice 15 (``RAY_worker_niceness``), ours (the trainer, the
    rollout manager, the engine they start) as well as any other job's, so it is no measure of others."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self._seen: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-cpu", daemon=True)

    @staticmethod
    def _busy() -> tuple[float, float, float]:
        cpu = psutil.cpu_times()
        steal = getattr(cpu, "steal", 0.0)
        return sum(cpu) - cpu.idle - getattr(cpu, "iowait", 0.0) - steal, steal, cpu.nice

    def _sample(self) -> None:
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    self._seen[(proc.pid, proc.create_time())] = times.user + times.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ForeignCpu:
        self._sample()
        self._base = dict(self._seen)  # this process's CPU so far is not the block's
        self._start = self._busy()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        busy, steal, nice = (b - a for a, b in zip(self._start, self._busy(), strict=True))
        mine = sum(cpu - self._base.get(key, 0.0) for key, cpu in self._seen.items())
        self.seconds = {"busy": round(busy, 1), "ours": round(mine, 1), "foreign": round(busy - mine, 1),
                        "niced": round(nice, 1), "steal": round(steal, 1)}  # fmt: skip


def run_point(
    work: Path,
    size: str,
    model: Path,
    length: int,
    steps: int,
    seed: int,
    python: str,
    trl_python: Path,
    quiet_wait_s: float,
) -> dict[str, Any]:
    point = work / "points" / f"{size}_len{length}"
    point.mkdir(parents=True, exist_ok=True)
    link = point / "data"
    if not link.exists():
        link.symlink_to(work / "data", target_is_directory=True)
    opts = argparse.Namespace(num_steps=steps, seed=seed)
    load_before = os.getloadavg()[0]
    start = time.time()
    quiet_ours = wait_quiet(quiet_wait_s)
    with ForeignCpu() as cpu_ours:
        ours = peer_trl.run_ours(
            point, model, opts, python, model_flags=megatron_model_args(model), max_response_len=length,
            save_hf=False,
        )  # fmt: skip
    ours_scalars = peer_trl.read_scalars(point / "tb/grpo")
    quiet_trl = wait_quiet(quiet_wait_s)
    with ForeignCpu() as cpu_trl:
        trl = peer_trl.run_trl(point, model, opts, trl_python, max_completion_length=length, save_final=False)
    trl_result = json.loads((point / "trl/result.json").read_text())
    ours_side = side_summary(ours, ours_scalars.get("rollout/response_length"))
    ours_side["truncated_ratio_mean"] = statistics.mean(ours_scalars.get("rollout/truncated_ratio") or [0.0])
    trl_side = side_summary(trl, trl_result["mean_completion_lengths"])
    clipped = [c for c in trl_result["clipped_ratios"] if c is not None]
    trl_side["truncated_ratio_mean"] = statistics.mean(clipped) if clipped else None
    for side, quiet, cpu in ((ours_side, quiet_ours, cpu_ours), (trl_side, quiet_trl, cpu_trl)):
        side["quiet_before"] = quiet
        side["cpu_s"] = cpu.seconds
    return {
        "size": size,
        "max_response_len": length,
        "steps": steps,
        "seconds": time.time() - start,
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": os.getloadavg()[0],
        "ours": ours_side,
        "trl": trl_side,
        "ratio": {
            "step_median": ours["step_median_s"] / trl["step_median_s"],
            "samples_per_s": ours["samples_per_s"] / trl["samples_per_s"],
            "samples_per_s_wall": ours["samples_per_s_wall"] / trl["samples_per_s_wall"],
        },
    }


def table(points: list[dict[str, Any]], params: dict[str, int]) -> str:
    head = (
        f"{'size':>5} {'params':>7} {'len':>4} {'steps':>5} | {'step s ours':>11} {'TRL':>7} "
        f"{'ratio/step':>10} | {'wall s ours':>11} {'TRL':>7} {'ratio/wall':>10} | {'len ours':>8} "
        f"{'TRL':>5} | {'RSS GiB ours':>12} {'TRL':>5} | {'PSS ours':>8} {'TRL':>5} | "
        f"{'other CPU s ours':>16} {'TRL':>5}"
    )
    lines = [head, "-" * len(head)]
    for p in points:
        o, t, r = p["ours"], p["trl"], p["ratio"]
        lines.append(
            f"{p['size']:>5} {params[p['size']] / 1e6:>6.1f}M {p['max_response_len']:>4} {p['steps']:>5} | "
            f"{o['step_median_s']:>11.3f} {t['step_median_s']:>7.3f} {r['samples_per_s']:>9.2f}x | "
            f"{o['wall_s']:>11.1f} {t['wall_s']:>7.1f} {r['samples_per_s_wall']:>9.2f}x | "
            f"{o['mean_response_len']:>8.1f} {t['mean_response_len']:>5.1f} | "
            f"{o['peak_memory_gib']:>12.2f} {t['peak_memory_gib']:>5.2f} | "
            f"{o['peak_memory_pss_gib']:>8.2f} {t['peak_memory_pss_gib']:>5.2f} | "
            f"{o['cpu_s']['foreign']:>16.0f} {t['cpu_s']['foreign']:>5.0f}"
        )
    lines.append(
        "ratio = ours / TRL of samples/s (> 1: ours faster); step s = median step over steps 1..; "
        "other CPU s = CPU-seconds other jobs used on the machine during that side"
    )
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], params: dict[str, int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    panels = (("samples_per_s", "per step (128 / median step)"), ("samples_per_s_wall", "by process wall"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for length in sorted({p["max_response_len"] for p in points}):
            row = sorted(
                (params[p["size"]], p["ratio"][key]) for p in points if p["max_response_len"] == length
            )
            ax.plot([x for x, _ in row], [y for _, y in row], marker="o", label=f"{length} new tokens")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ratios = [p["ratio"][k] for p in points for k in ("samples_per_s", "samples_per_s_wall")]
        if max(ratios) / min(ratios) > 4:
            ax.set_yscale("log")
        ax.set_xlabel("model parameters")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("samples/s ratio, slime / TRL")
    axes[0].legend()
    fig.suptitle("slime train_async.py vs trl.GRPOTrainer, 2-core CPU, 16 x 8 samples per step")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def parse_point_steps(values: list[str]) -> dict[tuple[str, int], int]:
    """``SIZE:LEN=STEPS`` entries."""
    out = {}
    for value in values:
        key, steps = value.split("=")
        size, length = key.split(":")
        out[(size, int(length))] = int(steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per point and side")
    parser.add_argument(
        "--point-steps", action="append", default=list(DEFAULT_POINT_STEPS), metavar="SIZE:LEN=STEPS",
        help=f"other step counts at some points (repeatable, later wins); default {DEFAULT_POINT_STEPS}",
    )  # fmt: skip
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quiet-wait-s", type=float, default=60.0,
        help="before each side, wait at most this long for the CPUs to go idle (below 20%% busy)",
    )  # fmt: skip
    parser.add_argument("--work-dir", type=Path, default=REPO / "outputs/peer_trl_grid")
    parser.add_argument("--trl-venv", type=Path, default=REPO / ".venv-peer-trl")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/peer_trl_grid.json")
    parser.add_argument(
        "--update", action="store_true",
        help="merge into --out: this run's points replace the same (size, length) ones, the rest stay",
    )  # fmt: skip
    parser.add_argument(
        "--replot", type=Path, metavar="JSON",
        help="only print the table and redraw the plot (next to --out) of an earlier result",
    )  # fmt: skip
    opts = parser.parse_args()
    if opts.replot is not None:
        earlier = json.loads(opts.replot.read_text())
        plot(earlier["points"], earlier["params"], opts.out.with_suffix(".png"))
        print(table(earlier["points"], earlier["params"]))
        return
    point_steps = parse_point_steps(opts.point_steps)
    if min([opts.steps, *point_steps.values()]) < 2:
        parser.error("at least 2 steps per point (the median skips step 0)")
    work = opts.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    trl_python = peer_trl.ensure_trl_venv(opts.trl_venv.resolve())

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    make_data(work, opts.seed, python)
    models = {size: make_model(work, size, python) for size in opts.sizes}
    if "tiny" in models and not same_flags(megatron_model_args(models["tiny"]), peer_trl.model_args()):
        raise RuntimeError("the tiny model's derived Megatron flags differ from scripts/models/tiny-qwen2.sh")
    params = {size: parameter_count(path) for size, path in models.items()}
    points = []
    for size in opts.sizes:
        for length in opts.lengths:
            steps = point_steps.get((size, length), opts.steps)
            print(
                f"=== {size} ({params[size] / 1e6:.2f}M params), {length} tokens, {steps} steps", flush=True
            )
            points.append(
                run_point(
                    work, size, models[size], length, steps, opts.seed, python, trl_python, opts.quiet_wait_s
                )
            )
            points[-1]["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            print(table(points, params), flush=True)

    trl_versions = json.loads(
        (work / "points" / f"{opts.sizes[0]}_len{opts.lengths[0]}/trl/result.json").read_text()
    )
    result = {
        "benchmark": "slime train_async.py vs trl.GRPOTrainer: model size x response length grid, speed only",
        "date": started.isoformat(timespec="seconds"),
        "grid_s": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "cpu_model": peer_trl.cpu_model(),
            "memory_gib": psutil.virtual_memory().total / 2**30,
            "load_avg_1m_before": load_before[0],
            "load_avg_1m_after": os.getloadavg()[0],
        },
        "versions": {**peer_trl.versions(), "trl_venv": trl_versions["versions"]},
        "settings": {
            "steps": opts.steps,
            "point_steps": {f"{s}:{n}": v for (s, n), v in point_steps.items()},
            "seed": opts.seed,
            "model_seed": MODEL_SEED,
            "models": {
                size: {
                    **SIZES[size],
                    "params": params[size],
                    "megatron_args": megatron_model_args(models[size]),
                }
                for size in opts.sizes
            },
            "untrained": True,
            "lengths": opts.lengths,
            "task": "examples/quickstart/make_data.py: sort 4-6 digits, exact-match reward",
            "prompts_per_step": peer_trl.PROMPTS_PER_STEP,
            "samples_per_prompt": peer_trl.SAMPLES_PER_PROMPT,
            "samples_per_step": peer_trl.SAMPLES_PER_STEP,
            "ours": "peer_trl.run_ours: train_async.py, 1 trainer rank, --micro-batch-size 128, "
            "--use-rollout-logprobs, --share-prompts-in-train, lr 1e-4 constant, 10 warm-up steps",
            "trl": "peer_trl.run_trl: bench/peer_trl_trainer.py (4 x 32 per optimizer step, dapo loss)",
            "median_over": "steps 1.. (step 0 skipped)",
            "work_dir": str(work),
            "trl_venv": str(opts.trl_venv),
        },
        "params": params,
        "points": points,
    }
    if opts.update and opts.out.is_file():
        # Keep the earlier file's other points (a disturbed point re-run on its own replaces its entry).
        earlier = json.loads(opts.out.read_text())
        ran = {(p["size"], p["max_response_len"]) for p in points}
        kept = [p for p in earlier["points"] if (p["size"], p["max_response_len"]) not in ran]
        order = {name: i for i, name in enumerate(SIZES)}
        points = sorted([*kept, *points], key=lambda p: (order[p["size"]], p["max_response_len"]))
        params = {**earlier["params"], **params}
        models_info = {**earlier["settings"]["models"], **result["settings"]["models"]}
        result["settings"]["models"] = {name: models_info[name] for name in SIZES if name in models_info}
        result["settings"]["lengths"] = sorted({p["max_response_len"] for p in points})
        result["updates"] = [*earlier.get("updates", [earlier["date"]]), result["date"]]
        result["date"] = earlier["date"]
        result.update(params=params, points=points)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2) + "\n")
    png = opts.out.with_suffix(".png")
    plot(points, params, png)
    print(table(points, params))
    print(f"wrote {opts.out} and {png}")


if __name__ == "__main__":
    main()
