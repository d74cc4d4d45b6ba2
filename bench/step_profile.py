"""Where one quickstart GRPO step spends its time, on the CPU, split so that later changes can be compared.

Two views of the same step (16 prompts x 8 samples, 8 new tokens, one optimizer step over one
micro-batch of 128):

1. **The whole stack** (``stack``): the quickstart's GRPO ``train_async.py`` command for
   ``--num-rollout`` rollouts (``bench/peer_trl.py``'s flags and set-up: tiny model, data, SFT warm
   start), its ``perf/*`` metrics read back from TensorBoard, medians over rollouts 2..:

   - ``generation``: the rollout function (prompts over HTTP through sglang-router to the engine, the
     engine's continuous batching, the replies, the reward), beside the previous step's training;
   - ``rollout_transfer``: the rest of the driver's ``rollout.generate`` call: the samples turned into
     train data and that object sent from the rollout manager to the driver through Ray (beside
     training too);
   - ``rollout_wait``: how long the step waited for its rollout (``perf/rollout_wait_time``): 0 when
     generation finished during the previous step's training;
   - ``train_log_probs``: the old (and reference) log-prob pass and the advantages;
   - ``train_forward_backward``: Megatron's schedule (forward, loss, backward);
   - ``train_optimizer``: the optimizer step (and the gradient norm);
   - ``train_transfer``: the rest of the trainer call: the train data put into and fetched from the
     object store, the metrics reduced and sent back;
   - ``weight_push``: the weights to the engine (``perf/update_weights_time``);
   - ``loop_other``: the rest of the step (the loop's bookkeeping, logging).

   The same run's **start-up** (``startup_s``): seconds from launch to each milestone its processes
   mark (``slime.utils.startup``), with ``first_request_s`` the first ``/generate``; and its
   **memory** at the peaks of summed RSS and PSS, per kind of process (``memory_at_peak_mib``,
   ``memory_at_peak_pss_mib``).

2. **Each part alone** (``parts``), with the real parts started here, median of ``--repeats``:

   - ``engine_direct`` / ``engine_via_router``: the step's 128 samples (the same prompts, temperature
     1, ``return_logprob``) as the rollout sends them, one batched request per prompt group, from
     one pooled aiohttp client straight to a torch engine, and through a sglang-router in front of
     it; their difference is what HTTP through the router costs; ``engine_direct_per_sample``: the
     same 128 samples as one request each (``--rollout-seed-per-sample``);
   - ``reward``: the exact-match reward of 128 samples (``compute_reward``);
   - ``old_log_prob_pass``: the trainer's separate no-grad forward over the rollout (on a rollout
     dumped by a second, 2-rollout run; the pass is skipped where it cannot differ, see
     ``old_log_probs_are_current``);
   - ``forward_backward`` / ``optimizer``: one train step of the Megatron trainer in this process
     (one rank, one micro-batch of 128, as in the stack);
   - ``packed_attention`` / ``packed_attention_per_sequence``: the core attention of one packed
     micro-batch (forward and backward), as run now (one right-padded batch through torch's fused
     attention) and as one local-attention call per sequence (how it ran first); their ratio is
     what the two changes gained.

    .venv/bin/python bench/step_profile.py                  # 30 rollouts, seed 0
    .venv/bin/python bench/step_profile.py --num-rollout 15 --repeats 5

Writes bench/results/step_profile.json (``--out``). The set-up is shared with ``bench/peer_trl.py``
(``--work-dir``, default ``outputs/peer_trl``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import peer_trl  # noqa: E402

STACK_PARTS = {
    "generation": "perf/generation_time",
    "train_log_probs": "perf/train_log_probs_time",
    "train_forward_backward": "perf/train_forward_backward_time",
    "train_optimizer": "perf/train_optimizer_time",
    "weight_push": "perf/update_weights_time",
}


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[2:] if len(values) > 3 else values)


def rollout_dump(work: Path, sft: Path, python: str) -> Path:
    """Rollout 1's train data of a 2-rollout quickstart run (dumped with ``--save-debug-rollout-data``,
    which writes every rollout: so not in the timed run, where it would count as loop time)."""
    dump = work / "profile_rollout_{rollout_id}.pt"
    options = argparse.Namespace(seed=0, num_steps=2)
    peer_trl.run_ours(work, sft, options, python, ("--save-debug-rollout-data", str(dump)))
    return Path(str(dump).format(rollout_id=1))


def stack_split(work: Path, sft: Path, num_rollout: int, python: str) -> dict[str, Any]:
    """The quickstart GRPO phase for ``num_rollout`` rollouts; the median split of a step."""
    options = argparse.Namespace(seed=0, num_steps=num_rollout)
    result = peer_trl.run_ours(work, sft, options, python)
    scalars = peer_trl.read_scalars(work / "tb/grpo")
    split = {name: median_after_warmup(scalars[tag]) for name, tag in STACK_PARTS.items()}
    step = median_after_warmup(scalars["perf/step_time"])
    rollout = median_after_warmup(scalars["perf/rollout_time"])
    train = median_after_warmup(scalars["perf/train_time"])
    split["rollout_transfer"] = rollout - split["generation"]
    trainer_parts = ("train_log_probs", "train_forward_backward", "train_optimizer")
    split["train_transfer"] = train - sum(split[p] for p in trainer_parts)
    # The overlapped loop generates beside training: the step waits only for what is not done yet.
    waited = median_after_warmup(scalars["perf/rollout_wait_time"])
    split["rollout_wait"] = waited
    split["loop_other"] = step - waited - train - split["weight_push"]
    beside = ("generation", "rollout_transfer")
    summary = {
        "step_s": step,
        "split_s": split,
        "beside_training": list(beside),
        "samples_per_s": peer_trl.SAMPLES_PER_STEP / step,
        "wall_s": result["wall_s"],
        "peak_memory_gib": result["peak_memory_gib"],
        "memory_at_peak_mib": result["memory_at_peak_mib"],
        "peak_memory_pss_gib": result["peak_memory_pss_gib"],
        "memory_at_peak_pss_mib": result["memory_at_peak_pss_mib"],
        "first_request_s": result["first_request_s"],
        "startup_s": result["startup_s"],
        "reward_first5": result["reward_first5"],
        "reward_last5": result["reward_last5"],
        "ppo_kl_max": max(abs(v) for v in scalars["train/ppo_kl"]),
    }
    return summary


def step_groups(work: Path, sft: Path) -> list[list[list[int]]]:
    """The first 16 training prompts' groups of 8, tokenized as the rollout tokenizes them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft)
    lines = (work / "data/train.jsonl").read_text().splitlines()[: peer_trl.PROMPTS_PER_STEP]
    prompts = [tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"] for line in lines]
    return [[prompt] * peer_trl.SAMPLES_PER_PROMPT for prompt in prompts]


def time_waves(url: str, groups: list[list[list[int]]], repeats: int, per_sample: bool = False) -> float:
    """Median seconds for all ``groups`` sent at once, as the rollout sends them: one batched request
    per group, or (``per_sample``) one request per sample."""
    import aiohttp

    params = {"max_new_tokens": peer_trl.MAX_RESPONSE_LEN, "temperature": 1.0, "skip_special_tokens": True}
    inputs = [[ids] for group in groups for ids in group] if per_sample else groups

    async def waves() -> list[float]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(batch: list[list[int]]) -> None:
                ids = batch[0] if len(batch) == 1 else batch
                body = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
                async with session.post(f"{url}/generate", json=body) as reply:
                    reply.raise_for_status()
                    await reply.json()

            times = []
            for _ in range(repeats + 1):  # the first wave warms up
                start = time.perf_counter()
                await asyncio.gather(*(one(batch) for batch in inputs))
                times.append(time.perf_counter() - start)
            return times[1:]

    return statistics.median(asyncio.run(waves()))


def engine_parts(work: Path, sft: Path, repeats: int) -> dict[str, float]:
    from slime.backends.engine_server import start_engine_server
    from slime.backends.torch_engine.launcher import serving
    from slime.rollout.router import Router
    from slime.utils.hardware import engine_env

    groups = step_groups(work, sft)
    logs = work / "logs"
    flags = ["--log-level", "warning", "--random-seed", "0"]
    env = engine_env(engines_per_node=1)  # the engine's threads in a run
    engine = start_engine_server(
        "torch engine", serving(sft, *flags), logs / "profile_engine.log", timeout_s=300, env=env
    )
    router = Router(logs)
    try:
        direct = time_waves(engine.url, groups, repeats)
        per_sample = time_waves(engine.url, groups, repeats, per_sample=True)
        router_url = router.start()
        router.add_worker(engine.url)
        via_router = time_waves(router_url, groups, repeats)
    finally:
        router.shutdown()
        engine.stop()
    return {
        "engine_direct": direct,
        "engine_direct_per_sample": per_sample,
        "engine_via_router": via_router,
        "http_router": via_router - direct,
    }


def reward_part(work: Path, sft: Path, repeats: int) -> float:
    from slime.config import parse_args
    from slime.rollout.rewards.scoring import compute_reward
    from slime.rollout.sample import Sample

    data = str(work / "data/train.jsonl")
    flags = ["--rm-type", "exact", "--debug-rollout-only", "--prompt-data", data, "--hf-checkpoint", str(sft)]
    args = parse_args(
        [
            *peer_trl.model_args(),
            *flags,
            "--rollout-num-gpus",
            "1",
            "--rollout-batch-size",
            "16",
            "--num-rollout",
            "1",
        ]
    )
    rows = [json.loads(line) for line in (work / "data/train.jsonl").read_text().splitlines()[:128]]
    samples = [Sample(prompt=r["prompt"], label=r["label"], response=r["label"][::-1]) for r in rows]

    async def score() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(compute_reward(args, s) for s in samples))
        return time.perf_counter() - start

    return statistics.median(asyncio.run(score()) for _ in range(repeats))


def trainer_parts(work: Path, sft: Path, dump: Path, repeats: int) -> dict[str, float]:
    """The trainer's passes in this process (gloo, world size 1), on a real rollout's train data."""
    import torch

    from slime.backends.megatron.batching import consecutive_groups, make_micro_batches
    from slime.backends.megatron.policy_inputs import DataParallel, PolicyInputs
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.config import parse_args
    from slime.config.settings.trainer import TrainerSettings
    from slime.utils.hardware import worker_env
    from slime.utils.http import free_port

    torch.set_num_threads(int(worker_env(processes_per_node=1).get("OMP_NUM_THREADS", "0")) or None)
    flags = [
        *peer_trl.model_args(), *peer_trl.common_args(0), "--hf-checkpoint", str(sft),
        "--prompt-data", str(work / "data/train.jsonl"), "--rollout-num-gpus", "1",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
        "--micro-batch-size", str(peer_trl.MICRO_BATCH_SIZE), "--num-rollout", "200",
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--lr", "1e-4", "--share-prompts-in-train",
    ]  # fmt: skip
    args = parse_args(flags)
    settings = TrainerSettings.from_args(args)
    trainer = MegatronTrainer(settings, args, 0, 1, "127.0.0.1", free_port())
    data = torch.load(dump, weights_only=False)
    data.pop("metrics", None)
    inputs = PolicyInputs(settings, DataParallel.single(), args)
    shard = inputs.shards(data)[0]
    old_pass, forward_backward, optimizer = [], [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        trainer.compute_log_probs(shard)
        old_pass.append(time.perf_counter() - start)
        metrics = trainer.train_step(shard)
        forward_backward.append(metrics["perf/train_forward_backward_time"])
        optimizer.append(metrics["perf/train_optimizer_time"])
    batch = make_micro_batches(
        shard, consecutive_groups(len(shard["tokens"]), 32), trainer.device, packed=True
    )[0]
    batched, per_sequence = attention_times(trainer, batch, repeats)
    return {
        "old_log_prob_pass": statistics.median(old_pass[1:]),
        "forward_backward": statistics.median(forward_backward[1:]),
        "optimizer": statistics.median(optimizer[1:]),
        "packed_attention": batched,
        "packed_attention_per_sequence": per_sequence,
        "packed_attention_speedup": per_sequence / batched,
        "threads": torch.get_num_threads(),
    }


def attention_times(trainer: Any, batch: Any, repeats: int) -> tuple[float, float]:
    """Forward + backward seconds of the first layer's core attention on one packed micro-batch: as it
    runs (``PackedDotProductAttention``), and one local-attention call per sequence."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from slime.backends.megatron.packed_attention import packed_seq_params

    attention = next(m for m in trainer.model[0].modules() if type(m).__name__ == "PackedDotProductAttention")
    heads, groups = attention.num_attention_heads_per_partition, attention.num_query_groups_per_partition
    dim, total = attention.hidden_size_per_attention_head, batch.tokens.shape[1]
    params = packed_seq_params(batch)
    lengths = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, n, dim, generator=gen) for n in (heads, groups, groups))

    def batched(q, k, v):
        return attention(q, k, v, None, packed_seq_params=params)

    def per_sequence(q, k, v):
        parts = zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        run = DotProductAttention.forward
        return torch.cat(
            [run(attention, a.unsqueeze(1), b.unsqueeze(1), c.unsqueeze(1), None) for a, b, c in parts]
        )

    def timed(fn) -> float:
        times = []
        for _ in range(repeats + 1):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            start = time.perf_counter()
            fn(*leaves).sum().backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    reference = per_sequence(q, k, v)
    torch.testing.assert_close(batched(q, k, v), reference)  # the same attention, only faster
    return timed(batched), timed(per_sequence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--num-rollout", type=int, default=30, help="rollouts of the stack run (median over 2..)"
    )
    parser.add_argument("--repeats", type=int, default=10, help="repeats of each part probe (median)")
    parser.add_argument("--work-dir", default=str(REPO / "outputs/peer_trl"))
    parser.add_argument("--out", default=str(REPO / "bench/results/step_profile.json"))
    opts = parser.parse_args()
    if opts.num_rollout <= peer_trl.LR_WARMUP_STEPS:
        parser.error(f"--num-rollout: use more than {peer_trl.LR_WARMUP_STEPS} (the warm-up) rollouts")
    work, python = Path(opts.work_dir), sys.executable
    sft = peer_trl.setup(work, 0, python)
    stack = stack_split(work, sft, opts.num_rollout, python)
    dump = rollout_dump(work, sft, python)
    parts = {**engine_parts(work, sft, opts.repeats), "reward": reward_part(work, sft, opts.repeats)}
    parts.update(trainer_parts(work, sft, dump, opts.repeats))
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": peer_trl.cpu_model()},
        "date": date.today().isoformat(),
        "commit": peer_trl.git_commit(),
        "num_rollout": opts.num_rollout,
        "stack": stack,
        "parts_s": parts,
    }
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nstart-up, seconds after launch (first /generate at {stack['first_request_s']:.2f} s):")
    for what, seconds in stack["startup_s"].items():
        print(f"  {seconds:6.2f}  {what}")
    print(
        f"memory at the peaks ({stack['peak_memory_gib']:.2f} GiB RSS, "
        f"{stack['peak_memory_pss_gib']:.2f} GiB PSS), MiB per process kind:"
    )
    for kind, mib in stack["memory_at_peak_mib"].items():
        print(f"  {mib:7.1f}  {stack['memory_at_peak_pss_mib'].get(kind, 0.0):7.1f}  {kind}")
    print(f"\none quickstart step: {stack['step_s']:.3f} s ({stack['samples_per_s']:.0f} samples/s)")
    for name, seconds in stack["split_s"].items():
        beside = " (beside training)" if name in stack["beside_training"] else ""
        print(f"  {name:24s} {seconds * 1e3:8.1f} ms  {seconds / stack['step_s']:6.1%}{beside}")
    print("each part alone:")
    for name, value in parts.items():
        print(
            f"  {name:32s} {value * 1e3:8.1f} ms"
            if name not in ("threads", "packed_attention_speedup")
            else f"  {name:32s} {value:8.2f}"
        )
    print(f"wrote {out}")
    shutil.rmtree(work / "ours_final", ignore_errors=True)


if __name__ == "__main__":
    main()
