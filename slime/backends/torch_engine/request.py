"""A /generate request's state from arrival to its reply: what the server builds, the scheduler
advances and ``replies.generate_reply`` answers from."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
