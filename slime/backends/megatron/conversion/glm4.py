"""GLM-4 dense (GLM-4-9B-0414, GLM-Z1-9B): the Llama-like decoder with two more norms per layer.

HF already stores the gated MLP fused, ``mlp.gate_up_proj`` = ``[gate; up]``, which is Megatron's
``linear_fc1`` layout, so it maps one to one. The norms of the attention and MLP outputs
(``post_self_attn_layernorm``, ``post_mlp_layernorm``) keep their names on both sides; HF's
``post_attention_layernorm`` is, as in Llama, the norm before the MLP. q/k/v (with their biases) fuse
into ``linear_qkv`` as in the Llama family.
"""

from __future__ import annotations

from typing import ClassVar

from slime.backends.megatron.conversion.llama_like import LlamaLikeConverter


class Glm4Converter(LlamaLikeConverter):
    LAYER_NAMES: ClassVar[dict[str, str]] = {
        **LlamaLikeConverter.LAYER_NAMES,
        "post_self_attn_layernorm.weight": "post_self_attn_layernorm.weight",
        "post_mlp_layernorm.weight": "post_mlp_layernorm.weight",
        "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    }
