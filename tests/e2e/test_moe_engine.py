"""MoE weights reach the torch engine by their per-expert HF names, as a trainer (and SGLang) sends them.

transformers 5 holds a Qwen3-MoE layer's experts as fused tensors; the engine maps every
``mlp.experts.{e}.{gate,up,down}_proj.weight`` to its slice. Checked end to end against an engine
subprocess: every expert weight is replaced (half through a weight-update group with SGLang's
flattened buckets, half through shared-memory tensor handles), read back by name, and the engine's
log-probs equal those of transformers loading the same per-expert checkpoint, whose own conversion
fuses the experts independently of ours.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from slime.backends.engine_server import start_engine_server
from slime.backends.torch_engine.launcher import serving
from slime.backends.torch_engine.weights import iter_safetensors
from slime.engine_client.weight_updates import weight_update_session
from slime.utils.http import free_port
from slime.weight_sync import ipc
from slime.weight_sync.process_group import broadcast_from_rank0, create_weight_update_group

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe")


@pytest.fixture(scope="module")
def engine(moe_model, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("moe_engine") / "engine.log"
    command = serving(moe_model, "--random-seed", "0")
    server = start_engine_server("torch engine", command, log, timeout_s=180, env={"OMP_NUM_THREADS": "1"})
    try:
        yield server.url
    finally:
        server.stop()


def _post(url: str, path: str, body: dict) -> dict:
    reply = requests.post(f"{url}{path}", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _send_distributed(url: str, named: list[tuple[str, torch.Tensor]]) -> None:
    """The trainer side of a weight-update group: one flattened bucket, announced then broadcast."""
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    init.update(group_name="moe", backend="gloo")
    pool = ThreadPoolExecutor(1)
    try:
        joined = pool.submit(_post, url, "/init_weights_update_group", init)
        group = create_weight_update_group("127.0.0.1", port, 0, 2, "moe", "gloo", timeout_s=60)
        assert joined.result()["success"]
        bucket = ipc.FlattenedBucket.from_named_tensors(named)
        body = {
            "names": [m.name for m in bucket.metadata],
            "dtypes": ["float32"] * len(named),
            "shapes": [list(m.shape) for m in bucket.metadata],
            "group_name": "moe",
            "load_format": "flattened_bucket",
        }
        with weight_update_session([url], 60):  # SGLang >= 0.5.21 (the engine's default release)
            reply = pool.submit(_post, url, "/update_weights_from_distributed", body)
            broadcast_from_rank0(group, bucket.flattened_tensor, 60)
            assert reply.result()["success"], reply.result()
        assert _post(url, "/destroy_weights_update_group", {"group_name": "moe"})["success"]
        group.shutdown()
    finally:
        pool.shutdown()


def test_every_expert_weight_is_updated_read_back_and_used(engine, moe_model, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    state = dict(iter_safetensors(str(moe_model)))
    experts = sorted(name for name in state if ".mlp.experts." in name)
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    generator = torch.Generator().manual_seed(7)
    for name in experts:
        state[name] = torch.randn(state[name].shape, generator=generator) * 0.2

    half = len(experts) // 2
    _send_distributed(engine, [(name, state[name]) for name in experts[:half]])
    staging = ipc.StagingBuffer()
    bucket = staging.pack([(name, state[name]) for name in experts[half:]])
    with weight_update_session([engine], 60):
        reply = _post(
            engine,
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [ipc.serialize(bucket.payload())],
                "load_format": "flattened_bucket",
                "flush_cache": True,
                "weight_version": "moe-1",
            },
        )
    assert reply["success"], reply

    for name in experts:
        got = torch.tensor(_post(engine, "/get_weights_by_name", {"name": name, "truncate_size": 10**6}))
        assert torch.equal(got, state[name]), name
    wrong = [("model.layers.0.mlp.experts.0.up_proj.weight", torch.zeros(3, 3))]
    with weight_update_session([engine], 60):
        bad = requests.post(
            f"{engine}/update_weights_from_tensor",
            json={"serialized_named_tensors": [ipc.serialize(wrong)]},
            timeout=60,
        )
    assert not bad.json()["success"] and "expected [64, 128]" in bad.json()["message"]

    updated = tmp_path / "updated"
    shutil.copytree(moe_model, updated)
    save_file(state, str(updated / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(updated, dtype=torch.float32).eval()
    prompt = [3, 17, 42, 5, 99, 23]
    out = _post(
        engine,
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert out["meta_info"]["weight_version"] == "moe-1"
    ids = prompt + out["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    targets = torch.tensor(out["output_ids"])[:, None]
    want = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(1, targets)[:, 0]
    got = torch.tensor([triple[0] for triple in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
