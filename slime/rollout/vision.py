"""Images on the rollout side: from a sample's raw items to the token ids the trainer sees, the
processor tensors it trains on, and the ``image_data`` an engine is sent.

The processor runs once per image here, in the rollout process, and nowhere else decides how an image
is resized: each image is resized to the grid the checkpoint's processor would pick (``smart_resize``
under the processor's or the item's ``min_pixels`` / ``max_pixels``) *before* it is patched and before
it is encoded for the engine. The engine (SGLang or ours) then receives an image whose sides are
already multiples of the patch factor, its own resize is the identity, and the number of image tokens
it expands each placeholder to is the one the trainer's ids hold. ``check_expanded_length`` verifies
that on every reply.

Token ids travel in two forms. ``Sample.tokens`` holds the *expanded* ids (one ``<|image_pad|>`` per
merged patch), which is what the model's forward sees. A ``/generate`` request carries the *collapsed*
ids, one pad per image, which SGLang 0.5.19–0.5.23 expand themselves (``_expand_input_ids`` in
``srt/multimodal/processors/base_processor.py``; pre-expanded ids are refused there).
"""

from __future__ import annotations

import base64
import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime.rollout.errors import RolloutError
from slime.rollout.prompt_files import IMAGE_PLACEHOLDER
from slime.rollout.tokenizer_cache import load_tokenizer

if TYPE_CHECKING:
    import torch


class ImageError(ValueError):
    """An image item that cannot be decoded or processed (the sample fails; the rollout goes on)."""


@dataclass(frozen=True)
class VisionTokens:
    """The special tokens that frame an image in a Qwen-VL-style prompt, and the patch merge factor."""

    image_pad_id: int
    vision_start_id: int
    vision_end_id: int
    merge_size: int
    image_block: str
    """``<|vision_start|><|image_pad|><|vision_end|>``: one image, before expansion."""


@dataclass
class EncodedImages:
    """A sample's images as the processor made them, in placeholder order."""

    pixel_values: torch.Tensor
    """``[sum of patches, C·T·P·P]`` float32."""
    image_grid_thw: torch.Tensor
    """``[n_images, 3]`` int64: temporal, height and width patches of each image."""
    data_urls: list[str]
    """Each resized image as a PNG data URL: what the engine is sent."""
    token_counts: list[int]
    """Image pad tokens each image expands to (its patches over ``merge_size²``)."""

    def train_inputs(self) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


class VisionProcessor:
    """The checkpoint's tokenizer and image processor (PIL backend: no torchvision)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoImageProcessor

        config = json.loads((Path(path) / "config.json").read_text())
        missing = [
            k for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k not in config
        ]
        if "vision_config" not in config or missing:
            raise ImageError(
                f"{path}/config.json is not a Qwen-VL-style vision-language model (no vision_config or "
                f"no {', '.join(missing)}); --multimodal-keys needs one"
            )
        self.tokenizer = load_tokenizer(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
        ids = (config["image_token_id"], config["vision_start_token_id"], config["vision_end_token_id"])
        pad, start, end = self.tokenizer.convert_ids_to_tokens(list(ids))
        self.tokens = VisionTokens(
            *ids, merge_size=int(self.image_processor.merge_size), image_block=start + pad + end
        )
        self._factor = int(self.image_processor.patch_size) * self.tokens.merge_size
        size = self.image_processor.size
        self._pixels = (int(size["shortest_edge"]), int(size["longest_edge"]))

    def encode(self, items: list[Any]) -> EncodedImages:
        """Decodes, resizes and patches ``items`` (``Sample.multimodal_inputs["image"]`` entries);
        ``ImageError`` names the first item that fails."""
        pixel_values, grids, urls = [], [], []
        for index, item in enumerate(items):
            pixels = self._bounds(item)
            image, url = _prepared(_source(item), f"image {index}", self._factor, *pixels)
            patches = self.image_processor(
                images=[image],
                size={"shortest_edge": pixels[0], "longest_edge": pixels[1]},
                return_tensors="pt",
            )
            pixel_values.append(patches["pixel_values"].float())
            grids.append(patches["image_grid_thw"].long())
            urls.append(url)
        import torch

        grid = torch.cat(grids)
        counts = [int(n) // self.tokens.merge_size**2 for n in grid.prod(dim=-1)]
        return EncodedImages(torch.cat(pixel_values), grid, urls, counts)

    def data_urls(self, items: list[Any]) -> list[str]:
        """The resized images of ``items`` as PNG data URLs (cached: a multi-turn sample resends them)."""
        return [
            _prepared(_source(item), f"image {i}", self._factor, *self._bounds(item))[1]
            for i, item in enumerate(items)
        ]

    def _bounds(self, item: Any) -> tuple[int, int]:
        """``min_pixels`` / ``max_pixels`` of an item: its own, else the processor's."""
        own = item if isinstance(item, dict) else {}
        return own.get("min_pixels") or self._pixels[0], own.get("max_pixels") or self._pixels[1]

    def expand(self, text_ids: list[int], counts: list[int]) -> list[int]:
        """``text_ids`` with its ``i``-th image pad repeated ``counts[i]`` times (SGLang's expansion)."""
        pad = self.tokens.image_pad_id
        found = text_ids.count(pad)
        if found != len(counts):
            raise ImageError(
                f"the prompt has {found} image placeholder(s) but {len(counts)} image(s); write one "
                f"{IMAGE_PLACEHOLDER} per image"
            )
        expanded: list[int] = []
        images = iter(counts)
        for token in text_ids:
            expanded.extend([pad] * next(images) if token == pad else [token])
        return expanded

    def encode_text(self, text: str) -> list[int]:
        """Ids of ``text`` with each ``<image>`` as one image block (pads not yet expanded)."""
        text = text.replace(IMAGE_PLACEHOLDER, self.tokens.image_block)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def collapse(self, ids: list[int], num_images: int) -> list[int]:
        """Expanded ids -> one pad per image, as a ``/generate`` request carries them. An image's pads
        are the run right after a ``<|vision_start|>``; there must be ``num_images`` runs. A pad
        anywhere else (a model may sample one) raises: SGLang would take it for an image placeholder."""
        pad, start = self.tokens.image_pad_id, self.tokens.vision_start_id
        collapsed: list[int] = []
        runs, in_image = 0, False
        for position, token in enumerate(ids):
            if token != pad:
                in_image = False
                collapsed.append(token)
            elif position and ids[position - 1] == start:
                runs, in_image = runs + 1, True
                collapsed.append(token)
            elif not in_image:
                raise ImageError(
                    f"token {position} is an image pad outside an image (the model sampled it); an engine "
                    "would take it for an image placeholder, so the sample cannot go on"
                )
        if runs != num_images:
            raise ImageError(f"{runs} runs of image tokens in the ids but {num_images} image(s) given")
        return collapsed


def _source(item: Any) -> str:
    return str(item["image"] if isinstance(item, dict) else item)


@functools.lru_cache(maxsize=256)
def _prepared(source: str, what: str, factor: int, min_pixels: int, max_pixels: int) -> tuple[Any, str]:
    """``source`` decoded to RGB, resized to the grid the processor picks (so that any later resize, the
    processor's or the engine's, is the identity), and that image as a PNG data URL."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    image = decode_image(source, what)
    try:
        height, width = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    except ValueError as error:
        raise ImageError(f"{what} ({image.width}x{image.height}): {error}") from None
    if (width, height) != image.size:
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return image, png_data_url(image)


@functools.cache
def vision_processor(path: str) -> VisionProcessor:
    """The processor of ``--hf-checkpoint`` (its tokenizer path), loaded once per process."""
    return VisionProcessor(path)


def decode_image(source: str, what: str) -> Any:
    """A path, a ``data:image/...;base64,`` URL or bare base64, as an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    is_path = not source.startswith("data:") and Path(source).is_file()
    shown = source if is_path or len(source) <= 60 else source[:57] + "..."
    try:
        if is_path:
            raw = Path(source).read_bytes()
        else:
            raw = base64.b64decode(
                source.split(",", 1)[1] if source.startswith("data:") else source, validate=True
            )
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        reason = "not an image format PIL reads"
    except (OSError, ValueError) as error:
        reason = str(error)
    raise ImageError(f"{what} ({shown!r}) cannot be decoded: {reason}")


def png_data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def check_expanded_length(expected: int, reply: dict[str, Any], index: int | None) -> None:
    """The engine expanded the request's images to as many tokens as the rollout's processor did; a
    difference means the engine resized the images otherwise, and the trainer would score other ids:
    the run stops (``RolloutError``, one line), as every later request would differ too."""
    got = reply.get("meta_info", {}).get("prompt_tokens")
    if got is not None and int(got) != expected:
        raise RolloutError(
            f"sample {index}: the engine expanded the prompt's images to {got} prompt tokens, the rollout's "
            f"processor to {expected}; the engine resizes images differently (SGLang: keep its image "
            "processor's min/max pixels those of the checkpoint's preprocessor_config.json)"
        )
