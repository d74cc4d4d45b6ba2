"""DeepSeek-V3 (multi-latent attention with YaRN, DeepSeek's MoE) and GLM-4.5 (``glm4_moe``: the dense
attention with partial RoPE and q/k norms, the same MoE) on tiny checkpoints made by transformers.

Both MoEs have a first dense layer, a shared expert, sigmoid routing renormalised over the top-k and
scaled, and a score bias that picks experts without weighting them (non-zero in the tiny models, so a
bias left out would route differently); DeepSeek-V3's also routes within expert groups. Every
Megatron flag comes from config.json alone.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from slime.config import parse_args
from tests.support.models import redraw_norms_and_biases
from tests.support.paths import PLUGINS
from tests.support.trainers import (
    assert_layout_matches,
    assert_same_tensors,
    hf_logprob_diff,
    logprob_data,
    run_layout,
)

FAMILIES = ("deepseek_v3", "glm4_moe")
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("deepseek_family")
    made = {
        arch: make_tiny_model(root / "initial" / arch, arch=arch, tie_word_embeddings=False)
        for arch in FAMILIES
    }
    return {
        arch: redraw_norms_and_biases(shutil.copytree(path, root / arch), 3) for arch, path in made.items()
    }


@pytest.mark.e2e
def test_the_torch_engine_serves_glm4_moe_as_transformers_computes_it(family_models, tmp_path):
    """(DeepSeek-V3's engine is checked by the GRPO run below: its log-probs against the trainer's.)"""
    from transformers import AutoModelForCausalLM

    from tests.support.engines import _start_engine, engine_logprob_diff

    hf = AutoModelForCausalLM.from_pretrained(family_models["glm4_moe"], dtype=torch.float32).eval()
    server = _start_engine(family_models["glm4_moe"], tmp_path / "engine.log", "--random-seed", "0")
    try:
        diff = engine_logprob_diff(server.url, hf)
    finally:
        server.stop()
    print(f"glm4_moe: max |log-prob(torch engine) - log-prob(transformers)| = {diff:.3g}")
    assert diff <= 1e-4


def test_config_json_alone_gives_each_family_its_megatron_flags(family_models):
    from tests.support.trainers import trainer_args

    ds = trainer_args(family_models["deepseek_v3"], model_flags=[])
    mla = (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim, ds.qk_pos_emb_head_dim, ds.v_head_dim)
    assert ds.multi_latent_attention and ds.qk_layernorm and mla == (48, 32, 32, 16, 32)
    yarn = (ds.rope_type, ds.rotary_scaling_factor, ds.original_max_position_embeddings, ds.mscale_all_dim)
    assert yarn == ("yarn", 4.0, 128, 1.0)
    assert (ds.moe_router_num_groups, ds.moe_router_group_topk) == (2, 1)
    glm = trainer_args(family_models["glm4_moe"], model_flags=[])
    assert not glm.multi_latent_attention and glm.qk_layernorm and glm.add_qkv_bias
    assert glm.rotary_percent == 0.5 and not glm.rotary_interleaved
    for args in (ds, glm):
        assert args.moe_layer_freq == [0, 1]  # first_k_dense_replace 1
        assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
        assert (args.moe_router_topk_scaling_factor, args.moe_shared_expert_intermediate_size) == (2.5, 64)
        assert not args.moe_router_pre_softmax


@pytest.fixture(scope="module", params=FAMILIES)
def ep1(request, ray_cluster, family_models):
    return request.param, run_layout(family_models[request.param], 2, [], model_flags=[])


@pytest.mark.e2e
@pytest.mark.slow
def test_converts_bit_exact_matches_transformers_and_ep2_equals_ep1(ep1, family_models):
    arch, one = ep1
    model = family_models[arch]
    original = load_file(model / "model.safetensors")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in original
    assert_same_tensors(one["loaded"], original)
    diff = hf_logprob_diff(model, logprob_data(), one["log_probs"])
    assert diff <= 1e-4

    two = run_layout(model, 2, EP2, model_flags=[])
    parity = assert_layout_matches(two, one)  # every expert gathered over both ranks; loss, grad norm
    print(f"{arch}: |log-prob(Megatron) - log-prob(transformers)| {diff:.3g}; EP=2 vs EP=1: {parity}")
    # The trained bias stays the checkpoint's: --moe-router-bias-update-rate 0 (the engines route with it).
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(two["trained"][bias], original[bias])


@pytest.mark.e2e
@pytest.mark.slow
def test_multi_latent_attention_at_tp2_matches_transformers(ray_cluster, family_models):
    """The latent up projections split over each rank's heads; the down projections split and
    gathered before the latent norms; the experts over the expert tensor-parallel group."""
    from tests.support.trainers import tp2_forward

    exported, diff = tp2_forward(family_models["deepseek_v3"])
    assert_same_tensors(exported, load_file(family_models["deepseek_v3"] / "model.safetensors"))
    print(f"DeepSeek-V3 TP=2: max |log-prob(Megatron) - log-prob(transformers)| = {diff:.3g}")
    assert diff <= 1e-4


def test_multi_latent_attention_under_tp_needs_sequence_parallelism(tmp_path):
    """megatron-core's MLA without it sums the shared RoPE key's gradient over each rank's own heads
    only (measured on a one-layer model, whose only layer is dense: the down projection's update 59 %
    off the one-rank one)."""
    from slime.config.errors import ConfigError
    from slime.config.parser import build_parser, configure, explicit_dests
    from tests.support.trainers import trainer_args
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "mla", arch="deepseek_v3", num_layers=1, tie_word_embeddings=False)
    assert trainer_args(model, model_flags=[]).moe_layer_freq == [0]  # no MoE layer: MLA alone refuses
    argv = ["--hf-checkpoint", str(model), "--debug-train-only", "--loss-type", "sft_loss", "--lr", "1e-3",
            "--rollout-batch-size", "8", "--num-rollout", "1", "--actor-num-gpus-per-node", "2",
            "--tensor-model-parallel-size", "2"]  # fmt: skip
    parser = build_parser()
    with pytest.raises(ConfigError) as error:
        configure(parser.parse_args(argv), explicit=explicit_dests(parser, argv))
    assert error.value.flag == "--tensor-model-parallel-size" and "--sequence-parallel" in str(error.value)


@pytest.mark.e2e
@pytest.mark.slow
def test_grpo_on_deepseek_v3_at_ep2_is_on_policy_and_every_engine_gets_every_tensor(
    ray_cluster, family_models, tiny_run_flags
):
    """Two GRPO rollouts through the loop ``train.py`` runs (engines serving the tiny DeepSeek-V3
    through transformers, EP = 2 over DP = 2: each rank holds two of the four experts, both gather
    them, only data-parallel rank 0 broadcasts). Step 0 is on policy (ppo_kl 0, trainer and engine
    log-probs agree) and after each push every engine tensor equals the trainer's."""
    import ray

    from slime.config.settings.run import RunSettings
    from slime.ray.loop import RolloutLoop
    from slime.ray.session import TrainingSession
    from slime.utils.http import get_json
    from tests.support.engines import engine_weights_equal

    flags = tiny_run_flags(
        *EP2, model_script=None, hf_checkpoint=family_models["deepseek_v3"], rollout_batch_size=2,
        rollout_num_gpus=2, actor_num_gpus_per_node=2, micro_batch_size=2, num_rollout=2,
        rollout_temperature="0.7", update_weight_buffer_size=64 * 1024, rm_type=None,
        custom_rm_path=f"{PLUGINS / 'length_reward.py'}:first_character_reward",
    )  # fmt: skip
    args = parse_args(flags)
    with TrainingSession(RunSettings.from_args(args)) as session, RolloutLoop(session) as loop:
        for rollout_id in loop.rollout_ids():
            batch = loop.generate(rollout_id)
            versions = batch.data["weight_versions"]
            assert {v for per_sample in versions for v in per_sample} == {str(rollout_id + 1)}
            metrics = loop.train(batch)
            if rollout_id == 0:
                print({key: value for key, value in metrics.items() if key.startswith("train/")})
                assert metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
                assert metrics["train/train_rollout_logprob_abs_diff"] <= 1e-3
                assert metrics["train/grad_norm"] > 0  # the rewards differ within groups: it trains
            pushed = session.push_weights(loop.version)  # what loop.push_weights does, with its metrics
            expected = session.trainer.hf_state_dict()
            assert any(".mlp.experts.3.down_proj." in name for name in expected)
            # One sender: the bytes of every tensor once (two senders would count them twice).
            assert pushed["update_weights_bytes"] == sum(
                t.numel() * t.element_size() for t in expected.values()
            )
            for url in ray.get(session.rollout.engine_urls.remote()):
                assert get_json(f"{url}/model_info")["weight_version"] == str(loop.version)
                engine_weights_equal(url, expected)


def test_multi_token_prediction_layers_are_found_and_left_unread():
    from slime.backends.megatron.hf_checkpoint import unbuilt_layers

    names = ["model.layers.0.mlp.gate.weight", "model.layers.60.self_attn.o_proj.weight"]
    names += [
        "model.layers.61.enorm.weight",
        "model.layers.61.mlp.experts.0.up_proj.weight",
        "lm_head.weight",
    ]
    assert unbuilt_layers(names, 61) == [61]
    assert unbuilt_layers(names, 62) == []
