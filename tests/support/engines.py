"""Starting torch engines and reading their state, log-probs and weights."""

from __future__ import annotations

from pathlib import Path

import requests
import torch

from slime.backends.engine_server import EngineServer, start_engine_server
from slime.backends.torch_engine.launcher import serving
from slime.utils.http import get_json, post_json_sync


def engine_state(url: str) -> dict:
    """An engine's scheduler counters (``/get_server_info`` ``internal_states[0]``: requests finished,
    aborted, decode steps, KV bytes, paused)."""

    return get_json(f"{url}/get_server_info")["internal_states"][0]


DIST_TIMEOUT_S = 3  # a collective whose peer never comes fails after this long (engine env below)


HEALTH_TIMEOUT_S = 2  # SGLANG_HEALTH_CHECK_TIMEOUT: a health check without a generation is 503 after it


def _start_engine(model: Path, log: Path, *extra: str) -> EngineServer:
    # One intra-op thread: the tiny model gains nothing from more, and on a shared 2-core machine spinning
    # OpenMP workers of two processes (engine and test) slow each other down many times over.
    env = {
        "SLIME_TORCH_ENGINE_DIST_TIMEOUT": str(DIST_TIMEOUT_S),
        "SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_TIMEOUT_S),
        "OMP_NUM_THREADS": "1",
    }
    command = serving(model, "--log-level", "warning", *extra)
    return start_engine_server("torch engine", command, log, timeout_s=120, env=env)


def generate(url: str, **body) -> dict:
    response = requests.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def forward_logprobs(model, ids: list[int], prompt_len: int, temperature: float) -> torch.Tensor:
    """log p(token | prefix) of ids[prompt_len:] under log_softmax(logits / T): what a trainer recomputes."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    targets = torch.tensor(ids[prompt_len:])
    return logprobs[prompt_len - 1 : len(ids) - 1].gather(1, targets[:, None])[:, 0]


def engine_logprob_diff(url: str, model) -> float:
    """The largest difference between the engine's log-probs (16 sampled tokens at T = 1, and the
    prompt's) and transformers' ``model`` on the same tokens."""
    ids = [5, 17, 40, 3, 62, 11, 9, 28]
    reply = generate(
        url,
        input_ids=ids,
        sampling_params={"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )
    meta, out = reply["meta_info"], reply["output_ids"]
    assert len(out) == 16
    ours = torch.tensor([t[0] for t in meta["output_token_logprobs"]])
    prompt = torch.tensor([t[0] for t in meta["input_token_logprobs"][1:]])
    return max(
        (ours - forward_logprobs(model, ids + out, len(ids), 1.0)).abs().max().item(),
        (prompt - forward_logprobs(model, ids, 1, 1.0)).abs().max().item(),
    )


def engine_weights_equal(url: str, expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        values = post_json_sync(f"{url}/get_weights_by_name", {"name": name, "truncate_size": tensor.numel()})
        assert torch.equal(torch.tensor(values).flatten(), tensor.flatten()), (url, name)
