"""Qwen3-MoE on Megatron: flags from config.json, conversion, logits vs transformers, expert parallelism.

One tiny MoE (4 experts, top-2, every layer sparse) trained for one SFT step on a two-rank world, once
with the experts replicated (EP=1, DP=2) and once split over the ranks (EP=2: two experts each), on
the same data: the loss, grad norm, log-probs and HF tensors (loaded and trained) must agree, and the
EP=2 trainer's push must reach every tensor of a torch engine.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from slime.config import parse_args
from slime.config.errors import ConfigError
from slime.config.parser import build_parser, configure, explicit_dests
from tests.support.models import model_args, write_config
from tests.support.trainers import moe_args, tp2_forward, trainer_args

QWEN3_30B_A3B_CONFIG = {  # the published config.json of Qwen/Qwen3-30B-A3B (the keys that matter here)
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe", tie_word_embeddings=False
    )


def test_tiny_script_matches_the_checkpoint_and_fills_moe_fields(moe_model):
    config = json.loads((moe_model / "config.json").read_text())
    sizes = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    assert [config[key] for key in sizes] == [4, 2, 64]
    assert config["norm_topk_prob"] is True and config["tie_word_embeddings"] is False
    args = moe_args(moe_model)  # every flag of the script is checked against config.json
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 64)
    assert args.moe_router_pre_softmax is False and args.moe_layer_freq == 1

    bare = parse_args(
        ["--hf-checkpoint", str(moe_model), "--rollout-batch-size", "8", "--lr", "1e-3", "--num-rollout", "1",
         "--debug-train-only", "--loss-type", "sft_loss"]
    )  # fmt: skip
    filled = (
        "num_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "moe_router_pre_softmax",
        "moe_layer_freq",
    )
    assert [getattr(bare, dest) for dest in filled] == [getattr(args, dest) for dest in filled]


def test_qwen3_30b_a3b_script_matches_the_published_config(tmp_path):
    model = write_config(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B_CONFIG)
    args = moe_args(model, script="qwen3-30B-A3B.sh")
    shape = (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.num_query_groups)
    assert shape == (128, 8, 768, 4)
    # Upstream slime's script spells the layer pattern as a Python list (quotes included).
    upstream = moe_args(model, script="qwen3-30B-A3B.sh", extra=["--moe-layer-freq", "'([1]*48)'"])
    assert upstream.moe_layer_freq == [1] * 48


@pytest.mark.parametrize(
    ("changes", "given", "flag", "needle"),
    [
        ({"norm_topk_prob": False}, [], None, None),  # Qwen2-MoE style: filled as pre-softmax
        (
            {"norm_topk_prob": True},
            ["--moe-router-pre-softmax"],
            "--moe-router-pre-softmax",
            "norm_topk_prob",
        ),
        ({}, ["--moe-layer-freq", "[1]*3"], "--moe-layer-freq", "decoder_sparse_step=1"),
        ({"mlp_only_layers": [0]}, ["--moe-layer-freq", "1"], "--moe-layer-freq", "mlp_only_layers=[0]"),
        (
            {},
            ["--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
            "--moe-token-dispatcher-type",
            "use alltoall",
        ),
        (
            {},
            ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
            "--tensor-model-parallel-size",
            "--sequence-parallel",
        ),
    ],
)
def test_moe_flags_are_checked_against_config_json(tmp_path, changes, given, flag, needle):
    config = {**QWEN3_30B_A3B_CONFIG, "num_hidden_layers": 2, **changes}
    model = write_config(tmp_path / "m", config)
    argv = ["--hf-checkpoint", str(model), "--rollout-batch-size", "8", "--lr", "1e-3", "--num-rollout", "1",
            "--debug-train-only", "--loss-type", "sft_loss", *given]  # fmt: skip
    if flag is None:
        assert parse_args(argv).moe_router_pre_softmax is True
        return
    parser = build_parser()
    with pytest.raises(ConfigError) as error:
        configure(parser.parse_args(argv), explicit=explicit_dests(parser, argv))
    assert error.value.flag == flag and needle in str(error.value)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [({"decoder_sparse_step": 2}, [0, 1, 0, 1]), ({"mlp_only_layers": [0, 3]}, [0, 1, 1, 0])],
)
def test_dense_layers_of_an_moe_model_are_filled_from_config_json(tmp_path, changes, pattern):
    model = write_config(tmp_path / "m", {**QWEN3_30B_A3B_CONFIG, "num_hidden_layers": 4, **changes})
    assert trainer_args(model, model_flags=[]).moe_layer_freq == pattern


# ---- end to end on Ray ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ep1(ray_cluster, moe_model):
    from tests.support.trainers import run_layout

    return run_layout(moe_model, 2, [], model_flags=model_args("tiny-qwen3-moe.sh"))


@pytest.mark.e2e
@pytest.mark.slow
def test_moe_converts_bit_exact_and_matches_transformers(ep1, moe_model):
    from tests.support.trainers import assert_same_tensors, hf_logprob_diff, logprob_data

    original = load_file(moe_model / "model.safetensors")
    assert any(".mlp.experts.3.down_proj." in name for name in original)
    assert_same_tensors(ep1["loaded"], original)
    diff = hf_logprob_diff(moe_model, logprob_data(), ep1["log_probs"])
    print(f"max |log-prob(Megatron MoE) - log-prob(transformers)| = {diff:.3g}")
    assert diff <= 1e-4


EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.e2e
@pytest.mark.slow
def test_expert_parallel_2_equals_expert_parallel_1_and_its_push_reaches_every_engine_tensor(
    ep1, moe_model, tmp_path
):
    """EP=2 (two experts per rank, alltoall dispatch) trains as EP=1 on the same data. Its push gathers
    every expert over both ranks and sends it by its per-expert HF name: the engine then holds the
    trained weights in every parameter it has."""
    from ray.util.placement_group import remove_placement_group

    from slime.config.settings.weight_sync import WeightSyncSettings
    from slime.engine_client.weight_updates import weight_update_session
    from tests.support.engines import _start_engine, engine_weights_equal
    from tests.support.trainers import assert_layout_matches, make_group, record_layout

    args = moe_args(moe_model, world=2, extra=EP2)
    server = _start_engine(moe_model, tmp_path / "engine.log")
    group, _, pg = make_group(args)
    try:
        ep2 = record_layout(group)
        group.connect_engines([server.url])
        with weight_update_session([server.url], WeightSyncSettings.from_args(args).timeout_s):
            group.update_weights("ep2-1")
        parity = assert_layout_matches(ep2, ep1)  # every expert gathered over both ranks; loss, grad norm
        print(f"Qwen3-MoE EP=2 vs EP=1: {parity}")
        trained = ep2["trained"]
        assert any(".mlp.experts.3.down_proj." in name for name in trained)
        assert set(trained) == set(load_file(moe_model / "model.safetensors"))  # all the engine loaded
        engine_weights_equal(server.url, trained)
    finally:
        group.shutdown()
        remove_placement_group(pg)
        server.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_qwen2_moe_with_a_gated_shared_expert_matches_transformers_at_tp2(ray_cluster, tmp_path):
    """Qwen2-MoE: shared expert scaled by a sigmoid gate, top-k weights not renormalised, q/k/v bias;
    every Megatron flag comes from config.json alone. Under TP=2 every expert's gated fc1 is sliced over
    the expert tensor-parallel group, so a wrong slice layout would show in the log-probs."""
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "qwen2_moe", arch="qwen2_moe")
    args = trainer_args(model, model_flags=[])
    assert (args.moe_shared_expert_intermediate_size, args.moe_shared_expert_gate) == (128, True)
    assert args.moe_router_pre_softmax and args.add_qkv_bias and not args.qk_layernorm
    from tests.support.trainers import assert_same_tensors

    exported, diff = tp2_forward(model)
    original = load_file(model / "model.safetensors")
    assert "model.layers.1.mlp.shared_expert_gate.weight" in original
    assert_same_tensors(exported, original)
    print(f"Qwen2-MoE: max |log-prob(Megatron) - log-prob(transformers)| = {diff:.3g}")
    assert diff <= 1e-4
