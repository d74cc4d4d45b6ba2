"""HF <-> Megatron parameter conversion: one small module per architecture family, one registry."""

from __future__ import annotations

from slime.backends.megatron.conversion.base import ModelConverter
from slime.backends.megatron.conversion.deepseek_moe import DeepSeekMoeConverter, DeepSeekV3Converter
from slime.backends.megatron.conversion.glm4 import Glm4Converter
from slime.backends.megatron.conversion.llama_like import LlamaLikeConverter
from slime.backends.megatron.conversion.qwen2_5_vl import Qwen2_5_VLConverter
from slime.backends.megatron.conversion.qwen3_moe import Qwen3MoeConverter

_CONVERTERS: dict[str, type[ModelConverter]] = {
    "llama": LlamaLikeConverter,
    "qwen2": LlamaLikeConverter,
    "qwen3": LlamaLikeConverter,
    "qwen2_5_vl": Qwen2_5_VLConverter,
    "qwen2_moe": Qwen3MoeConverter,
    "qwen3_moe": Qwen3MoeConverter,
    "glm4": Glm4Converter,
    "glm4_moe": DeepSeekMoeConverter,
    "deepseek_v3": DeepSeekV3Converter,
    "kimi_k2": DeepSeekV3Converter,
}


def get_converter(model_type: str, **kwargs) -> ModelConverter:
    """The converter for an HF ``config.json`` ``model_type``; unknown types fail with the supported list."""
    try:
        cls = _CONVERTERS[model_type]
    except KeyError:
        supported = ", ".join(sorted(_CONVERTERS))
        raise ValueError(
            f"no HF<->Megatron converter for model_type {model_type!r}; supported: {supported}"
        ) from None
    return cls(**kwargs)


__all__ = ["ModelConverter", "get_converter"]
