"""slime vs TRL's GRPOTrainer on the CPU quickstart: speed, memory and what each run learns.

Both contenders start from the same SFT checkpoint and the same data, made exactly as
``examples/quickstart/run.sh`` makes them (phases 0 and 1: tiny model, "sort 4-6 digits" data, 75
SFT steps through ``train.py``), and train the same GRPO recipe for ``--num-steps`` optimizer steps:

- **ours**: the quickstart's GRPO ``train_async.py`` command with the same flags, less its evaluation
  and Megatron checkpoints (``--save-hf`` writes the final HF checkpoint; a run of at most 10 steps also
  gets ``--lr-decay-iters 11``, as Megatron's scheduler needs more steps than warm-up ones);
- **TRL**: ``trl.GRPOTrainer`` (``bench/peer_trl_trainer.py``, run by a venv of its own) with the
  equivalent settings: 16 prompts x 8 samples = one generation batch = one optimizer step of
  4 x 32 samples, temperature 1, no top-k / top-p, 8 new tokens, slime's exact-match reward, group
  std-normalised advantages, clip 0.2, no KL, token mean over the step's batch (``dapo``), AdamW
  lr 1e-4 after 10 warm-up steps (beta2 0.98, no weight decay), gradient clipping 1.0, fp32.

The two runs go one after the other, then one evaluator (plain transformers ``generate`` in this
process) scores the SFT checkpoint and both final checkpoints on the 256 held-out prompts with the
same exact-match reward: sampled (temperature 1, 4 samples per prompt, a fixed seed) and greedy.

Measured per contender: the wall-clock of its process (start-up and the final HF export included),
the median step time over steps 1.. (step 0 pays for warm-up; ours also split into rollout / train
/ weight-sync from TensorBoard, TRL into generation / the rest), samples/s both ways
(``samples_per_s`` = 128 / median step, ``samples_per_s_wall`` = steps x 128 / process wall),
the peak summed RSS and PSS of its whole process tree (both sampled from here every 0.25 s;
ours also reports train.py's own figure), the most processes in that tree, the mean training
reward of the first and last 5 steps, and the evaluator's scores. ``ratio`` is ours / TRL.

    .venv/bin/python bench/peer_trl.py               # 200 steps, seed 0, builds .venv-peer-trl if missing
    .venv/bin/python bench/peer_trl.py --num-steps 3 --work-dir /tmp/peer_dev --trl-venv /tmp/trlvenv \\
        --out /tmp/peer_dev/out.json                 # a smoke run

The TRL venv (``--trl-venv``, default ``.venv-peer-trl``) is made when its python is missing:
``python -m venv``, ``pip install torch==2.13.0``, then ``pip install -c constraints.txt trl==1.16.0
transformers==<this venv's> accelerate datasets``. ``--work-dir`` (default ``outputs/peer_trl``)
keeps the set-up between runs: the SFT checkpoint is reused when the same seed made it.
Writes bench/results/peer_trl.json.

Differences between the two setups that remain
----------------------------------------------
- Architecture. slime runs Ray (GCS, raylet, workers), one Megatron-core trainer actor (gloo), one
  torch engine server (continuous batching over a slot KV cache, up to 256 running requests) behind
  sglang-router, prompts and replies over HTTP (keep-alive connections across rollouts), and pushes
  the weights to the engine after every step. TRL runs one process: HF ``model.generate`` on the
  training model itself (one left-padded batch of all 128 sequences, transformers' own dynamic KV
  cache), no copy of the weights.
- Loop and cores. slime runs the quickstart's overlapped loop (``train_async.py``): rollout k+1 is
  generated while the trainer trains on rollout k, so the engine and the trainer each compute on one
  of the 2 cores at once (``OMP_NUM_THREADS`` 1 each: ``slime.utils.hardware.worker_env`` splits a
  CPU node between the processes that compute at the same time). Each sample is one update stale
  when it is trained on; the PPO ratio is taken against the engine's own log-probs
  (``--use-rollout-logprobs``), so the clip corrects for that. The trainer is one rank running the
  step's 128 samples as one micro-batch (``--micro-batch-size 128``). TRL's one process alternates
  generation and training and uses torch's default thread count (all cores, ``torch_threads`` in the
  result).
- Models. slime trains Megatron-core's GPT model (the HF weights converted, sequences packed) and
  samples with the transformers model inside its engine; TRL trains and samples with the same
  transformers Qwen2 model (SDPA attention). Both fp32, so only kernel-level numerics differ.
- Work per step. Neither runs a separate old-log-prob pass: slime's old log-probs are the engine's
  (returned with every sample), TRL's the training forward's own, detached (``num_iterations=1``,
  ratio exactly 1). slime's trainer packs the sequences of a micro-batch without padding (``thd``)
  and, with ``--share-prompts-in-train`` (the quickstart's setting), holds each prompt once for all
  its samples in that micro-batch (16 prompts in the step's one micro-batch of 128 here): its
  forward and backward run over ~1,100 tokens per step where TRL's run over ~2,800 (prompts
  left-padded, completions right-padded, each of the 8 copies of a prompt computed).
  slime's engine also prefills each prompt once for its 8 samples (requests with the same tokens in
  one prefill share it); transformers' ``generate`` prefills all 128 rows. The maths is the same:
  every token sees the same keys, so log-probs and gradients are those of the unshared layout.
- Advantages. Both: (r - group mean) / (unbiased group std + eps); eps is 1e-6 in slime and 1e-4 in
  TRL (``scale_rewards="group"``). Groups whose rewards are all equal get 0 in both and are not
  filtered in either (no dynamic sampling).
- Loss aggregation. slime's ``token_mean`` divides by the tokens of the whole 128-sample step; TRL's
  ``dapo`` divides by the tokens of the whole generation batch, the same set here.
- EOS and truncation. Both stop at the model's EOS (``<|im_end|>``), keep that token in the loss, and
  keep truncated (8-token) completions in the loss with their reward (TRL's
  ``mask_truncated_completions=False``, slime has no such masking). Both score the text decoded with
  special tokens skipped, stripped, against the stripped label. A sampled ``<|endoftext|>`` (special
  but not EOS) ends neither.
- Prompts. Both feed the raw prompt string (no chat template); slime tokenizes it with
  ``add_special_tokens=False``, TRL with the tokenizer's default; for this tokenizer the ids are the
  same (``prompt_ids_match_slime`` in the TRL result checks it on every training prompt).
- Randomness. The prompt order (slime: ``--rollout-shuffle`` with ``--rollout-seed``; TRL: its
  RepeatSampler seeded with ``seed``) and the sampling RNG (the engine's sampler, seeded at start
  from ``--rollout-seed``, drawing for each prompt group's batched request as it is scheduled;
  torch's global RNG in ``generate``) differ, so the two runs see different prompts and samples;
  only the SFT checkpoint, the data and the recipe are shared. Neither run repeats bit for bit:
  slime's batched requests carry no per-sample seed (``--rollout-seed-per-sample`` would).
- Optimizer. Both AdamW-style Adam (beta1 0.9, beta2 0.98, eps 1e-8, weight decay 0) with the same
  schedule (lr x min(k, 10) / 10 at optimizer step k = 0, 1, ...: step 0 has lr 0 in both); slime uses
  Megatron's optimizer wrapper (torch Adam underneath on the CPU), TRL transformers'
  ``adamw_torch_fused``. Global gradient-norm clipping at 1.0 in both.
- Timing. slime's step time is its loop's wall-clock from one logged rollout to the next
  (``perf/step_time``; with generation overlapped, the trainer's step and weight push set it);
  TRL's is the time between two ``on_step_end`` callbacks, which includes the data loader and the
  optimizer step. Both process walls include start-up (Ray and the engine for slime, imports and
  model load for TRL) and the final HF export.
- Memory. Summed RSS counts pages shared between processes (libtorch, Ray's object store) once per
  process, which weighs against slime's many processes; PSS splits shared pages between them. Both are
  sampled, so both are lower bounds of the true peaks.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slime.utils.startup import STARTUP_LOG_ENV, read_marks  # noqa: E402

PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
SAMPLES_PER_STEP = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
TRAINER_RANKS = 1  # run.sh's --actor-num-gpus-per-node
ENTRY_POINT = "train_async.py"  # run.sh's GRPO phase: generation overlapped with training
MICRO_BATCH_SIZE = 128  # run.sh's: the step's samples in one micro-batch
MAX_RESPONSE_LEN = 8
LR_WARMUP_STEPS = 10
EVAL_SAMPLES_PER_PROMPT = 4
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"
PHASE_TIMEOUT_S = 4 * 3600
FIRST_REQUEST = "rollout: first /generate sent"
PEAK_LINE = re.compile(r"done; peak memory of all processes ([0-9.]+) GiB")


def model_args() -> list[str]:
    script = REPO / "scripts/models/tiny-qwen2.sh"
    command = f'source {shlex.quote(str(script))}; printf "%s\\n" "${{MODEL_ARGS[@]}}"'
    return subprocess.run(["bash", "-c", command], check=True, capture_output=True, text=True).stdout.split()


def common_args(seed: int) -> list[str]:
    """run.sh's COMMON_ARGS."""
    return [
        "--seed", str(seed), "--rollout-seed", str(seed), "--rollout-shuffle", "--input-key", "prompt",
        "--lr-decay-style", "constant", "--adam-beta2", "0.98", "--weight-decay", "0.0",
    ]  # fmt: skip


def read_scalars(tb_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def process_kind(cmdline: list[str]) -> str:
    """A short name for what a process of the tree is: ``ray::TrainerActor``, ``gcs_server``,
    ``python train.py``, ``python -m slime.backends.torch_engine``, ``python dashboard.py``."""
    if not cmdline:
        return "?"
    program = cmdline[0].split()[0]
    if program.startswith(("ray::", "sglang::")) or "python" not in Path(program).name:
        return Path(program).name
    rest = cmdline[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        rest = rest[1:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return f"python -m {rest[1]}"
    return f"python {Path(rest[0]).name}" if rest else "python"


class TreeSampler:
    """Peak summed RSS and PSS of a process and all its descendants (every ``interval_s``; PSS from
    ``smaps_rollup``, 0.2 ms a process), what each kind of process held at each peak, and the most
    processes seen in that tree at once.

    RSS counts a shared library's pages once for every process that maps it (torch's in three of
    ours); PSS splits them between those processes, so its sum is the memory the tree occupies."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_rss = self.peak_pss = 0
        self.max_processes = 0
        self.at_peak: dict[str, float] = {}  # MiB of RSS per process kind at the peak summed RSS
        self.at_peak_pss: dict[str, float] = {}  # MiB of PSS per process kind at the peak summed PSS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss = pss = alive = 0
        kinds_rss: dict[str, float] = {}
        kinds_pss: dict[str, float] = {}
        for proc in procs:
            try:
                info = proc.memory_full_info()
                kind = process_kind(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            rss, pss, alive = rss + info.rss, pss + info.pss, alive + 1
            kinds_rss[kind] = kinds_rss.get(kind, 0.0) + info.rss / 2**20
            kinds_pss[kind] = kinds_pss.get(kind, 0.0) + info.pss / 2**20
        if rss > self.peak_rss:
            self.peak_rss, self.at_peak = rss, _by_size(kinds_rss)
        if pss > self.peak_pss:
            self.peak_pss, self.at_peak_pss = pss, _by_size(kinds_pss)
        self.max_processes = max(self.max_processes, alive)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _by_size(mib: dict[str, float]) -> dict[str, float]:
    return {kind: round(value, 1) for kind, value in sorted(mib.items(), key=lambda kv: -kv[1])}


def run_logged(
    command: list[str], log: Path, env: dict[str, str] | None = None, startup_log: Path | None = None
) -> dict[str, Any]:
    """Runs ``command`` from the repo root with its output in ``log``; wall-clock and tree memory.
    With ``startup_log`` its processes write their start-up marks there (``slime.utils.startup``),
    after this one's ``launch`` mark."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {shlex.join(command)}  (log: {log})", flush=True)
    if startup_log is not None:
        startup_log.unlink(missing_ok=True)
        env = {**(env or os.environ), STARTUP_LOG_ENV: str(startup_log)}
        startup_log.write_text(json.dumps({"t": time.time(), "pid": os.getpid(), "what": "launch"}) + "\n")
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        with TreeSampler(proc.pid) as tree:
            try:
                code = proc.wait(timeout=PHASE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
        wall = time.perf_counter() - start
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{command[1]} failed (exit {code}), last lines of {log}:\n{tail}")
    return {
        "wall_s": wall,
        "peak_memory_gib": tree.peak_rss / 2**30,
        "peak_memory_pss_gib": tree.peak_pss / 2**30,
        "num_processes": tree.max_processes,
        "memory_at_peak_mib": tree.at_peak,
        "memory_at_peak_pss_mib": tree.at_peak_pss,
    }


def startup_timeline(path: Path) -> dict[str, float]:
    """Seconds from launch to each start-up mark in ``path``: the first process to reach it (the
    last, for the trainer ranks' marks: the trainer is ready when its last rank is), in time order."""
    marks = read_marks(path)
    launch = next(m["t"] for m in marks if m["what"] == "launch")
    reached: dict[str, float] = {}
    for m in marks:
        if m["what"] not in reached or m["what"].startswith("trainer:"):
            reached[m["what"]] = round(m["t"] - launch, 3)
    reached.pop("launch")
    return dict(sorted(reached.items(), key=lambda kv: kv[1]))


def setup(work: Path, seed: int, python: str) -> Path:
    """run.sh phases 0 and 1: the tiny model, the data and the SFT warm start; returns the SFT dir."""
    marker = work / "setup.json"
    sft = work / "sft"
    record = {"seed": seed, "commit": git_commit()}
    if (
        marker.is_file()
        and json.loads(marker.read_text()).get("seed") == seed
        and (sft / "config.json").is_file()
    ):
        print(f"reusing the set-up in {work} (seed {seed})", flush=True)
        return sft
    marker.unlink(missing_ok=True)
    shutil.rmtree(sft, ignore_errors=True)
    run_logged([python, "tools/make_tiny_model.py", "--out", str(work / "base"), "--seed", str(seed)],
               work / "logs/make_tiny_model.log")  # fmt: skip
    run_logged([python, "examples/quickstart/make_data.py", "--out", str(work / "data"), "--seed", str(seed)],
               work / "logs/make_data.log")  # fmt: skip
    flags = [
        *model_args(), *common_args(seed),
        "--hf-checkpoint", str(work / "base"),
        "--prompt-data", str(work / "data/sft.jsonl"), "--label-key", "response",
        "--loss-type", "sft_loss", "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--rollout-batch-size", "64", "--micro-batch-size", "64", "--num-rollout", "75",
        "--lr", "1e-3",
        "--save-hf", str(sft), "--tb-dir", str(work / "tb/sft"),
    ]  # fmt: skip
    shutil.rmtree(work / "tb/sft", ignore_errors=True)
    run_logged([python, "train.py", *flags], work / "logs/sft.log")
    marker.write_text(json.dumps(record) + "\n")
    return sft


def median_tail(values: list[float]) -> float:
    """Median over steps 1.. (all of them when there is only one)."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def mean_or_none(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def run_ours(
    work: Path,
    sft: Path,
    opts: argparse.Namespace,
    python: str,
    extra: tuple[str, ...] = (),
    model_flags: list[str] | None = None,
    max_response_len: int = MAX_RESPONSE_LEN,
    save_hf: bool = True,
) -> dict[str, Any]:
    """run.sh's GRPO phase, same flags (and ``extra``), without evaluation and Megatron checkpoints.
    ``model_flags`` replaces the tiny model's MODEL_ARGS (for another ``sft`` checkpoint),
    ``max_response_len`` the 8-token limit; ``save_hf=False`` skips the final HF export."""
    tb, final = work / "tb/grpo", work / "ours_final"
    shutil.rmtree(tb, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    seed = opts.seed
    flags = [
        *(model_args() if model_flags is None else model_flags), *common_args(seed),
        "--hf-checkpoint", str(sft),
        "--prompt-data", str(work / "data/train.jsonl"), "--label-key", "label", "--rm-type", "exact",
        "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", str(TRAINER_RANKS),
        "--rollout-batch-size", str(PROMPTS_PER_STEP), "--n-samples-per-prompt", str(SAMPLES_PER_PROMPT),
        "--num-rollout", str(opts.num_steps), "--micro-batch-size", str(MICRO_BATCH_SIZE),
        "--use-rollout-logprobs",
        "--rollout-temperature", "1.0", "--rollout-max-response-len", str(max_response_len),
        "--rollout-skip-special-tokens",
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--share-prompts-in-train",
        "--lr", "1e-4", "--lr-warmup-iters", str(LR_WARMUP_STEPS),
        *(["--save-hf", str(final)] if save_hf else []), "--tb-dir", str(tb), *extra,
    ]  # fmt: skip
    if opts.num_steps <= LR_WARMUP_STEPS:
        # Megatron's scheduler asserts warm-up < decay steps (default: all steps); with a constant lr the
        # decay length changes nothing else.
        flags += ["--lr-decay-iters", str(LR_WARMUP_STEPS + 1)]
    log = work / "logs/ours.log"
    proc = run_logged([python, ENTRY_POINT, *flags], log, startup_log=work / "logs/ours_startup.jsonl")
    startup = startup_timeline(work / "logs/ours_startup.jsonl")
    found = PEAK_LINE.findall(log.read_text(errors="replace"))
    scalars = read_scalars(tb)
    steps = scalars["perf/step_time"]
    rewards = scalars["rollout/raw_reward"]
    if len(steps) != opts.num_steps or (save_hf and not (final / "config.json").is_file()):
        raise RuntimeError(f"ours logged {len(steps)} of {opts.num_steps} steps or wrote no {final}")
    return {
        **proc,
        "first_request_s": startup.get(FIRST_REQUEST),
        "startup_s": startup,
        "peak_memory_reported_gib": float(found[-1]) if found else None,
        "loop_s": sum(steps),
        "step_median_s": median_tail(steps),
        "rollout_median_s": median_tail(scalars["perf/rollout_time"]),
        "train_median_s": median_tail(scalars["perf/train_time"]),
        "sync_median_s": median_tail(scalars["perf/update_weights_time"]),
        "samples_per_s": SAMPLES_PER_STEP / median_tail(steps),
        "samples_per_s_wall": opts.num_steps * SAMPLES_PER_STEP / proc["wall_s"],
        "reward_first5": mean_or_none(rewards[:5]),
        "reward_last5": mean_or_none(rewards[-5:]),
        "step_times_s": steps,
        "rollout_times_s": scalars["perf/rollout_time"],
        "train_times_s": scalars["perf/train_time"],
        "update_weights_times_s": scalars["perf/update_weights_time"],
        "rewards": rewards,
        "losses": scalars.get("train/loss") or scalars.get("train/pg_loss"),
        # Logged after the scheduler's step: the lr of the next step (step 0 runs at lr 0).
        "lr_after_step": scalars.get("train/lr"),
        "command": shlex.join([ENTRY_POINT, *flags]),
        "log": str(log),
        "final_checkpoint": str(final) if save_hf else None,
    }


def ensure_trl_venv(venv: Path) -> Path:
    """``venv``'s python, making the venv first when it is missing."""
    python = venv / "bin/python"
    if python.exists():
        return python
    transformers_version = importlib.metadata.version("transformers")
    print(f"making the TRL venv in {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin/pip"), "install", "--quiet"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run(
        [*pip, "-c", str(REPO / "constraints.txt"), f"trl=={TRL_VERSION}",
         f"transformers=={transformers_version}", "accelerate", "datasets"],
        check=True,
    )  # fmt: skip
    return python


def run_trl(
    work: Path,
    sft: Path,
    opts: argparse.Namespace,
    trl_python: Path,
    max_completion_length: int = MAX_RESPONSE_LEN,
    save_final: bool = True,
) -> dict[str, Any]:
    """``bench/peer_trl_trainer.py`` from ``sft``; ``max_completion_length`` replaces the 8-token limit,
    ``save_final=False`` skips the final checkpoint."""
    out_dir, result_file = work / "trl", work / "trl/result.json"
    shutil.rmtree(out_dir, ignore_errors=True)
    command = [
        str(trl_python), "bench/peer_trl_trainer.py",
        "--model", str(sft), "--train-data", str(work / "data/train.jsonl"),
        "--output-dir", str(out_dir), "--num-steps", str(opts.num_steps), "--seed", str(opts.seed),
        "--result", str(result_file),
    ]  # fmt: skip
    if max_completion_length != MAX_RESPONSE_LEN:
        command += ["--max-completion-length", str(max_completion_length)]
    if not save_final:
        command.append("--no-save")
    # The checkpoint is local: nothing may reach for the hub.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = run_logged(command, work / "logs/trl.log", env)
    result = json.loads(result_file.read_text())
    if result["versions"]["trl"] != TRL_VERSION:
        print(f"warning: {trl_python} has trl {result['versions']['trl']}, not {TRL_VERSION}", flush=True)
    steps, generation = result["step_times_s"], result["generation_times_s"]
    rewards = result["rewards"]
    if len(steps) != opts.num_steps or len(rewards) != opts.num_steps:
        raise RuntimeError(
            f"TRL recorded {len(steps)} step times and {len(rewards)} rewards for {opts.num_steps}"
        )
    rest = [s - g for s, g in zip(steps, generation, strict=True)]
    return {
        **proc,
        "step_median_s": median_tail(steps),
        "generation_median_s": median_tail(generation),
        "rest_median_s": median_tail(rest),
        "samples_per_s": SAMPLES_PER_STEP / median_tail(steps),
        "samples_per_s_wall": opts.num_steps * SAMPLES_PER_STEP / proc["wall_s"],
        "reward_first5": mean_or_none(rewards[:5]),
        "reward_last5": mean_or_none(rewards[-5:]),
        "loop_s": result["train_s"],
        "setup_s": result["setup_s"],
        "torch_threads": result["torch_threads"],
        "prompt_ids_match_slime": result["prompt_ids_match_slime"],
        "tokenizer_class": result["tokenizer_class"],
        "eos_token_ids": result["eos_token_ids"],
        "step_times_s": steps,
        "generation_times_s": generation,
        "rewards": rewards,
        "losses": result["losses"],
        "grad_norms": result["grad_norms"],
        "lr_of_step": result["lr_of_step"],
        "mean_completion_lengths": result["mean_completion_lengths"],
        "clipped_ratios": result["clipped_ratios"],
        "config": result["config"],
        "versions": result["versions"],
        "command": shlex.join(command[1:]),
        "log": str(work / "logs/trl.log"),
        "final_checkpoint": result["final_checkpoint"],
    }


def evaluate(
    checkpoint: Path, rows: list[dict], seed: int, reference_tokenizer: Any = None
) -> dict[str, Any]:
    """Mean exact-match reward of ``checkpoint`` on ``rows``: sampled (temperature 1, no top-k/top-p,
    EVAL_SAMPLES_PER_PROMPT per prompt, torch seeded with ``seed``) and greedy; at most
    MAX_RESPONSE_LEN new tokens, stopping at EOS, text decoded with special tokens skipped."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from slime.rollout.rewards.text import exact_score

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    prompts = [row["prompt"] for row in rows]
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    same_ids = (
        reference_tokenizer is None
        or ids == reference_tokenizer(prompts, add_special_tokens=False)["input_ids"]
    )

    def score(sample: bool, per_prompt: int) -> float:
        config = GenerationConfig(
            max_new_tokens=MAX_RESPONSE_LEN, do_sample=sample, num_return_sequences=per_prompt,
            temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,
            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        )  # fmt: skip
        torch.manual_seed(seed)
        total, batch = 0.0, 64
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            inputs = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True,
                               add_special_tokens=False)  # fmt: skip
            with torch.no_grad():
                out = model.generate(**inputs, generation_config=config)
            texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            labels = [r["label"] for r in chunk for _ in range(per_prompt)]
            total += sum(exact_score(text, label) for text, label in zip(texts, labels, strict=True))
        return total / (len(rows) * per_prompt)

    result = {
        "sampled": score(True, EVAL_SAMPLES_PER_PROMPT),
        "greedy": score(False, 1),
        "tokenizer_matches_sft": bool(same_ids),
    }
    print(f"eval {checkpoint}: sampled {result['sampled']:.3f}, greedy {result['greedy']:.3f}", flush=True)
    return result


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD")
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def versions() -> dict[str, str | None]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    names = ("torch", "transformers", "megatron-core", "ray", "sglang-router", "tensorboard")
    return {
        "python": platform.python_version(),
        **{name: version(name) for name in names},
        "slime": git_commit(),
    }


def table(result: dict[str, Any]) -> str:
    ours, trl = result["ours"], result["trl"]
    rows = [
        ("process wall (s)", "wall_s", "{:.1f}"),
        ("median step (s)", "step_median_s", "{:.3f}"),
        ("samples/s (128 / median step)", "samples_per_s", "{:.1f}"),
        ("samples/s (steps x 128 / wall)", "samples_per_s_wall", "{:.1f}"),
        ("peak RSS, process tree (GiB)", "peak_memory_gib", "{:.2f}"),
        ("peak PSS, process tree (GiB)", "peak_memory_pss_gib", "{:.2f}"),
        ("processes", "num_processes", "{}"),
        ("train reward, first 5 steps", "reward_first5", "{:.3f}"),
        ("train reward, last 5 steps", "reward_last5", "{:.3f}"),
    ]
    lines = [f"{'':34} {'slime':>10} {'TRL':>10}"]
    for name, key, fmt in rows:
        lines.append(f"{name:34} {fmt.format(ours[key]):>10} {fmt.format(trl[key]):>10}")
    for kind in ("sampled", "greedy"):
        before = result["eval_before"][kind]
        lines.append(
            f"{'eval ' + kind + f' (SFT {before:.3f})':34} "
            f"{ours['eval_after'][kind]:>10.3f} {trl['eval_after'][kind]:>10.3f}"
        )
    lines.append(
        f"ours split: rollout {ours['rollout_median_s']:.3f} s, train {ours['train_median_s']:.3f} s, "
        f"sync {ours['sync_median_s']:.3f} s; TRL split: generation {trl['generation_median_s']:.3f} s, "
        f"rest {trl['rest_median_s']:.3f} s"
    )
    lines.append(
        f"start-up: ours' first /generate {ours['first_request_s']:.2f} s after launch; "
        f"TRL starts training {trl['setup_s']:.2f} s after launch (its imports included)"
    )
    ratio = result["ratio"]
    lines.append(
        f"ratio ours/TRL: samples/s {ratio['samples_per_s']:.2f}x, "
        f"wall samples/s {ratio['samples_per_s_wall']:.2f}x"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-steps", type=int, default=200, help="optimizer steps (= rollouts) of each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=REPO / "outputs/peer_trl")
    parser.add_argument("--trl-venv", type=Path, default=REPO / ".venv-peer-trl")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/peer_trl.json")
    opts = parser.parse_args()
    if opts.num_steps < 1:
        parser.error("--num-steps must be at least 1")
    work = opts.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    python = sys.executable

    trl_python = ensure_trl_venv(opts.trl_venv.resolve())
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    sft = setup(work, opts.seed, python)
    ours = run_ours(work, sft, opts, python)
    trl = run_trl(work, sft, opts, trl_python)
    load_after = os.getloadavg()

    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in (work / "data/eval.jsonl").read_text().splitlines() if line.strip()]
    reference = AutoTokenizer.from_pretrained(sft)
    eval_before = evaluate(sft, rows, opts.seed)
    ours["eval_after"] = evaluate(Path(ours["final_checkpoint"]), rows, opts.seed, reference)
    trl["eval_after"] = evaluate(Path(trl["final_checkpoint"]), rows, opts.seed, reference)

    result = {
        "benchmark": "slime train_async.py vs trl.GRPOTrainer on the CPU quickstart "
        "(same SFT start, data, recipe)",
        "date": started.isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model(),
            "memory_gib": psutil.virtual_memory().total / 2**30,
            "load_avg_1m_before": load_before[0],
            "load_avg_1m_after": load_after[0],
        },
        "versions": {**versions(), "trl_venv": trl["versions"]},
        "settings": {
            "num_steps": opts.num_steps,
            "seed": opts.seed,
            "model": "tiny qwen2 (tools/make_tiny_model.py, scripts/models/tiny-qwen2.sh)",
            "task": "examples/quickstart/make_data.py: sort 4-6 digits, exact-match reward",
            "sft": "run.sh phase 1: 75 steps of 64 pairs, lr 1e-3",
            "prompts_per_step": PROMPTS_PER_STEP,
            "samples_per_prompt": SAMPLES_PER_PROMPT,
            "samples_per_step": SAMPLES_PER_STEP,
            "micro_batch_size": 32,
            "optimizer_steps_per_rollout": 1,
            "max_response_len": MAX_RESPONSE_LEN,
            "temperature": 1.0,
            "top_k": "off",
            "top_p": 1.0,
            "lr": 1e-4,
            "lr_warmup_steps": LR_WARMUP_STEPS,
            "adam_beta2": 0.98,
            "weight_decay": 0.0,
            "clip_grad": 1.0,
            "eps_clip": 0.2,
            "kl": 0.0,
            "loss_aggregation": "token mean over the step's 128 samples",
            "eval": {
                "prompts": len(rows),
                "sampled_per_prompt": EVAL_SAMPLES_PER_PROMPT,
                "temperature": 1.0,
                "seed": opts.seed,
                "max_new_tokens": MAX_RESPONSE_LEN,
            },
            "work_dir": str(work),
            "trl_venv": str(opts.trl_venv),
        },
        "ours": ours,
        "trl": trl,
        "eval_before": eval_before,
        "ratio": {
            "samples_per_s": ours["samples_per_s"] / trl["samples_per_s"],
            "samples_per_s_wall": ours["samples_per_s_wall"] / trl["samples_per_s_wall"],
        },
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
