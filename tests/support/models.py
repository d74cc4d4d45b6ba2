"""Flags and checkpoints of the tiny test models."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.support.paths import REPO


def model_args(script: str = "tiny-qwen2.sh") -> list[str]:
    """The ``MODEL_ARGS`` array of ``scripts/models/<script>``, as bash expands it."""
    out = subprocess.run(
        [
            "bash",
            "-c",
            f"source {shlex.quote(str(REPO / 'scripts/models' / script))}; "
            'printf "%s\\n" "${MODEL_ARGS[@]}"',
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.splitlines()


def redraw_norms_and_biases(model: Path, seed: int) -> Path:
    """``model`` (a tiny checkpoint, rewritten in place) with norm weights ~ 1 + N(0, 0.1^2) and biases
    ~ N(0, 0.1^2), each its own draw: transformers starts them at ones and zeros, under which a swapped
    or dropped norm or bias would convert and compute exactly as the right one does."""
    from safetensors.torch import save_file

    state = load_file(model / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in state.items():
        noise = 0.1 * torch.randn(tensor.shape, generator=generator)
        if name.endswith("norm.weight"):
            state[name] = 1.0 + noise
        elif name.endswith(".bias") and not name.endswith("e_score_correction_bias"):
            state[name] = noise
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    return model


def write_config(directory, config):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory
