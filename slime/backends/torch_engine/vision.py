"""Images for a vision-language model (Qwen2.5-VL): what SGLang's tokenizer manager and multimodal
processor do to a /generate request with ``image_data`` before the scheduler sees it.

Facts mirrored from SGLang 0.5.19 and 0.5.23 (both the same unless said):

- ``srt/utils/common.py`` ``load_image``/``get_image_bytes``: an item is a ``data:`` URL, a file path
  (``file://...`` or starting with ``/``) or, anything else, base64 (strict). A decode failure is a
  ValueError that ``BaseMultimodalProcessor._load_single_item`` wraps as ``Error while loading data
  {data[:100]}...: Could not decode image: ...``; a missing file is not a client error there (a
  RuntimeError, which the HTTP server does not catch: 500 ``Internal Server Error``).
- ``srt/multimodal/processors/base_processor.py`` ``load_mm_data``: the prompt (``input_ids`` are
  decoded first) is split on Qwen's placeholder regex (``qwen_vl.py``:
  ``<|vision_start|>(<|image_pad|>)+<|vision_end|>``, and ``<image>`` from 0.5.23). With Qwen2.5-VL
  both releases take this uncached path (``auto_mm_preprocess_cache_size_mb = 0``; the artifact fast
  path is for Qwen3-VL only), and images are not resized before the HF image processor (``qwen_vl.py``
  resizes videos only). When the placeholder count equals the image
  count every image is loaded (``fast_load_mm_data``: a bad item answers 400 ``An exception occurred
  while loading IMAGE data at index i: ...``); otherwise ``legacy_load_mm_data`` walks the placeholders:
  images past the last placeholder are dropped, and a placeholder without an image fails (0.5.23: 400
  ``Prompt has N image placeholders but M image inputs were provided``; 0.5.19: a RuntimeError, 500).
- The HF processor checks that the prompt has one ``<|image_pad|>`` per image (transformers'
  ``ProcessorMixin``: a ValueError, 400), expands each to its image's token count
  ``t*h*w // merge_size**2`` and retokenizes; with ``input_ids`` given (``SGLANG_MM_AVOID_RETOKENIZE``,
  default on) the caller's ids are kept and ``_expand_input_ids`` expands the i-th pad id instead; its
  count mismatch (``prompt has N image placeholder token(s) but M image(s) were provided``) is only
  logged, and the retokenized ids are used ("falling back to decode+retokenize").
- meta_info gains ``image_tokens`` (the prompt's image tokens) for a request that has images
  (``tokenizer_manager.py`` ``_handle_batch_output``).

The image processor here is transformers' PIL backend (no torchvision); SGLang's may be the
torchvision one, whose pixel values can differ in the last bits. Prefilled KV rows are shared only
between requests with the same pictures (``ImageInputs.key``), as SGLang's radix cache keys image pad
tokens by the image hash (``MultimodalDataItem.set_pad_value``).

Positions are the model's own ``get_rope_index`` (3 rows: time, height, width); tokens after the prompt
are at ``index + rope_delta`` in all three rows, as in transformers' generation and SGLang's
``MRotaryEmbedding.get_next_input_positions``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slime.backends.torch_engine.protocol import ProtocolError, UnhandledError

logger = logging.getLogger(__name__)

VLM_MODEL_TYPES = ("qwen2_5_vl",)
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PLACEHOLDER_PATTERN = r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>"
LEGACY_SENTINEL = "<image>"  # also a placeholder from SGLang 0.5.23 on
IMAGE_PAD = "<|image_pad|>"


def is_vlm(config: Any) -> bool:
    return getattr(config, "model_type", None) in VLM_MODEL_TYPES


@dataclass
class ImageInputs:
    """A request's images as the model consumes them; kept for its whole life (a retracted request is
    prefilled again with them)."""

    pixel_values: torch.Tensor  # [patches, C*T*P*P]
    image_grid_thw: torch.Tensor  # int64 [n_images, 3]
    positions: torch.Tensor  # int64 [3, prompt length]: get_rope_index of the expanded prompt
    rope_delta: int  # position of token i >= prompt length is i + rope_delta (all rows)
    key: str  # content hash of the images: requests share a KV prefix only with the same pictures
    image_tokens: int

    def positions_for(self, length: int) -> torch.Tensor:
        """``[3, length]`` positions of the prompt followed by ``length - prompt`` generated tokens."""
        prompt = self.positions.shape[1]
        if length <= prompt:
            return self.positions[:, :length]
        tail = torch.arange(prompt, length, dtype=torch.long) + self.rope_delta
        return torch.cat([self.positions, tail[None].expand(3, -1)], dim=1)


def _short(data: str) -> str:
    return data[:100] + "..." if len(data) > 100 else data


def image_bytes(item: str) -> bytes:
    """SGLang's ``get_image_bytes``: data URL, file path, or strict base64."""
    if item.startswith("file://"):
        item = item.removeprefix("file://")
    if item.startswith("/"):
        return Path(item).read_bytes()
    encoded = item.split(",", 1)[1] if item.startswith("data:") else item
    return base64.b64decode(encoded, validate=True)


def load_image(item: Any) -> Any:
    """One image_data item as an RGB PIL image; raises ValueError (a client error) or OSError."""
    from PIL import Image

    if not isinstance(item, str):
        raise ValueError(f"Invalid image: {item}")
    try:
        data = image_bytes(item)
    except binascii.Error as exc:
        raise ValueError(str(exc)) from exc
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, SyntaxError) as exc:
        raise ValueError(f"Could not decode image: {exc}") from exc
    return image.convert("RGB") if image.mode != "RGB" else image


def _load_item(item: Any, index: int, legacy: bool) -> Any:
    """``_load_single_item`` and the loader around it: the message the client gets on failure."""
    where = "multimodal data" if legacy else f"IMAGE data at index {index}"
    prefix = f"An exception occurred while loading {where}: Error while loading data {_short(str(item))}"
    try:
        return load_image(item)
    except ValueError as exc:
        raise ProtocolError(f"{prefix}: {exc}") from exc
    except OSError as exc:  # not a client error in SGLang: a RuntimeError, which its server answers 500
        raise UnhandledError(f"{prefix}: {exc}") from exc


def expand_input_ids(original_ids: list[int], counts: list[int], placeholder_token_id: int) -> list[int]:
    """SGLang's ``_expand_input_ids``: the i-th placeholder id becomes ``counts[i]`` copies of it."""
    num_placeholders = sum(1 for t in original_ids if t == placeholder_token_id)
    if num_placeholders != len(counts):
        raise ValueError(
            f"prompt has {num_placeholders} image placeholder token(s) but "
            f"{len(counts)} image(s) were provided"
        )
    rebuilt: list[int] = []
    image = 0
    for token in original_ids:
        if token == placeholder_token_id:
            rebuilt.extend([placeholder_token_id] * counts[image])
            image += 1
        else:
            rebuilt.append(token)
    return rebuilt


class VisionProcessor:
    """The image processor (PIL backend: no torchvision) and the model's rope index, for one VLM."""

    def __init__(self, model_path: str, model: Any, tokenizer: Any, release_0_5_23: bool) -> None:
        """``model`` is the loaded ``Qwen2_5_VLForConditionalGeneration``: its config and rope index."""
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(
            model_path, local_files_only=True, backend="pil"
        )
        self.merge_size = int(self.image_processor.merge_size)
        self.tokenizer = tokenizer
        self.model = model
        self.image_token_id = int(model.config.image_token_id)
        self.release_0_5_23 = release_0_5_23  # see SglangRelease.multimodal_0_5_23
        pattern = PLACEHOLDER_PATTERN + ("|" + re.escape(LEGACY_SENTINEL) if release_0_5_23 else "")
        self.placeholder = re.compile(pattern)

    # ---- the tokenizer manager's part ---------------------------------------------------------------

    def _load(self, prompt: str, image_data: list[Any]) -> tuple[str, list[Any]]:
        """``load_mm_data``: the prompt with its placeholders rewritten and the loaded images."""
        parts = self.placeholder.split(prompt)
        found = self.placeholder.findall(prompt)
        if len(found) == len(image_data):
            return prompt, [_load_item(item, i, legacy=False) for i, item in enumerate(image_data)]
        if len(found) > len(image_data):
            logger.warning("Mismatch: More 'IMAGE' tokens found than corresponding data provided.")
            if not self.release_0_5_23:
                raise UnhandledError("An exception occurred while loading multimodal data: ")
            raise ProtocolError(
                f"Prompt has {len(found)} image placeholders but {len(image_data)} image inputs were provided"
            )
        images = [_load_item(item, i, legacy=True) for i, item in enumerate(image_data[: len(found)])]
        text = parts[0] + "".join(PLACEHOLDER + part for part in parts[1:])
        return text, images

    def prepare(
        self, text: str | None, input_ids: list[int] | None, image_data: list[Any]
    ) -> tuple[list[int], ImageInputs | None]:
        """The prompt's final ids and its images, or ``(ids, None)`` when no image is left."""
        prompt = text if text is not None else self.tokenizer.decode(input_ids)
        prompt, images = self._load(prompt, image_data)
        if not images:  # SGLang's text-only case: the caller's ids, or the text tokenized
            ids = input_ids if input_ids is not None else self.tokenizer(prompt)["input_ids"]
            return list(ids), None
        vision = self.image_processor(images=images, return_tensors="pt")
        grid = vision["image_grid_thw"].long()
        counts = [int(g.prod()) // self.merge_size**2 for g in grid]
        pads = prompt.count(IMAGE_PAD)
        if pads != len(images):  # the HF processor's own check
            raise ProtocolError(
                f"The total number of {IMAGE_PAD} tokens in the prompts should be the same as the number of "
                f"images passed. Found total {pads} {IMAGE_PAD} tokens and {len(images)} images."
            )
        pieces = prompt.split(IMAGE_PAD)
        expanded = pieces[0] + "".join(
            IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:], strict=True)
        )
        ids = self.tokenizer(expanded)["input_ids"]
        if input_ids is not None:
            try:
                ids = expand_input_ids(input_ids, counts, self.image_token_id)
            except ValueError as exc:
                logger.warning(
                    f"Due to {exc}, falling back to decode+retokenize, "
                    "which may change prompt length (token drift)."
                )
        return list(ids), self._inputs(ids, vision["pixel_values"], grid, sum(counts))

    def _inputs(
        self, ids: list[int], pixel_values: torch.Tensor, grid: torch.Tensor, tokens: int
    ) -> ImageInputs:
        input_ids = torch.tensor([ids], dtype=torch.long)
        types = (input_ids == self.image_token_id).int()
        positions, delta = self.model.model.get_rope_index(input_ids, types, image_grid_thw=grid)
        digest = hashlib.sha256()
        digest.update(grid.numpy().tobytes())
        digest.update(pixel_values.float().numpy().tobytes())
        return ImageInputs(
            pixel_values=pixel_values.float(),
            image_grid_thw=grid,
            positions=positions[:, 0].long(),
            rope_delta=int(delta.reshape(-1)[0]),
            key=digest.hexdigest(),
            image_tokens=tokens,
        )
