"""The HF model behind the engine: loading, batched prefill and decode forwards over the slot KV cache.

The model is an unmodified `transformers.AutoModelForCausalLM` (`AutoModelForImageTextToText` for a
vision-language model: its prefill also takes the images, see vision.py); everything engine-specific is
in the inputs we hand it: explicit `position_ids` per row and a ready 4D additive attention mask (transformers
returns a 4D mask as is), so rows of different lengths share one forward without any left padding.
Sliding-window layers are not windowed by this mask; models that need it are outside this engine's
scope (it warns at load time).
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch

from slime.backends.torch_engine import vision
from slime.backends.torch_engine.kv_cache import SlotKVCache
from slime.backends.torch_engine.lora import Adapter, LoraManager
from slime.backends.torch_engine.routed_experts import RoutedExpertsCapture

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
    """SGLang's `--dtype` names; `auto` is fp32 on CPU (exact logprobs) and the checkpoint's dtype on GPU."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu" or config_dtype not in (torch.bfloat16, torch.float16):
        return torch.float32
    return config_dtype


class ModelRunner:
    """Owns the model, the tokenizer and the KV cache; every method runs on the scheduler thread."""

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None,
        device: torch.device,
        dtype_name: str,
        max_rows: int,
        context_length: int | None,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        self.model_path = str(Path(model_path).resolve())
        self.tokenizer_path = str(Path(tokenizer_path or model_path).resolve())
        self.device = device
        config = AutoConfig.from_pretrained(
            self.model_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = DTYPES.get(config_dtype)
        self.dtype = resolve_dtype(dtype_name, device, config_dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.tokenizer_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        # A VLM's checkpoint loads with its image-text class (Qwen2_5_VLForConditionalGeneration), whose
        # forward takes pixel values and 3-row (time, height, width) positions.
        self.is_vlm = vision.is_vlm(config)
        model_class = AutoModelForImageTextToText if self.is_vlm else AutoModelForCausalLM
        model = model_class.from_pretrained(
            self.model_path,
            dtype=self.dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            attn_implementation="sdpa",
        )
        self.model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapped .to
        self.config = model.config
        text_config = (
            self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        )
        layer_types = getattr(text_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            logger.warning(
                "model has non-full attention layers %s; they run as full attention", set(layer_types)
            )
        self.vocab_size = int(text_config.vocab_size)
        configured_length: int = getattr(text_config, "max_position_embeddings", 4096)
        self.context_length = int(context_length or configured_length)
        self.num_layers = int(text_config.num_hidden_layers)
        self.cache = SlotKVCache(self.num_layers, max_rows=max_rows, max_columns=self.context_length)
        self.eos_token_ids = self._eos_token_ids()
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._mask_min = torch.finfo(self.dtype).min
        self.lora: LoraManager | None = None  # set by the engine with --enable-lora
        # With --enable-return-routed-experts: the routers' hooks, and the rows of the last forward that
        # recorded them (one ``[positions, layers, topk]`` tensor per row of its batch).
        self.routes: RoutedExpertsCapture | None = None
        self.last_routes: list[torch.Tensor] = []

    def _eos_token_ids(self) -> set[int]:
        """EOS ids as SGLang collects them: model config, generation config and the tokenizer."""
        ids: set[int] = set()
        sources = [getattr(self.config, "eos_token_id", None), self.tokenizer.eos_token_id]
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            sources.append(generation_config.eos_token_id)
        for value in sources:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    # ---- forwards -------------------------------------------------------------------------------

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        keep,
        adapters: list[Adapter | None] | None = None,
        **images,
    ) -> torch.Tensor:
        kwargs = {
            "input_ids": None if "inputs_embeds" in images else input_ids,
            "position_ids": positions,
            "attention_mask": mask,
            self._cache_kwarg: self.cache,
            "use_cache": True,
            "logits_to_keep": keep,
            **images,
        }
        if self.lora is None or not any(adapters or []):
            return self.model(**kwargs).logits
        with self.lora.rows(adapters):
            return self.model(**kwargs).logits

    def _vlm_prefill_inputs(
        self, ids: torch.Tensor, pads: list[int], images: list[vision.ImageInputs | None]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """3-row positions ``[3, rows, width]`` (left pads at 0) and the input embeddings with each row's
        image features written over its prompt's image pads. Only the prompt's pads are images: a pad
        the model sampled later (a retracted request is prefilled again with its output) is a token,
        as it was when it was decoded; transformers' own scatter would count it as one more image."""
        rows, width = ids.shape
        positions = torch.zeros((3, rows, width), dtype=torch.long)
        embeds = self.model.get_input_embeddings()(ids)
        for row, (pad, mm) in enumerate(zip(pads, images, strict=True)):
            length = width - pad
            positions[:, row, pad:] = (
                mm.positions_for(length) if mm is not None else torch.arange(length)[None].expand(3, -1)
            )
            if mm is None:
                continue
            features = self.model.get_image_features(
                mm.pixel_values.to(self.device, self.dtype), mm.image_grid_thw.to(self.device)
            ).pooler_output
            prompt = ids[row, pad : pad + mm.positions.shape[1]]
            where = (prompt == self.config.image_token_id).nonzero().squeeze(-1) + pad
            embeds[row, where] = torch.cat(features).to(embeds.dtype)
        return positions.to(self.device), {"inputs_embeds": embeds}

    @torch.inference_mode()
    def prefill(
        self,
        sequences: list[list[int]],
        start_row: int,
        all_logits: bool,
        images: list[vision.ImageInputs | None] | None = None,
        adapters: list[Adapter | None] | None = None,
        record_routes: bool = False,
    ) -> list[torch.Tensor]:
        """Run the prompts of the new slots `start_row ..`; return per row logits (fp32).

        Rows are left-padded to a common width, so the logits after every row's last token are the last
        column (pad queries attend to nothing and are discarded). Each entry is `[len, vocab]` when
        `all_logits` (prompt logprobs are wanted) else `[vocab]`. A VLM takes each row's images (None for
        a text row) and 3-row positions; with LoRA each row's adapter applies (None: the base model).
        With ``record_routes`` the routed experts of every row's positions are in ``last_routes``.
        """
        n = len(sequences)
        width = max(len(s) for s in sequences)
        pads = [width - len(s) for s in sequences]
        ids = torch.zeros((n, width), dtype=torch.long)
        for row, (seq, pad) in enumerate(zip(sequences, pads, strict=True)):
            ids[row, pad:] = torch.tensor(seq, dtype=torch.long)
        columns = torch.arange(width, device=self.device)
        pad_t = torch.tensor(pads, device=self.device)
        allowed = (columns[None, :] <= columns[:, None])[None] & (
            columns[None, None, :] >= pad_t[:, None, None]
        )
        mask = torch.zeros((n, 1, width, width), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed[:, None], self._mask_min)
        positions = (columns[None, :] - pad_t[:, None]).clamp(min=0)
        extra: dict[str, torch.Tensor] = {}
        if self.is_vlm:
            positions, extra = self._vlm_prefill_inputs(ids.to(self.device), pads, images or [None] * n)
        self.cache.set_prefill(start_row, start_row + n, width, pads)
        keep = 0 if all_logits else 1
        self._start_routes(record_routes, n * width)
        logits = self._forward(ids.to(self.device), positions, mask, keep, adapters, **extra).float()
        if record_routes:
            rows = self._finish_routes()
            rows = rows.view(n, width, *rows.shape[1:])
            self.last_routes = [rows[row, pad:] for row, pad in enumerate(pads)]
        if all_logits:
            return [logits[row, pad:] for row, pad in enumerate(pads)]
        return list(logits[:, -1])

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_length: int,
        rope_deltas: list[int] | None = None,
        adapters: list[Adapter | None] | None = None,
        record_routes: bool = False,
    ) -> torch.Tensor:
        """One token for each slot `0 .. n-1` at `positions` (all < `kv_length`); `[n, vocab]` fp32 logits.

        `positions` are cache columns; a VLM's rotary positions are `position + rope_delta` of each row's
        images (0 for text), the same in all three rows. With ``record_routes`` each row's routed
        experts (``[1, layers, topk]``) are in ``last_routes``."""
        n = tokens.shape[0]
        self.cache.set_decode(n, positions, kv_length)
        columns = torch.arange(kv_length, device=self.device)
        mask = torch.zeros((n, 1, 1, kv_length), dtype=self.dtype, device=self.device)
        mask.masked_fill_((columns[None, :] > positions[:, None])[:, None, None, :], self._mask_min)
        rope = positions[:, None]
        if self.is_vlm:
            deltas = torch.tensor(rope_deltas or [0] * n, dtype=torch.long, device=self.device)
            rope = (rope + deltas[:, None])[None].expand(3, -1, -1)
        self._start_routes(record_routes, n)
        logits = self._forward(tokens[:, None], rope, mask, 1, adapters)
        if record_routes:
            self.last_routes = list(self._finish_routes()[:, None])
        return logits[:, -1].float()

    def _start_routes(self, record: bool, tokens: int) -> None:
        if record:
            assert self.routes is not None  # requests ask for routes only with the engine's flag
            self.routes.start(tokens)

    def _finish_routes(self) -> torch.Tensor:
        assert self.routes is not None
        return self.routes.finish()
