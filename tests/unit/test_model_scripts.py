"""Every ``scripts/models/*.sh`` against the published ``config.json`` of its model.

``tests/data/hf_configs/<script>.json`` holds the model's config.json as published on the Hugging Face
Hub (see SOURCES.md there). Each script is parsed with that file as the only content of
``--hf-checkpoint``, exactly as a run would parse it: the parser fills and checks the model flags
against config.json, and the test then checks that the parsed shape is the config's shape. No weights,
no model build, no Ray.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.models import write_config
from tests.support.paths import REPO
from tests.support.trainers import moe_args

CONFIGS = REPO / "tests/data/hf_configs"
SCRIPTS = REPO / "scripts/models"

# One row per model script: what the config keys alone do not say (the model family's own layout).
ROWS: dict[str, dict[str, object]] = {
    "qwen2.5-0.5B.sh": {"add_qkv_bias": True, "untie_embeddings_and_output_weights": False},
    "qwen2.5-7B.sh": {"add_qkv_bias": True},
    "qwen2.5-32B.sh": {"add_qkv_bias": True},
    "qwen2.5-VL-7B.sh": {
        "add_qkv_bias": True,
        "position_embedding_type": "mrope",
        "mrope_section": [16, 24, 24],
    },
    "qwen3-0.6B.sh": {"qk_layernorm": True, "untie_embeddings_and_output_weights": False},
    "qwen3-4B.sh": {"qk_layernorm": True, "untie_embeddings_and_output_weights": False},
    "qwen3-8B.sh": {"qk_layernorm": True},
    "qwen3-30B-A3B.sh": {"qk_layernorm": True, "moe_router_score_function": "softmax"},
    "qwen3-235B-A22B.sh": {"qk_layernorm": True, "moe_router_score_function": "softmax"},
    "llama3.1-8B.sh": {"use_rope_scaling": True, "add_qkv_bias": False},
    "llama3-8B.sh": {"add_qkv_bias": False},
    "llama3-70B.sh": {"use_rope_scaling": True, "rope_scaling_factor": 8.0, "add_qkv_bias": False},
    "glm4-9B.sh": {
        "add_qkv_bias": True,
        "rotary_interleaved": True,
        "post_self_attn_layernorm": True,
        "post_mlp_layernorm": True,
    },
    "glm-z1-9B.sh": {
        "add_qkv_bias": True,
        "rotary_interleaved": True,
        "post_self_attn_layernorm": True,
        "post_mlp_layernorm": True,
    },
    "glm4.5-106B-A12B.sh": {"add_qkv_bias": True, "qk_layernorm": False, "rotary_interleaved": False},
    "glm4.5-355B-A32B.sh": {"add_qkv_bias": True, "qk_layernorm": True, "rotary_interleaved": False},
    "glm4.6-355B-A32B.sh": {"add_qkv_bias": True, "qk_layernorm": True, "rotary_interleaved": False},
    "glm4.7-355B-A32B.sh": {"add_qkv_bias": True, "qk_layernorm": True, "rotary_interleaved": False},
    "deepseek-v3.sh": {"qk_layernorm": True},
    "deepseek-v3.1.sh": {"qk_layernorm": True},
    "deepseek-r1.sh": {"qk_layernorm": True},
    "kimi-k2.sh": {"qk_layernorm": True},
    "moonlight-16B-A3B.sh": {"qk_layernorm": True},
}


def config_of(script: str) -> dict:
    return json.loads((CONFIGS / f"{Path(script).stem}.json").read_text())


def layer_pattern(freq: int | list[int], num_layers: int) -> list[int]:
    """Megatron's ``--moe-layer-freq`` as one 0/1 entry per layer (1 = MoE layer)."""
    return [int(i % freq == 0) for i in range(num_layers)] if isinstance(freq, int) else list(freq)


def expected_shape(config: dict) -> dict[str, object]:
    """The parsed Megatron args that ``config`` implies, by dest."""
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    mla = "kv_lora_rank" in config
    expected: dict[str, object] = {
        "num_layers": layers,
        "hidden_size": config["hidden_size"],
        "ffn_hidden_size": config["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads", heads),
        "group_query_attention": config.get("num_key_value_heads", heads) != heads,
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "norm_epsilon": config["rms_norm_eps"],
        "normalization": "RMSNorm",
        "swiglu": config["hidden_act"] == "silu",
        "rotary_base": config["rope_theta"],
        "rotary_percent": config.get("partial_rotary_factor", 1.0),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "add_bias_linear": False,
    }
    if "head_dim" in config:
        expected["kv_channels"] = config["head_dim"]
    elif not mla:
        expected["kv_channels"] = config["hidden_size"] // heads
    if mla:
        rope = config.get("rope_scaling") or {}
        yarn = rope.get("type", rope.get("rope_type")) == "yarn"
        expected.update(
            multi_latent_attention=True,
            q_lora_rank=config["q_lora_rank"],
            kv_lora_rank=config["kv_lora_rank"],
            kv_channels=config["qk_nope_head_dim"],
            qk_head_dim=config["qk_nope_head_dim"],
            qk_pos_emb_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            rope_type="yarn" if yarn else "rope",
        )
        if yarn:
            expected.update(
                rotary_scaling_factor=rope["factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
                beta_fast=rope["beta_fast"],
                beta_slow=rope["beta_slow"],
                mscale=rope["mscale"],
                mscale_all_dim=rope["mscale_all_dim"],
            )
    experts = config.get("n_routed_experts", config.get("num_experts"))
    if experts:
        dense = config.get("first_k_dense_replace", 0)
        expected.update(
            num_experts=experts,
            moe_router_topk=config["num_experts_per_tok"],
            moe_ffn_hidden_size=config["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=(config.get("n_shared_experts") or 0)
            * config["moe_intermediate_size"]
            or None,
            moe_router_pre_softmax=not config["norm_topk_prob"],
            moe_layer_pattern=[0] * dense + [1] * (layers - dense),
        )
        if config.get("scoring_func") == "sigmoid":
            expected["moe_router_score_function"] = "sigmoid"
        if config.get("topk_method") == "noaux_tc":
            expected.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0)
        if "routed_scaling_factor" in config:
            expected.update(
                moe_router_topk_scaling_factor=config["routed_scaling_factor"],
                moe_router_num_groups=config["n_group"],
                moe_router_group_topk=config["topk_group"],
            )
    return expected


@pytest.mark.parametrize("script", sorted(ROWS))
def test_script_parses_against_its_published_config(tmp_path, script):
    config = config_of(script)
    args = moe_args(write_config(tmp_path / Path(script).stem, config), script=script)
    expected = {**expected_shape(config), **ROWS[script]}
    if "moe_layer_pattern" in expected:
        args.moe_layer_pattern = layer_pattern(args.moe_layer_freq, args.num_layers)
    parsed = {dest: getattr(args, dest, "<missing>") for dest in expected}
    assert parsed == expected


def test_every_model_script_has_a_published_config():
    scripts = {p.name for p in SCRIPTS.glob("*.sh") if not p.name.startswith("tiny-")}
    assert scripts == set(ROWS), "add a row (and tests/data/hf_configs/<name>.json) for each script"
    configs = {p.stem for p in CONFIGS.glob("*.json")}
    assert configs == {Path(s).stem for s in scripts}
