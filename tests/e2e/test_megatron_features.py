"""Megatron features beyond the plain layouts: virtual pipeline stages, activation recompute, bf16.

Each runs the same two SFT steps as a reference configuration and compares loss, grad norm and the
weights after them, so a feature that silently changes the maths fails here.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.trainers import make_group, sft_data, trainer_args

pytestmark = pytest.mark.e2e


def two_steps(model_dir, world, extra):
    """Loss/grad-norm of two SFT steps and the HF weights after them (plus the optimizer's dtypes)."""
    from ray.util.placement_group import remove_placement_group

    group, _, pg = make_group(trainer_args(model_dir, world=world, extra=extra))
    try:
        metrics = [m for _ in range(2) for m in group.train(sft_data(8))]
        return metrics, group.hf_state_dict()
    finally:
        group.shutdown()
        remove_placement_group(pg)


def assert_same_training(ours, ref, rel=1e-5):
    (our_metrics, our_weights), (ref_metrics, ref_weights) = ours, ref
    for a, b in zip(our_metrics, ref_metrics, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= rel * abs(b[key]), (key, a[key], b[key])
    assert sorted(our_weights) == sorted(ref_weights)
    for name, tensor in ref_weights.items():
        assert torch.allclose(our_weights[name], tensor, atol=2e-4), name


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen2_4l", num_layers=4)


FOUR_LAYERS = ["--num-layers", "4"]


def test_virtual_pipeline_stages_equal_one_rank(ray_cluster, four_layer_model):
    """PP=2 with two virtual stages per rank (interleaved 1F1B: layers 0,2 on rank 0, 1,3 on rank 1)."""
    ref = two_steps(four_layer_model, 1, FOUR_LAYERS)
    vpp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    assert_same_training(two_steps(four_layer_model, 2, FOUR_LAYERS + vpp), ref)


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_models):
    return two_steps(tiny_models["qwen2"], 1, [])


FULL = ["--recompute-granularity", "full", "--recompute-method"]
RECOMPUTE = {
    "selective": ["--recompute-activations"],
    "full-uniform": [*FULL, "uniform", "--recompute-num-layers", "1"],
    "full-block": [*FULL, "block", "--recompute-num-layers", "2"],
}


@pytest.mark.parametrize("mode", sorted(RECOMPUTE))
def test_recompute_does_not_change_training(reference, tiny_models, mode):
    assert_same_training(two_steps(tiny_models["qwen2"], 1, RECOMPUTE[mode]), reference, rel=1e-6)


def test_bf16_trains_like_fp32(reference, tiny_models):
    """bf16 parameters with fp32 master weights and fp32 grad reduction: the same steps up to bf16
    rounding (a model trained without fp32 masters, or with the grads cast away, drifts further)."""
    metrics, weights = two_steps(tiny_models["qwen2"], 2, ["--bf16"])
    ref_metrics, ref_weights = reference
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    for ours, ref in zip(metrics, ref_metrics, strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=2e-2)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-2)
    for name, tensor in ref_weights.items():
        assert (weights[name].float() - tensor).abs().max() < 1e-2, name
