"""Qwen2.5-VL: Qwen2's language model (q/k/v biases) under the HF names transformers 5 saves and SGLang
loads (``model.embed_tokens``, ``model.layers.N``, ``model.norm``, ``lm_head``), plus the vision tower.

The tower is transformers' own module inside the Megatron model (``slime.backends.megatron.vision``),
named there as in the checkpoint (``visual.blocks.0.attn.qkv.weight`` ...) and never split over
tensor-parallel ranks, so its tensors map one to one in both directions.
"""

from __future__ import annotations

import torch

from slime.backends.megatron.conversion.base import HFGetter
from slime.backends.megatron.conversion.llama_like import LlamaLikeConverter

VISION_PREFIX = "visual."


class Qwen2_5_VLConverter(LlamaLikeConverter):
    def megatron_from_hf(self, name: str, hf: HFGetter) -> torch.Tensor:
        if name.startswith(VISION_PREFIX):
            return hf(name)
        return super().megatron_from_hf(name, hf)

    def hf_from_megatron(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name.startswith(VISION_PREFIX):
            return [(name, tensor)]
        return super().hf_from_megatron(name, tensor)
