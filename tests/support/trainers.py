"""Megatron trainer groups on CPU: flags, SFT data, parallel layouts and parity with transformers."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from slime.config import parse_args
from slime.config.settings.trainer import TrainerSettings
from slime.config.settings.weight_sync import WeightSyncSettings
from tests.support.models import model_args

ARCH_FLAGS = {
    "qwen2": model_args("tiny-qwen2.sh"),
    "qwen3": [*model_args("tiny-qwen2.sh"), "--qk-layernorm"],
    "llama": [*model_args("tiny-qwen2.sh"), "--untie-embeddings-and-output-weights"],
    "glm4": model_args("tiny-glm4.sh"),
}
for flags in (ARCH_FLAGS["qwen3"], ARCH_FLAGS["llama"]):
    flags.remove("--add-qkv-bias")


def trainer_args(model_dir, arch="qwen2", world=1, extra=(), model_flags=None):
    """SFT trainer flags for ``world`` ranks; ``model_flags`` default to the tiny ``arch``'s."""
    return parse_args(
        [
            *(ARCH_FLAGS[arch] if model_flags is None else model_flags),
            "--hf-checkpoint", str(model_dir),
            "--debug-train-only",
            "--loss-type", "sft_loss",
            "--rollout-batch-size", "8",
            "--global-batch-size", "8",
            "--micro-batch-size", "2",
            "--actor-num-gpus-per-node", str(world),
            "--use-distributed-optimizer",
            "--lr", "1e-3",
            "--lr-decay-style", "constant",
            "--num-rollout", "4",
            "--seed", "7",
            *extra,
        ]
    )  # fmt: skip


def sft_data(num_samples=8, seed=0):
    """Sequences of varied length; the last few tokens of each are the response to learn."""
    gen = torch.Generator().manual_seed(seed)
    data = {"tokens": [], "response_lengths": [], "loss_masks": []}
    for i in range(num_samples):
        length, response = 10 + (i * 3) % 9, 3 + i % 4
        data["tokens"].append(torch.randint(3, 99, (length,), generator=gen).tolist())
        data["response_lengths"].append(response)
        data["loss_masks"].append([1] * (response - 1) + [i % 2])
    return data


def with_fields(settings: TrainerSettings, **changes) -> TrainerSettings:
    """``settings`` with fields changed by name, whichever part holds them (``loss_type``,
    ``num_steps_per_rollout``, ``tensor_model_parallel_size``, ``temperature`` ...)."""
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    for name, value in changes.items():
        owner = next(
            (key for key, part in fields.items() if dataclasses.is_dataclass(part) and hasattr(part, name)),
            None,
        )
        if owner is None:
            fields[name] = value
        else:
            fields[owner] = dataclasses.replace(fields[owner], **{name: value})
    return TrainerSettings(**fields)


def bare_settings(**changes) -> TrainerSettings:
    """The parser's defaults as trainer settings (no model, not validated), with ``changes``: for the
    loss and policy-input functions, which read a few fields."""
    from slime.config import build_parser

    return with_fields(TrainerSettings.from_args(build_parser().parse_args([])), **changes)


def make_group(args: argparse.Namespace, **changes):
    """A started trainer group of ``args`` (also its plugins' namespace) on one bundle per rank, with
    the trainer settings a test changes (``with_fields``, e.g. ``loss_type="policy_loss"``)."""
    from ray.util.placement_group import placement_group

    from slime.ray.trainer_group import TrainerGroup

    settings = with_fields(TrainerSettings.from_args(args), **changes)
    world = settings.parallel.world_size
    pg = placement_group([{"GPU": 1}] * world)
    group = TrainerGroup(settings, WeightSyncSettings.from_args(args), args, pg, list(range(world)))
    return group, group.init(), pg


def hf_logprobs(model_dir, data, temperature=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for tokens, response in zip(data["tokens"], data["response_lengths"], strict=True):
            logits = model(torch.tensor([tokens])).logits[0] / temperature
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
            out.append(logp[-response:])
    return out


def hf_logprob_diff(model_dir, data, ours) -> float:
    """The largest |log-prob| difference between ``ours`` (per sample) and transformers' on ``data``."""
    theirs = hf_logprobs(model_dir, data)
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


def assert_same_tensors(ours: dict, expected: dict) -> None:
    """``ours`` holds exactly the tensors of ``expected``, bit for bit (a converted checkpoint)."""
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


TP2 = ["--tensor-model-parallel-size", "2"]


def logprob_data():
    data = sft_data(6, seed=1)
    data["response_lengths"] = [len(t) - 1 for t in data["tokens"]]
    data["loss_masks"] = [[1] * n for n in data["response_lengths"]]
    return data


def record_layout(group):
    """Weights and log-probs as loaded, then two SFT steps' metrics and the weights after them."""
    loaded = group.hf_state_dict()
    log_probs = group.compute_log_probs(logprob_data())
    metrics = [m for _ in range(2) for m in group.train(sft_data(8))]
    return {"loaded": loaded, "log_probs": log_probs, "metrics": metrics, "trained": group.hf_state_dict()}


def run_layout(model_dir, world, extra, arch="qwen2", model_flags=None):
    """``record_layout`` of a fresh trainer group of the tiny ``arch`` in this layout (``model_flags``:
    these instead of ``arch``'s; [] takes every model flag from config.json)."""
    from ray.util.placement_group import remove_placement_group

    args = trainer_args(model_dir, arch=arch, world=world, extra=extra, model_flags=model_flags)
    group, _, pg = make_group(args)
    try:
        return record_layout(group)
    finally:
        group.shutdown()
        remove_placement_group(pg)


def differences(ours, ref):
    """The largest relative metric, absolute log-prob / weight, and relative per-tensor update differences."""
    metric = {
        key: max(
            abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(ours["metrics"], ref["metrics"], strict=True)
        )
        for key in ("loss", "grad_norm")
    }
    log_probs = max(
        (a - b).abs().max().item() for a, b in zip(ours["log_probs"], ref["log_probs"], strict=True)
    )
    weight, update = 0.0, 0.0
    for name, tensor in ref["trained"].items():
        weight = max(weight, (ours["trained"][name] - tensor).abs().max().item())
        ref_update = tensor - ref["loaded"][name]
        our_update = ours["trained"][name] - ours["loaded"][name]
        update = max(update, ((our_update - ref_update).norm() / ref_update.norm()).item())
    return {**metric, "log_probs": log_probs, "weight": weight, "update": update}


def assert_layout_matches(ours, ref):
    """``ours`` (``record_layout`` of another layout) equals the single-rank ``ref``."""
    assert_same_tensors(ours["loaded"], ref["loaded"])
    assert sorted(ours["trained"]) == sorted(ref["trained"])
    assert len(ours["metrics"]) == len(ref["metrics"]) == 2
    assert [a.shape for a in ours["log_probs"]] == [b.shape for b in ref["log_probs"]]

    diff = differences(ours, ref)
    assert diff["loss"] <= 1e-5 and diff["grad_norm"] <= 1e-5, diff
    assert diff["log_probs"] <= 1e-5, diff
    # Adam's first steps move each weight by about +-lr (1e-3) whatever the gradient's size, so where a
    # gradient is near zero the summation-order rounding of another layout shows in a few elements.
    # A wrong shard or a missing gradient reduction would differ by a whole step in many of them.
    assert diff["weight"] <= 2e-4 and diff["update"] <= 1e-2, diff
    return diff


def moe_args(model_dir, world=1, extra=(), script="tiny-qwen3-moe.sh"):
    return trainer_args(model_dir, world=world, extra=extra, model_flags=model_args(script))


def tp2_forward(model) -> tuple[dict[str, torch.Tensor], float]:
    """At TP=2 (and expert TP=2), from config.json alone: the exported HF weights, and the largest
    log-prob difference to transformers. Training MoE (or MLA) under TP needs sequence parallelism
    (GPU only), so validation refuses TP=2 on the CPU; the forward pass and the weight round trip run
    without it."""
    from ray.util.placement_group import remove_placement_group

    from tests.support.trainers import hf_logprob_diff, make_group, sft_data

    args = trainer_args(model, world=2, model_flags=[])
    group, _, pg = make_group(args, tensor_model_parallel_size=2, expert_tensor_parallel_size=2)
    try:
        exported = group.hf_state_dict()
        data = sft_data(4, seed=2)
        data["response_lengths"] = [len(t) - 1 for t in data["tokens"]]
        data["loss_masks"] = [[1] * n for n in data["response_lengths"]]
        ours = group.compute_log_probs(data)
    finally:
        group.shutdown()
        remove_placement_group(pg)
    return exported, hf_logprob_diff(model, data, ours)
