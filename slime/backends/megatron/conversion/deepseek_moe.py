"""DeepSeek-V3's MoE (also Kimi-K2, Moonlight, and GLM-4.5's ``glm4_moe``), with or without
multi-latent attention.

The experts and their fused ``[gate; up]`` are Qwen3-MoE's (``qwen3_moe``); what differs is named
here. The shared experts are one gated MLP under ``mlp.shared_experts`` (plural, no sigmoid gate),
and the router has a score bias (``mlp.gate.e_score_correction_bias``, Megatron's
``mlp.router.expert_bias`` buffer) that picks the experts without weighting them. Dense layers
(``first_k_dense_replace``) are the dense family's. GLM-4.5's attention is the dense family's with
q/k norms; DeepSeek-V3's multi-latent attention maps one to one, because Megatron keeps HF's
layouts: ``linear_kv_down_proj`` is ``kv_a_proj_with_mqa`` (the latent, then the shared RoPE key),
``linear_kv_up_proj`` is ``kv_b_proj`` (per head: the key without RoPE, then the value) and
``linear_q_up_proj`` is ``q_b_proj`` (per head: without RoPE, then with). Transformer Engine fuses
the latent norms into the up projections (``layer_norm_weight``). Multi-token-prediction layers
(``model.layers.<num_hidden_layers>...``) are not built, so they are never read.
"""

from __future__ import annotations

from typing import ClassVar

from slime.backends.megatron.conversion.qwen3_moe import Qwen3MoeConverter

# Megatron name (inside a layer) -> HF name, for the tensors that map one to one.
_MLA = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",  # q_lora_rank null
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}


class DeepSeekMoeConverter(Qwen3MoeConverter):
    """GLM-4.5: the dense family's attention (q/k norms, q/k/v bias) with DeepSeek's MoE."""

    SHARED = "mlp.shared_experts."
    LAYER_NAMES: ClassVar[dict[str, str]] = {
        **Qwen3MoeConverter.LAYER_NAMES,
        "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
        "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    }


class DeepSeekV3Converter(DeepSeekMoeConverter):
    """DeepSeek-V3, Kimi-K2, Moonlight: DeepSeek's MoE with multi-latent attention (whose latent norms
    take the names the dense family's q/k norms have on the Megatron side)."""

    LAYER_NAMES: ClassVar[dict[str, str]] = {**DeepSeekMoeConverter.LAYER_NAMES, **_MLA}
