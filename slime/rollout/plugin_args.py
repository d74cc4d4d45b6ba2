"""The plugin adapter: what slime's rollout code hands to plugins, and reads back from what they hand it.

User plugins (rollout, generate, reward and filter functions) receive the run's namespace, as in
upstream slime; so do slime's own default plugins, called by the same contract. This module is the one
place on the rollout side that reads that namespace:

- ``with_router`` makes the rollout manager's own copy of the namespace once the router is up, with
  slime's plugin convention ``sglang_router_ip``/``sglang_router_port`` filled in (the run's namespace
  is never written to); ``router_url`` reads them back.
- ``settings_of(args, RewardSettings)``, ``rollout_settings(args)``, ...: the settings a default
  plugin works from, for the namespace it was called with: those the manager bound to its copy
  (``bind``), else read from the namespace (a test's or a user's own, which may change between calls).
- ``tokenizer_path`` / ``rollout_seed`` / ``routed_experts_shape``: what the generate helpers
  (``generate_utils``) need, which plugins call with whatever namespace they hold, a hand-built one
  included.
"""

from __future__ import annotations

import argparse
import threading
import weakref
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from slime.config.settings.data import DataSettings
from slime.config.settings.eval import EvalSettings
from slime.config.settings.lora import ADAPTER_NAME
from slime.config.settings.rollout import RolloutSettings, SamplingSettings


class _FromArgs(Protocol):
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Any: ...


T = TypeVar("T", bound=_FromArgs)

_settings: dict[tuple[int, type], object] = {}
_lock = threading.Lock()


def with_router(plugin_args: argparse.Namespace, router_url: str) -> argparse.Namespace:
    """A shallow copy of ``plugin_args`` that tells plugins where the router listens."""
    parts = urlsplit(router_url)
    router = {"sglang_router_ip": parts.hostname, "sglang_router_port": parts.port}
    return argparse.Namespace(**{**vars(plugin_args), **router})


def router_url(args: argparse.Namespace) -> str:
    """The router's base URL, as the rollout manager published it to plugins."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


def bind(args: argparse.Namespace, *settings: object) -> None:
    """Makes ``settings`` (one object per settings class) what the default plugins read for ``args``
    (the manager's own copy)."""
    with _lock:
        for part in settings:
            _remember(args, type(part), part)


def tokenizer_path(args: argparse.Namespace) -> str:
    """``--hf-checkpoint``: prompts and responses are tokenized with its tokenizer."""
    bound = _bound(args, DataSettings)
    path: str | None = bound.tokenizer_path if bound is not None else args.hf_checkpoint
    assert path is not None  # the config checks require --hf-checkpoint
    return path


def served_adapter(args: argparse.Namespace) -> str | None:
    """The LoRA adapter the engines serve (``--lora-rank`` without ``--lora-train-only``), which every
    ``/generate`` must name as SGLang's ``lora_path``; None for a run without one. A plugin that posts
    its own ``/generate`` adds ``"lora_path": served_adapter(args)`` when this is not None."""
    if not getattr(args, "lora_rank", 0) or getattr(args, "lora_train_only", False):
        return None
    return ADAPTER_NAME


def rollout_seed(args: argparse.Namespace) -> int:
    """``--rollout-seed``: each request's own sampling seed derives from it."""
    bound = _bound(args, SamplingSettings)
    return bound.seed if bound is not None else args.rollout_seed


def routed_experts_shape(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--use-rollout-routing-replay``: ``(layers, topk)`` of the routed-experts rows each request asks
    for (``--num-layers``, ``--moe-router-topk``); None without it."""
    bound = _bound(args, RolloutSettings)
    if bound is not None:
        return bound.routed_experts_shape
    if not getattr(args, "use_rollout_routing_replay", False):
        return None
    return int(args.num_layers), int(args.moe_router_topk)


def rollout_settings(args: argparse.Namespace) -> RolloutSettings:
    return settings_of(args, RolloutSettings)


def eval_settings(args: argparse.Namespace) -> EvalSettings:
    return settings_of(args, EvalSettings)


def settings_of(args: argparse.Namespace, kind: type[T]) -> T:
    """The ``kind`` settings the namespace ``args`` stands for."""
    bound = _bound(args, kind)
    return bound if bound is not None else kind.from_args(args)


def _bound(args: argparse.Namespace, kind: type[T]) -> T | None:
    with _lock:
        found = _settings.get((id(args), kind))
    return found if isinstance(found, kind) else None


def _remember(args: argparse.Namespace, kind: type, settings: object) -> None:
    key = (id(args), kind)
    if key not in _settings:  # forgotten with the namespace, so that a new one at its id starts fresh
        weakref.finalize(args, _settings.pop, key, None)
    _settings[key] = settings
