"""Session-wide fixtures: one tiny model per architecture, the flags of a tiny run, and one Ray cluster
for every e2e test."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
from collections.abc import Callable
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


def rollout_only_args(tiny_models: dict[str, Path], prompts: Path, *extra: str):
    """The parsed flags of a one-rollout ``--debug-rollout-only`` run of the tiny qwen2 on ``prompts``
    (2 prompts x 2 samples, exact-match reward): what the plugin tests build their objects from."""
    from slime.config import parse_args

    return parse_args(
        [
            "--hf-checkpoint", str(tiny_models["qwen2"]),
            "--prompt-data", str(prompts), "--label-key", "label", "--rm-type", "exact",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-num-gpus", "1", "--num-rollout", "1", "--debug-rollout-only",
            "--rollout-max-response-len", "5", *extra,
        ]
    )  # fmt: skip


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

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local", num_gpus=8, include_dashboard=False, logging_level="warning", log_to_driver=False
    )
    yield
    ray.shutdown()


def engine_state(url: str) -> dict:
    """An engine's scheduler counters (``/get_server_info`` ``internal_states[0]``: requests finished,
    aborted, decode steps, KV bytes, paused)."""
    from slime.utils.http import get_json

    return get_json(f"{url}/get_server_info")["internal_states"][0]


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


async def with_http_server(path: str, handler, body):
    """Serves ``handler`` at ``POST path`` on 127.0.0.1 (a free port) while ``body(url)`` runs; its result."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await body(f"http://127.0.0.1:{runner.addresses[0][1]}{path}")
    finally:
        await runner.cleanup()


def redraw_norms_and_biases(model: Path, seed: int) -> Path:
    """``model`` (a tiny checkpoint, rewritten in place) with norm weights ~ 1 + N(0, 0.1^2) and biases
    ~ N(0, 0.1^2), each its own draw: transformers starts them at ones and zeros, under which a swapped
    or dropped norm or bias would convert and compute exactly as the right one does."""
    import torch
    from safetensors.torch import load_file, save_file

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
