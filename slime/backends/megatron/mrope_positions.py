"""Qwen2.5-VL's multimodal RoPE positions (MRoPE) of one sequence, and where its images lie.

A VLM rotates every token by three positions, temporal, height and width. A text token advances all
three together, by one; an image's ``t*h*w / merge**2`` pad tokens (after ``<|vision_start|>``) get
the grid positions of their merged patches, offset by the position the image starts at, and the text
after the image continues one past the largest of them. The trainer must give the model exactly the
positions the engine used when it sampled, so this follows transformers 5.25's ``get_rope_index``
(``Qwen2_5_VLModel``); SGLang's (``mrope_rope_index.get_rope_index``) is the same for still
images. Videos are refused: their temporal positions depend on the frame rate, which no train input
carries.

Image blocks are found where the grids say: the ``i``-th run of pad tokens that directly follows a
``<|vision_start|>`` is the ``i``-th image and must hold exactly its token count. Once the sample's
images are used up, every further token is text, as for the engine, which advances the positions of
generated tokens by one whatever they are (a tiny random model samples ``<|image_pad|>`` often).

Pure torch, like ``batching``, which lays these positions out in micro-batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MROPE_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
"""HF ``model_type``s whose positions are these (Qwen2-VL's ``get_rope_index`` is the same for images)."""


@dataclass(frozen=True)
class MropeConfig:
    """The token ids and merge size MRoPE positions depend on, read once from the HF config."""

    image_token_id: int
    vision_start_token_id: int
    spatial_merge_size: int


def mrope_config(hf_config: dict[str, Any]) -> MropeConfig | None:
    """The MRoPE ids of an HF ``config.json`` (as a dict); None for a text model (no ``vision_config``).

    Qwen2.5-VL keeps ``image_token_id`` and ``vision_start_token_id`` at the top level and
    ``spatial_merge_size`` in ``vision_config``; another VLM is refused rather than given positions it
    was not trained with. Videos are not read (``--multimodal-keys`` takes images): a video pad in a
    sequence was sampled by the policy and is a token with a text position, as the engine gave it."""
    if "vision_config" not in hf_config:
        return None
    model_type = hf_config.get("model_type")
    if model_type not in MROPE_MODEL_TYPES:
        known = ", ".join(MROPE_MODEL_TYPES)
        raise ValueError(f"no multimodal RoPE positions for model_type {model_type!r} (known: {known})")
    keys = ("image_token_id", "vision_start_token_id")
    missing = [key for key in keys if key not in hf_config]
    if missing or "spatial_merge_size" not in hf_config["vision_config"]:
        raise ValueError(f"{model_type} config lacks {missing or ['vision_config.spatial_merge_size']}")
    return MropeConfig(
        image_token_id=int(hf_config["image_token_id"]),
        vision_start_token_id=int(hf_config["vision_start_token_id"]),
        spatial_merge_size=int(hf_config["vision_config"]["spatial_merge_size"]),
    )


def read_mrope_config(hf_checkpoint: str | Path) -> MropeConfig | None:
    """:func:`mrope_config` of an HF checkpoint directory's ``config.json``."""
    return mrope_config(json.loads((Path(hf_checkpoint) / "config.json").read_text()))


def _grid_sizes(image_grid_thw: torch.Tensor, merge: int) -> list[tuple[int, int, int]]:
    """Each image's merged grid ``(t, h / merge, w / merge)``; refuses video grids (``t > 1``)."""
    grids = torch.as_tensor(image_grid_thw, dtype=torch.long).reshape(-1, 3).tolist()
    sizes = []
    for i, (t, h, w) in enumerate(grids):
        if t != 1:
            raise ValueError(f"image {i} has grid {[t, h, w]}: t > 1 is a video; videos are not supported")
        if h % merge or w % merge:
            raise ValueError(f"image {i} has grid {[t, h, w]}, not a multiple of spatial_merge_size {merge}")
        sizes.append((t, h // merge, w // merge))
    return sizes


def _image_blocks(
    ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> list[tuple[int, int, tuple[int, int, int]]]:
    """``(start, end, merged grid)`` of each image's pad tokens in ``ids``, in the order of
    ``image_grid_thw``.

    Fails when the pads do not match the grids: fewer image blocks than images, or a block whose length
    is not its image's ``t*h*w / merge**2`` (a processor and a tokenizer that disagree)."""
    if image_grid_thw is None:
        return []
    sizes = _grid_sizes(image_grid_thw, spatial_merge_size)
    pad = ids == image_token_id
    after_start = torch.zeros_like(pad)
    after_start[1:] = ids[:-1] == vision_start_token_id
    starts = (pad & after_start).nonzero().flatten().tolist()
    if len(starts) < len(sizes):
        raise ValueError(f"{len(sizes)} images but {len(starts)} image blocks (<|vision_start|> then pads)")
    blocks = []
    for i, (start, size) in enumerate(zip(starts, sizes, strict=False)):
        end = start + size[0] * size[1] * size[2]
        run = pad[start:end]
        if len(run) < end - start or not bool(run.all()) or (end < len(ids) and bool(pad[end])):
            found = int(pad[start:].int().cumprod(0).sum())
            raise ValueError(f"image {i} has {end - start} tokens by its grid but {found} pads at {start}")
        blocks.append((start, end, size))
    return blocks


def mrope_positions(
    tokens: torch.Tensor | list[int],
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """int64 ``[3, len(tokens)]``: the temporal, height and width positions of one sequence.

    ``image_grid_thw`` (``[n_images, 3]``, None or empty for a text sequence, which then gets
    ``arange`` in all three rows) gives the sequence's images in the order their pads occur."""
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    blocks = _image_blocks(ids, image_grid_thw, image_token_id, vision_start_token_id, spatial_merge_size)
    positions = torch.empty(3, len(ids), dtype=torch.long)
    offset, text_from = 0, 0  # the next text position; where the current text run starts
    for start, end, (t, h, w) in blocks:
        positions[:, text_from:start] = torch.arange(start - text_from) + offset
        offset += start - text_from
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        positions[:, start:end] = torch.stack(grid).reshape(3, -1) + offset
        offset += max(h, w)  # one past the image's largest position (t == 1)
        text_from = end
    positions[:, text_from:] = torch.arange(len(ids) - text_from) + offset
    return positions


def image_spans(
    tokens: torch.Tensor | list[int],
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> list[tuple[int, int]]:
    """``[start, end)`` of each image's pad tokens in ``tokens``, in the order of ``image_grid_thw``:
    which images a slice of the sequence holds (the batching puts a shared prompt's images once)."""
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    blocks = _image_blocks(ids, image_grid_thw, image_token_id, vision_start_token_id, spatial_merge_size)
    return [(start, end) for start, end, _ in blocks]
