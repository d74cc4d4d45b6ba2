"""GLM-4 dense (GLM-4-9B-0414, GLM-Z1-9B): the Llama-like decoder with two more norms per layer.

HF already stores the gated MLP fused, ``mlp.gate_up_proj`` = ``[gate; up]``, which is Megatron's
``linear_fc1`` layout, so it maps one to one. The norms of the attention and MLP outputs
(``post_self_attn_layernorm``, ``post_mlp_layernorm``) keep their names on both sides; HF's
``post_attention_layernorm`` is, as in Llama, the norm before the MLP. q/k/v (with their biases) fuse
into ``linear_qkv`` as in the Llama family.
"""

from __future__ import annotations

import torch

from slime.backends.megatron.conversion.base import HFGetter, split_layer_name
from slime.backends.megatron.conversion.llama_like import LlamaLikeConverter

# Megatron name (inside a layer) -> HF name, for what differs from the Llama family.
_GLM4_LAYER = {
    "post_self_attn_layernorm.weight": "post_self_attn_layernorm.weight",
    "post_mlp_layernorm.weight": "post_mlp_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
}


class Glm4Converter(LlamaLikeConverter):
    def megatron_from_hf(self, name: str, hf: HFGetter) -> torch.Tensor:
        layer, rest = split_layer_name(name)
        if layer is not None and rest in _GLM4_LAYER:
            return hf(f"model.layers.{layer}.{_GLM4_LAYER[rest]}")
        return super().megatron_from_hf(name, hf)

    def hf_from_megatron(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        layer, rest = split_layer_name(name)
        if layer is not None and rest in _GLM4_LAYER:
            return [(f"model.layers.{layer}.{_GLM4_LAYER[rest]}", tensor)]
        return super().hf_from_megatron(name, tensor)
