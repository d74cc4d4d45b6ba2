"""GLM-4 dense (``model_type`` glm4) on the tiny checkpoint: flags from config.json, the HF <-> Megatron
round trip, Megatron's and the torch engine's log-probs against transformers, TP=2 against one rank,
and a weight push from the TP=2 trainer read back from the engine tensor by tensor.

The tiny checkpoint's norm weights and q/k/v biases are redrawn at random first
(``conftest.redraw_norms_and_biases``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from slime.config import parse_args
from tests.support.engines import _start_engine, engine_logprob_diff, engine_weights_equal
from tests.support.models import redraw_norms_and_biases
from tests.support.trainers import (
    TP2,
    assert_layout_matches,
    assert_same_tensors,
    hf_logprob_diff,
    logprob_data,
    make_group,
    record_layout,
    run_layout,
    trainer_args,
)

GLM4_FLAGS = (
    "rotary_percent",
    "rotary_interleaved",
    "post_self_attn_layernorm",
    "post_mlp_layernorm",
    "add_qkv_bias",
    "add_bias_linear",
    "qk_layernorm",
    "kv_channels",
    "num_query_groups",
)


@pytest.fixture(scope="module")
def glm4_model(tmp_path_factory) -> Path:
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("glm4")
    return redraw_norms_and_biases(
        shutil.copytree(make_tiny_model(root / "initial", arch="glm4"), root / "glm4"), 4
    )


@pytest.fixture(scope="module")
def single_rank(ray_cluster, glm4_model):
    return run_layout(glm4_model, 1, [], arch="glm4")


@pytest.fixture(scope="module")
def engine(glm4_model, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("glm4_engine") / "engine.log"
    server = _start_engine(glm4_model, log, "--random-seed", "0")  # the same sampled tokens every run
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf(glm4_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(glm4_model, dtype=torch.float32).eval()


def test_tiny_glm4_script_matches_config_json_and_equals_what_it_fills(glm4_model):
    scripted = trainer_args(glm4_model, arch="glm4")  # every flag of the script checked against config.json
    bare = parse_args(
        ["--hf-checkpoint", str(glm4_model), "--debug-train-only", "--loss-type", "sft_loss",
         "--rollout-batch-size", "8", "--lr", "1e-3", "--num-rollout", "1"]
    )  # fmt: skip
    values = [getattr(scripted, dest) for dest in GLM4_FLAGS]
    assert values == [0.5, True, True, True, True, False, False, 32, 2]
    assert [getattr(bare, dest) for dest in GLM4_FLAGS] == values


@pytest.mark.e2e
def test_hf_to_megatron_to_hf_is_bit_exact(single_rank, glm4_model):
    original = load_file(glm4_model / "model.safetensors")
    assert "model.layers.1.post_mlp_layernorm.weight" in original and "lm_head.weight" not in original
    assert_same_tensors(single_rank["loaded"], original)


@pytest.mark.e2e
def test_megatron_logprobs_equal_transformers(single_rank, glm4_model):
    diff = hf_logprob_diff(glm4_model, logprob_data(), single_rank["log_probs"])
    print(f"GLM-4: max |log-prob(Megatron) - log-prob(transformers)| = {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.e2e
def test_engine_logprobs_equal_transformers(engine, hf):
    diff = engine_logprob_diff(engine, hf)
    print(f"GLM-4: max |log-prob(torch engine) - log-prob(transformers)| = {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.e2e
def test_tp2_equals_one_rank_and_its_push_reaches_every_engine_tensor(single_rank, glm4_model, engine, hf):
    """The TP=2 trainer gathers every tensor (the replicated post norms, the sliced q/k/v and fused fc1)
    and pushes it by HF name; the engine then holds the trained weights in every parameter it has."""
    from ray.util.placement_group import remove_placement_group

    from slime.config.settings.weight_sync import WeightSyncSettings
    from slime.engine_client.weight_updates import weight_update_session

    args = trainer_args(glm4_model, arch="glm4", world=2, extra=TP2)
    settings = WeightSyncSettings.from_args(args)
    group, _, pg = make_group(args)
    try:
        ours = record_layout(group)
        group.connect_engines([engine])
        with weight_update_session([engine], settings.timeout_s):
            group.update_weights("tp2-1")
    finally:
        group.shutdown()
        remove_placement_group(pg)
    try:
        diff = assert_layout_matches(ours, single_rank)
        print(f"GLM-4 TP=2 vs one rank: {diff}")
        trained = ours["trained"]
        tied = {"lm_head.weight": trained["model.embed_tokens.weight"]}
        engine_names = {name for name, _ in hf.named_parameters(remove_duplicate=False)}
        assert engine_names == set(trained) | set(tied)
        engine_weights_equal(engine, trained | tied)
    finally:
        reply = requests.post(f"{engine}/update_weights_from_disk", json={"model_path": str(glm4_model)})
        assert reply.json()["success"], reply.text
