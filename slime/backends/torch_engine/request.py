"""A /generate request's state from arrival to its reply: what the server builds, the scheduler
advances and ``replies.generate_reply`` answers from."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from slime.backends.torch_engine.protocol import SamplingParams
from slime.backends.torch_engine.sampling import RowSampling

if TYPE_CHECKING:
    from slime.backends.torch_engine.lora import Adapter
    from slime.backends.torch_engine.vision import ImageInputs


@dataclass
class Request:
    """A request's state from arrival to its reply."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    on_finish: Callable[[dict[str, Any]], None] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    slot: int = -1
    kv_len: int = 0  # tokens whose keys/values are in the cache (prompt + outputs but the last)
    num_retractions: int = 0
    sampling: RowSampling | None = None
    stop_ids: frozenset[int] = frozenset()  # finish on these (empty with ignore_eos)
    banned_until_min: list[int] = field(default_factory=list)  # suppressed before min_new_tokens
    stop_tail_tokens: int = 0  # output tokens to decode when looking for stop strings
    aborted_in_queue: bool = False  # answered in the short shape of an abort from the waiting queue
    cached_tokens: int = 0  # prompt tokens whose keys/values were copied rather than computed
    images: ImageInputs | None = None  # a VLM request's images, kept until it leaves (re-prefills use them)
    lora: Adapter | None = None  # the LoRA adapter it names (``lora_path``), kept until it leaves
    # With the engine's --enable-return-routed-experts and the request's return_routed_experts: the
    # routed experts of every position it computed, ``[positions, layers, topk]`` int32 grown as it
    # decodes (see routed_experts.py), and the first position its reply returns.
    routes: torch.Tensor | None = None
    routed_experts_start_len: int = 0
    routed_positions: int = 0  # positions 0 .. this - 1 have their rows

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    @property
    def lora_id(self) -> str | None:
        """The adapter load this request runs with: a new id for every load of a name."""
        return None if self.lora is None else self.lora.lora_id

    @property
    def cache_key(self) -> tuple[Any, ...]:
        """What a prefilled KV row holds: its tokens and, for image requests, which pictures (the pad ids
        of two different images are the same; SGLang keys its radix cache by their hashes); with an
        adapter, which load of it (SGLang's radix cache is keyed by ``lora_id`` too)."""
        tokens = (*self.input_ids, *self.output_ids)
        key = tokens if self.images is None else (self.images.key, *tokens)
        return key if self.lora is None else (("lora", self.lora.lora_id), *key)

    def reserved_tokens(self) -> int:
        return len(self.input_ids) + self.max_new_tokens

    def record_routes(self, position: int, rows: torch.Tensor) -> None:
        """The routed experts of positions ``position ..`` (a prefill's rows, or one decode step's)."""
        if self.routes is None:
            return
        end = position + rows.shape[0]
        if end > len(self.routes):  # doubling: a long max_new_tokens reserves nothing up front
            grown = self.routes.new_zeros((max(end, 2 * len(self.routes)), *self.routes.shape[1:]))
            grown[: len(self.routes)] = self.routes
            self.routes = grown
        self.routes[position:end] = rows
        self.routed_positions = max(self.routed_positions, end)

    def routes_reply(self) -> torch.Tensor | None:
        """The rows its reply returns: positions ``[start, seqlen - 1)``, the start clamped to
        ``seqlen - 1`` (SGLang's ``BaseTopkCapturer.get_topk``); None for one that never ran (failed
        with the engine before its prefill)."""
        seqlen = len(self.input_ids) + len(self.output_ids)
        if self.routes is None or self.routed_positions < seqlen - 1:
            return None
        return self.routes[min(self.routed_experts_start_len, seqlen - 1) : seqlen - 1]
