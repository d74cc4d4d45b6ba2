"""TP=2, PP=2, TP=2 x PP=2 and PP=2 x DP=2 on CPU with gloo equal a single rank on the same data.

Compared: HF weights as loaded (bit-exact), response log-probs, loss and grad norm of two SFT steps,
and the HF weights after them (gathered from TP shards and every PP stage).
"""

from __future__ import annotations

import pytest
from test_megatron_trainer import assert_same_tensors, make_group, sft_data, trainer_args

pytestmark = pytest.mark.e2e

TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# (world size, flags); the data-parallel size is what is left of the world.
LAYOUTS = {"tp2": (2, TP2), "pp2": (2, PP2), "tp2pp2": (4, TP2 + PP2), "pp2dp2": (4, PP2)}


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


@pytest.fixture(scope="module")
def single_rank(ray_cluster, tiny_models):
    return run_layout(tiny_models["qwen2"], 1, [])


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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_single_rank(single_rank, tiny_models, layout):
    assert_layout_matches(run_layout(tiny_models["qwen2"], *LAYOUTS[layout]), single_rank)
