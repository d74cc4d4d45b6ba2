"""Session-wide fixtures: one tiny model per architecture, the flags of a tiny run, and one Ray cluster
for every e2e test."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.models import model_args


@pytest.fixture(scope="session", autouse=True)
def tokenizer_cache(tmp_path_factory) -> Path:
    """The session's own tokenizer cache (``slime.rollout.tokenizer_cache``), for this process and every
    run it starts: nothing is read from or left in the user's."""
    from slime.rollout.tokenizer_cache import CACHE_ENV

    path = tmp_path_factory.mktemp("tokenizer_cache")
    os.environ[CACHE_ENV] = str(path)
    return path


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


TINY_RUN: dict[str, object] = {
    "label_key": "label",
    "rm_type": "exact",
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 2,
    "rollout_max_response_len": 4,
    "micro_batch_size": 4,
    "lr": "1e-3",
    "lr_decay_style": "constant",
    "num_rollout": 2,
}
"""What the tiny RL runs share besides model, checkpoint and data: 4 prompts × 2 samples per rollout,
4-token responses scored by exact match, micro-batches of 4, a constant LR, 2 rollouts."""


@pytest.fixture(scope="session")
def tiny_run_flags(tiny_models, reverse_task) -> Callable[..., list[str]]:
    """``flags(*extra, model_script="tiny-qwen2.sh", **overrides)``: the argv of a tiny RL run, the
    model flags of ``scripts/models/<model_script>`` (None: none, all from config.json), the tiny qwen2
    on ``reverse_task`` and ``TINY_RUN``. ``overrides`` replace or add flags by their dest
    (``num_rollout=3``; True a switch, None drops one); ``extra`` flags come last, as given."""
    from slime.config.sglang_args import server_flags  # dests to flags, as for the SGLang server

    def flags(*extra: str, model_script: str = "tiny-qwen2.sh", **overrides: object) -> list[str]:
        values = {"hf_checkpoint": tiny_models["qwen2"], "prompt_data": reverse_task, **TINY_RUN, **overrides}
        return [*(model_args(model_script) if model_script else []), *server_flags(values), *extra]

    return flags


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    """Six prompts ``q0`` .. ``q5``, label ``34``, as JSONL: for the plugin tests that build a data source."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"q{i}", "label": "34"}) + "\n" for i in range(6)))
    return path


@pytest.fixture(autouse=True)
def no_engine_key_between_tests(monkeypatch):
    """The run's engine key lives in this process's environment once a run sets it up
    (``slime.ray.cluster.start_ray``); no test may hand one on to the next."""
    from slime.utils.http import ENGINE_API_KEY_ENV

    monkeypatch.delenv(ENGINE_API_KEY_ENV, raising=False)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster with 8 logical GPUs, shared by every test that places actors."""
    import ray

    from slime.ray.cluster import lean_head

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with lean_head():
        ray.init(
            address="local", num_gpus=8, include_dashboard=False, logging_level="warning", log_to_driver=False
        )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def stack(ray_cluster, tiny_run_flags):
    """``stack(layout)``: the started TrainingSession of a layout (a name in
    ``tests.support.stacks.LAYOUTS`` or a mapping of ``tiny_run_flags`` overrides), started once and
    shared by the tests that need one running; each test leaves it as it found it. All stop at the
    session's end, with no actor, placement group, engine or router left."""
    from tests.support.stacks import Stacks

    stacks = Stacks(tiny_run_flags)
    yield stacks
    stacks.close()
