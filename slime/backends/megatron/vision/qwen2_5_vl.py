"""Qwen2.5-VL as a megatron-core policy: the language model is a GPTModel (so its parameters keep the
names every converter, shard and checkpoint path knows) with multimodal RoPE, and the first pipeline
stage also holds transformers' own vision tower under ``visual.``, named exactly as the HF checkpoint
names it (its weights load and export one to one and are replicated over tensor-parallel ranks).

The forward pass is Qwen2.5-VL's: the token embeddings, the tower's merged patch features written at
the images' pad positions (the batching's ``image_mask``; images in row order), then the decoder with
3-D positions ``[3, b, s]`` (time, height, width; ``get_rope_index``'s semantics). The features are
written on the full sequence, and only then split for sequence parallelism.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig


def load_vlm_config(hf_checkpoint: str | Path) -> Any:
    """The checkpoint's transformers config (``Qwen2_5_VLConfig``): its ``vision_config`` builds the
    tower and its ``image_token_id`` says where the features go."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_checkpoint), local_files_only=True)
    if getattr(config, "vision_config", None) is None or getattr(config, "image_token_id", None) is None:
        raise ValueError(
            f"{hf_checkpoint} is not a vision-language checkpoint (no vision_config / image_token_id), "
            "but the model flags ask for multimodal RoPE (--position-embedding-type mrope)"
        )
    return config


def _vision_tower(vision_config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Qwen2.5-VL vision transformer, randomly initialised (the checkpoint is loaded
    next). SDPA attention: what transformers picks by default on every device, so both compute alike."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel._from_config(
        vision_config, attn_implementation="sdpa", dtype=dtype
    )


class VisionLanguageModel(GPTModel):
    """A GPTModel with multimodal RoPE and, on the first pipeline stage, the vision tower ``visual``.

    ``forward(input_ids, position_ids, attention_mask, ..., pixel_values=None, image_grid_thw=None,
    image_mask=None)``: ``position_ids`` is int64 ``[3, b, s]`` (for a packed THD row, b = 1 and each
    sequence's positions start at its own origin); ``pixel_values`` / ``image_grid_thw`` are those of
    the images whose pad tokens occur in ``input_ids``, concatenated in row order (None when there are
    none); ``image_mask`` (``[b, s]``) marks those pads (default: every ``image_token_id``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        vision_config: Any,
        image_token_id: int,
        position_embedding_type: str = "mrope",
        **gpt_kwargs: Any,
    ) -> None:
        if position_embedding_type != "mrope":
            raise ValueError(f"Qwen2.5-VL's RoPE is multimodal (mrope), not {position_embedding_type}")
        super().__init__(
            config,
            position_embedding_type="mrope",
            # The image features replace token embeddings at positions anywhere in the sequence, so the
            # sequence-parallel split waits until they are written (``embed``).
            scatter_embedding_sequence_parallel=False,
            **gpt_kwargs,
        )
        self.image_token_id = image_token_id
        self.visual = _vision_tower(vision_config, config.params_dtype) if self.pre_process else None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        *args: Any,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            # megatron-core's MRoPE would fail deep inside; text-only rows need the three rows too.
            raise ValueError(f"MRoPE positions are [3, b, s], got {tuple(position_ids.shape)}")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, image_mask)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[s, b, h]`` decoder input (this rank's sequence slice under sequence parallelism): token
        embeddings with the images' features at their pad tokens: ``image_mask`` (``[b, s]``, the
        batching's image spans) where given, else every image pad token. A pad the policy sampled
        outside an image is a token, as it was for the engine that sampled it."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], full sequence
        if pixel_values is not None:
            assert self.visual is not None  # built on the first stage, the only one that embeds
            if image_grid_thw is None:
                raise ValueError("pixel_values were given without image_grid_thw")
            tower_dtype: torch.dtype = self.visual.dtype  # type: ignore[assignment]  # PreTrainedModel.dtype
            pixels = pixel_values.to(device=embeddings.device, dtype=tower_dtype)
            features = self.visual(pixels, grid_thw=image_grid_thw).pooler_output
            pads = image_mask if image_mask is not None else input_ids == self.image_token_id  # [b, s]
            if int(pads.sum()) != features.shape[0]:
                raise ValueError(
                    f"{int(pads.sum())} image tokens (id {self.image_token_id}) in the micro-batch but "
                    f"its images give {features.shape[0]} features (image_grid_thw {image_grid_thw.tolist()})"
                )
            rows = embeddings.transpose(0, 1).masked_scatter(
                pads.unsqueeze(-1), features.to(embeddings.dtype)
            )
            embeddings = rows.transpose(0, 1).contiguous()
        elif self.training and torch.is_grad_enabled():
            embeddings = embeddings + self._untouched_tower()
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        return embeddings

    def _untouched_tower(self) -> torch.Tensor | float:
        """Zero, depending on one element of every trainable tower parameter. With
        ``--overlap-grad-reduce`` megatron-core's DDP counts at its first step which gradient hooks
        fire and at every later step waits for them all before it reduces a bucket: a step whose last
        micro-batch had no image would fail ("Communication call has not been issued")."""
        params = [p for p in self.visual.parameters() if p.requires_grad] if self.visual is not None else []
        if not params:
            return 0.0
        return torch.stack([p.reshape(-1)[0].float() for p in params]).sum() * 0.0

    def _apply(self, fn: Any, recurse: bool = True) -> VisionLanguageModel:
        """Keeps the tower's RoPE frequencies (a non-persistent buffer) in fp32 when the model is cast
        to bf16/fp16 (``Float16Module``), as transformers and the engines keep them."""
        rotary: Any = self.visual.rotary_pos_emb if self.visual is not None else None
        kept: torch.Tensor | None = rotary.inv_freq if rotary is not None else None
        super()._apply(fn, recurse)
        if rotary is not None and kept is not None and rotary.inv_freq.dtype != kept.dtype:
            rotary.inv_freq = kept.to(rotary.inv_freq.device)
        return self


def freeze_vision_tower(chunks: list[torch.nn.Module]) -> None:
    """``--freeze-vision-tower``: the tower's parameters take no gradient, so megatron-core's DDP gives
    them no gradient buffer and the optimizer no state, and they stay as loaded."""
    for chunk in chunks:
        visual = getattr(chunk, "visual", None)
        if visual is not None:
            visual.requires_grad_(False)
