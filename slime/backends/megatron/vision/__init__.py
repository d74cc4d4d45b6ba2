"""Vision-language policies in megatron-core: a GPTModel whose first stage also holds the HF vision tower."""

from __future__ import annotations

from slime.backends.megatron.vision.qwen2_5_vl import (
    VisionLanguageModel,
    freeze_vision_tower,
    load_vlm_config,
)

__all__ = ["VisionLanguageModel", "freeze_vision_tower", "load_vlm_config"]
