"""Upstream slime's ``GenerateState`` and default ``generate``, over our rollout code.

Custom generate functions written for THUDM/slime start with ``state = GenerateState(args)`` and read
``state.tokenizer``, ``state.processor``, ``state.semaphore`` and ``state.sampling_params``; the
multi-turn ones call upstream's single-turn ``generate(args, sample, sampling_params)`` and build
their URL with ``get_model_url``. All three are re-exported by ``slime.rollout.sglang_rollout``,
upstream's module for them. The state is built from
ours: the tokenizer is the rollout's cached one, the sampling parameters are the ones our default
rollout sends, and ``generate`` is one model turn of ``generate_utils`` (same abort, context-length
and log-prob handling as our own rollout). Differences from upstream: docs/guides/upstream-compat.md.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from typing import Any, ClassVar

from slime.rollout.generate_utils import (
    append_model_turn,
    cached_tokenizer,
    generate_turn,
    remaining_tokens,
    request_images,
    start_sample,
)
from slime.rollout.plugin_args import rollout_settings, router_url, tokenizer_path
from slime.rollout.sample import Sample
from slime.rollout.sampling import sampling_params


def _load_processor(path: str) -> Any:
    """The checkpoint's multimodal processor, or ``None`` for a text-only model (as upstream: a
    processor that is only the tokenizer again is no processor)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)  # type: ignore[no-untyped-call]  # unannotated upstream
    except (OSError, ValueError):  # no processor config: text-only checkpoint
        return None
    return None if processor.__class__.__name__.endswith(("Tokenizer", "TokenizerFast")) else processor


class GenerateState:
    """One per process (upstream's singleton): the first ``GenerateState(args)`` builds it, every later
    call returns that same object whatever ``args`` it is given, so a plugin's tokenizer is loaded
    once and its semaphore bounds all of its requests together."""

    _instance: ClassVar[GenerateState | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __new__(cls, args: argparse.Namespace) -> GenerateState:
        with cls._lock:
            if cls._instance is None:
                instance = super().__new__(cls)
                instance._build(args)
                cls._instance = instance
        return cls._instance

    def _build(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer = cached_tokenizer(tokenizer_path(args))
        self.processor = _load_processor(tokenizer_path(args))
        rollout = rollout_settings(args)
        self.semaphore = asyncio.Semaphore(rollout.batch.concurrency)
        """Upstream's bound on requests in flight: ``--sglang-server-concurrency`` per engine."""
        self.sampling_params: dict[str, Any] = sampling_params(rollout.sampling)

    @classmethod
    def reset(cls) -> None:
        """Forgets the instance (tests that run several configurations in one process)."""
        with cls._lock:
            cls._instance = None


async def generate(args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Upstream's default single-turn generate: one ``/generate`` through the router on the sample's
    tokens (the prompt's ids when it has none), its response appended with loss mask 1 and the
    engine's log-probs, status COMPLETED / TRUNCATED / ABORTED from the engine's finish reason.
    ``max_new_tokens`` is the budget of the whole response, so a resumed sample gets what is left;
    unlike upstream, ``sampling_params`` is not modified."""
    start_sample(args, sample)
    if sample.finished:  # a prompt image that cannot be decoded
        return sample
    params = {**sampling_params, "max_new_tokens": remaining_tokens(sample, sampling_params)}
    images = request_images(args, sample)
    append_model_turn(sample, await generate_turn(args, sample.tokens, params, sample.index, images=images))
    return sample


def get_model_url(args: argparse.Namespace, model_name: str, endpoint: str = "/generate") -> str:
    """Upstream's URL of a named model's router. slime serves one policy behind one router (no
    ``--sglang-config`` with several models), so every name maps to it, as upstream falls back to the
    default router for a name it does not know."""
    return f"{router_url(args)}{endpoint}"
