"""The megatron-core Qwen2.5-VL policy at tensor parallelism 2 (two gloo ranks on the CPU) against one
rank: the same logits (alone and packed), the same exported checkpoint bit for bit, and the vision
tower, replicated on both ranks, stepped identically on both and as on one rank, and saved and loaded
back exactly in megatron-core's distributed checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.vlm_megatron import run_ranks, tiny_vlm

pytestmark = pytest.mark.e2e


def test_tp2_equals_one_rank(tmp_path: Path) -> None:
    model = tiny_vlm(tmp_path / "qwen2_5_vl")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (one,) = run_ranks(model, tmp_path / "one", world=1)
    two = run_ranks(model, tmp_path / "two", world=2)
    for rank in two:
        for ours, ref in zip(rank["alone"], one["alone"], strict=True):
            assert (ours - ref).abs().max() <= 1e-5
        assert (rank["packed"] - one["packed"]).abs().max() <= 1e-5
        for ours, theirs in zip(*rank["shared"], strict=True):  # an image prompt shared by two responses
            assert (ours - theirs).abs().max() <= 1e-5
        assert sorted(rank["exported"]) == sorted(one["checkpoint"])
        for name, tensor in one["checkpoint"].items():
            assert torch.equal(rank["exported"][name], tensor), name

    tower = [name for name in one["step_frozen=False"]["after"] if name.startswith("visual.")]
    assert len(tower) == 30
    after = [rank["step_frozen=False"]["after"] for rank in two]
    for name in tower:
        assert torch.equal(after[0][name], after[1][name]), name  # replicas stay identical
        # Adam moves each element about lr (1e-3); another reduction order shows only in rounding.
        assert (after[0][name] - one["step_frozen=False"]["after"][name]).abs().max() <= 2e-4, name
    # megatron-core's distributed checkpoint of the TP=2 model (tower replicated) loads back exactly.
    assert all(rank["checkpoint_round_trip"] for rank in two)
