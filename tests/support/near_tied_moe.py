"""Tiny MoE checkpoints whose routers cannot tell two choices apart beyond fp32 rounding: the noise
between an engine's forward and the trainer's then flips some tokens' experts, which is what routing
replay must undo (tests/e2e/test_routing_replay_megatron.py, tests/e2e/test_routing_replay_e2e.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

NEAR_TIE = 3e-7
"""How far Qwen3-MoE's near-tied router rows are apart (relative to their norm)."""


def near_tied(source: Path, target: Path, arch: str) -> Path:
    """A copy of ``source`` whose routers cannot tell two choices apart beyond fp32 rounding.

    Qwen3-MoE: expert 1's router row is expert 0's moved by ``NEAR_TIE``, so wherever the two compete
    for the last top-k slot their logits differ by ~1e-7 (transformers compares rounded softmax
    probabilities, Megatron the logits). DeepSeek-V3 picks one of two expert groups {0, 1}, {2, 3} by
    their biased sigmoid scores; with rows ``w1 = -w0``, ``w3 = -w2`` and the biases of each group
    summing alike, both groups score ``σ(l) + σ(-l) + b = 1 + b`` for every token, so the rounding of
    two different logits (whose fp32 noise differs between the two forwards) decides."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    state = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(11)
    for name in [n for n in state if n.endswith("mlp.gate.weight")]:
        weight = state[name]
        if arch == "qwen3_moe":
            noise = torch.randn(weight.shape[1], generator=generator)
            weight[1] = weight[0] + NEAR_TIE * weight[0].norm() * noise / noise.norm()
            continue
        weight[1], weight[3] = -weight[0], -weight[2]
        bias = state[name.replace("weight", "e_score_correction_bias")]
        bias[2:] = bias[:2]
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    return target
