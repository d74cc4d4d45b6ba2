"""Session-wide fixtures: one tiny model per architecture and one Ray cluster for every e2e test."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny HF checkpoints: the default qwen2 (as in scripts/models/tiny-qwen2.sh), qwen3, untied llama."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": make_tiny_model(root / "qwen2"),
        "qwen3": make_tiny_model(root / "qwen3", arch="qwen3", head_dim=32),
        "llama": make_tiny_model(root / "llama", arch="llama", tie_word_embeddings=False),
    }


@pytest.fixture(scope="session")
def reverse_task(tmp_path_factory) -> Path:
    """A JSONL prompt set for loop tests: reverse three letters; the label is the reversed string."""
    path = tmp_path_factory.mktemp("reverse_task") / "train.jsonl"
    words = ["abc", "xyz", "cat", "dog", "sun", "sky", "red", "fox"]
    path.write_text("".join(json.dumps({"input": w, "label": w[::-1]}) + "\n" for w in words))
    return path


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster with 8 logical GPUs, shared by every test that places actors."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_gpus=8, include_dashboard=False, logging_level="warning", log_to_driver=False)
    yield
    ray.shutdown()


@contextlib.contextmanager
def running_rollout_manager(args, log_dir: Path):
    """A RolloutManager with its engines (one per bundle of ``--rollout-num-gpus``) and router started;
    yields ``(manager, engine urls, router url)`` and stops all of it after."""
    import ray

    from slime.ray.cluster import create_placement_group, release_placement_group
    from slime.ray.rollout_manager import RolloutManager

    pg = create_placement_group(args.rollout_num_gpus)
    manager = RolloutManager.remote(args, pg, list(range(args.rollout_num_gpus)), log_dir=str(log_dir))
    try:
        urls, router_url = ray.get(manager.start.remote(120))
        yield manager, urls, router_url
    finally:
        ray.get(manager.shutdown.remote())
        ray.kill(manager)
        release_placement_group(pg)
