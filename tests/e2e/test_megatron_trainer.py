"""The Megatron trainer group on CPU: conversion, log-prob parity with transformers, SFT, DP, checkpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slime.config import parse_args
from tests.support.trainers import (
    hf_logprobs,
    make_group,
    sft_data,
    trainer_args,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def qwen2_group(ray_cluster, tiny_models):
    from ray.util.placement_group import remove_placement_group

    group, loaded, pg = make_group(trainer_args(tiny_models["qwen2"]))
    assert loaded is None
    yield group
    group.shutdown()
    remove_placement_group(pg)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_other_architectures_convert_losslessly_and_match_transformers(ray_cluster, tiny_models, arch):
    from ray.util.placement_group import remove_placement_group

    group, _, pg = make_group(trainer_args(tiny_models[arch], arch=arch))
    try:
        exported = group.hf_state_dict()
        original = load_file(tiny_models[arch] / "model.safetensors")
        assert sorted(exported) == sorted(original)
        assert all(torch.equal(exported[name], original[name]) for name in original)
        data = sft_data(4)
        data["response_lengths"] = [len(t) - 1 for t in data["tokens"]]
        data["loss_masks"] = [[1] * n for n in data["response_lengths"]]
        ours = group.compute_log_probs(data)
        for a, b in zip(ours, hf_logprobs(tiny_models[arch], data), strict=True):
            assert (a - b).abs().max().item() <= 1e-4
    finally:
        group.shutdown()
        remove_placement_group(pg)


def test_hf_to_megatron_to_hf_is_bit_exact(qwen2_group, tiny_models):
    exported = qwen2_group.hf_state_dict()
    original = load_file(tiny_models["qwen2"] / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def _log_probs_at(temperature, group, model, data):
    """``group``'s log-probs of ``data`` (an SFT group: temperature 1), or at another ``temperature``
    a group of its own built with it (the trainer's temperature is a setting, fixed when it is built)."""
    from ray.util.placement_group import remove_placement_group

    if temperature == 1.0:
        return group.compute_log_probs(data)
    other, _, pg = make_group(trainer_args(model), temperature=temperature)
    try:
        return other.compute_log_probs(data)
    finally:
        other.shutdown()
        remove_placement_group(pg)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_transformers_on_every_position(qwen2_group, tiny_models, temperature):
    data = sft_data(6)
    data["response_lengths"] = [len(t) - 1 for t in data["tokens"]]
    data["loss_masks"] = [[1] * n for n in data["response_lengths"]]
    ours = _log_probs_at(temperature, qwen2_group, tiny_models["qwen2"], data)
    theirs = hf_logprobs(tiny_models["qwen2"], data, temperature)
    assert len(ours) == 6
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-4


def run_sft(group, steps):
    metrics = []
    for _ in range(steps):
        metrics.extend(group.train(sft_data(8)))
    return metrics


def test_sft_steps_lower_the_loss_and_dp2_matches_dp1(qwen2_group, tiny_models, ray_cluster, tmp_path):
    from ray.util.placement_group import remove_placement_group

    single = run_sft(qwen2_group, 3)
    assert single[-1]["loss"] < 0.9 * single[0]["loss"]
    assert all(m["grad_norm"] > 0 and m["lr"] == pytest.approx(1e-3) for m in single)

    single_trained = qwen2_group.hf_state_dict()
    # DP 2 with the distributed optimizer's all-gather left to the next forward (--overlap-param-gather):
    # what is saved and exported right after the step must be the gathered weights, not a mix of this
    # rank's new shard and the other rank's old one (before, they were: ~lr off in half the elements).
    overlap = ["--save", str(tmp_path), "--overlap-param-gather"]
    group, _, pg = make_group(trainer_args(tiny_models["qwen2"], world=2, extra=overlap))
    try:
        double = run_sft(group, 3)
        for a, b in zip(single, double, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert group.save(3).endswith("iter_0000003")
        trained = group.hf_state_dict()
        diff = max((trained[name] - tensor).abs().max().item() for name, tensor in single_trained.items())
        assert diff <= 2e-4, diff
    finally:
        group.shutdown()
        remove_placement_group(pg)

    resumed, loaded, pg = make_group(
        trainer_args(tiny_models["qwen2"], world=2, extra=["--load", str(tmp_path)])
    )
    try:
        assert loaded == 3
        restored = resumed.hf_state_dict()
        assert all(torch.equal(restored[name], trained[name]) for name in trained)
        # the optimizer state came back too: the next step equals the uninterrupted run's next step
        next_step = run_sft(resumed, 1)[0]
        continued = run_sft(qwen2_group, 1)[0]
        assert next_step["loss"] == pytest.approx(continued["loss"], rel=1e-5)
    finally:
        resumed.shutdown()
        remove_placement_group(pg)


def test_grpo_step_zero_is_on_policy(ray_cluster, tiny_models):
    """Step 0 of a rollout: ratio 1 (ppo_kl 0, no clipping), KL to the fresh reference 0, and the
    trainer's log-probs equal the ones the rollout reported."""
    from ray.util.placement_group import remove_placement_group

    data = sft_data(8)
    data["rewards"] = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    extra = [
        "--n-samples-per-prompt",
        "4",
        "--rollout-batch-size",
        "2",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.1",
    ]
    group, _, pg = make_group(trainer_args(tiny_models["qwen2"], extra=extra), loss_type="policy_loss")
    try:
        data["rollout_log_probs"] = group.compute_log_probs(data)  # what an engine with these weights reports
        first = group.train(data)[0]
        assert first["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
        assert first["pg_clipfrac"] == 0.0
        assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)
        assert first["train_rollout_logprob_abs_diff"] < 1e-5
        assert first["grad_norm"] > 0
        second = group.train(data)[0]
        assert abs(second["kl_loss"]) > 1e-4  # the policy moved away from the frozen reference
    finally:
        group.shutdown()
        remove_placement_group(pg)


def test_skipping_the_old_logprob_pass_trains_exactly_as_computing_it(ray_cluster, tiny_models):
    """One optimizer step per rollout, no KL, GRPO: the old log-probs are the training forward's own,
    so the step without the separate pass (the default) and with it (``--force-old-logprob-pass``)
    give the same loss, gradient norm and updated weights, at ratio 1 (``ppo_kl`` 0)."""
    from ray.util.placement_group import remove_placement_group

    data = sft_data(8)
    data["rewards"] = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    extra = ["--n-samples-per-prompt", "4", "--rollout-batch-size", "2"]
    results = []
    for force in ([], ["--force-old-logprob-pass"]):
        args = trainer_args(tiny_models["qwen2"], extra=[*extra, *force])
        group, _, pg = make_group(args, loss_type="policy_loss")
        try:
            results.append((group.train(data)[0], group.hf_state_dict()))
        finally:
            group.shutdown()
            remove_placement_group(pg)
    (skipped, weights_skipped), (computed, weights_computed) = results
    assert skipped["ppo_kl"] == 0.0 and computed["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert skipped["loss"] == pytest.approx(computed["loss"], rel=1e-5, abs=1e-7)
    assert skipped["grad_norm"] == pytest.approx(computed["grad_norm"], rel=1e-5) and skipped["grad_norm"] > 0
    for name, tensor in weights_computed.items():
        torch.testing.assert_close(weights_skipped[name], tensor, rtol=1e-5, atol=1e-6)


def _pin_mmap_threshold(actor) -> int:
    import ctypes
    import os

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    return os.getpid()


def test_hf_export_streams_buckets_to_rank_0_with_memory_bounded_by_the_bucket(ray_cluster, tmp_path):
    """A 120 MB model over two pipeline stages exported with 4 MB buckets: each rank's resident memory
    grows by a few buckets during --save-hf (5 to 31 MiB on 2-core machines; before: 630 and 176 MiB,
    as every rank copied its stage and rank 0 unpickled both at once), and the files load back
    tensor for tensor.

    A bucket is alive up to five times at once on rank 0 (received bytes, unpickled tensors, their
    contiguous copies, safetensors' serialised buffer, the next bucket's receive), and freed
    buckets stay in the allocator's arenas: the bound allows six buckets plus 16 MiB, still far
    below one pipeline stage (60 MiB)."""
    import threading

    import psutil
    import ray
    from ray.util.placement_group import remove_placement_group

    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", num_layers=8, hidden_size=512, intermediate_size=2048)
    args = parse_args(
        ["--hf-checkpoint", str(model), "--rollout-batch-size", "2", "--lr", "1e-3", "--num-rollout", "1",
         "--debug-train-only", "--loss-type", "sft_loss", "--micro-batch-size", "1",
         "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
         "--update-weight-buffer-size", str(4 * 1024**2)]
    )  # fmt: skip
    group, _, pg = make_group(args)
    try:
        pids = ray.get(
            [actor.__ray_call__.remote(lambda self: __import__("os").getpid()) for actor in group.actors]
        )
        processes = [psutil.Process(pid) for pid in pids]
        baseline = [p.memory_info().rss for p in processes]
        peaks, done = list(baseline), threading.Event()

        def sample() -> None:
            while not done.is_set():
                for i, process in enumerate(processes):
                    peaks[i] = max(peaks[i], process.memory_info().rss)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            written = Path(group.save_hf(str(tmp_path / "export")))
        finally:
            done.set()
            sampler.join()
        exported = {}
        for path in sorted(written.glob("model-*.safetensors")):
            exported.update(load_file(path))
    finally:
        group.shutdown()
        remove_placement_group(pg)
    original = load_file(model / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in original.values())
    growth = [peak - base for peak, base in zip(peaks, baseline, strict=True)]
    mib = [round(g / 2**20) for g in growth]
    print(f"model {model_bytes / 2**20:.0f} MiB; export growth per rank {mib} MiB")
    assert sorted(exported) == sorted(original) and all(
        torch.equal(exported[k], original[k]) for k in original
    )
    index = json.loads((written / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == model_bytes and len(set(index["weight_map"].values())) > 4
    largest = max(t.numel() * t.element_size() for t in original.values())
    assert model_bytes > 100 * 2**20 and max(growth) < 6 * max(largest, 4 * 2**20) + 16 * 2**20
