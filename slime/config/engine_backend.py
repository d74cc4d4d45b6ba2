"""Which engine server a run starts, and what the SGLang server needs installed for the flags slime
sets on it: rules of the configuration, read by validation before anything starts and by the
settings (``slime.config.settings.rollout``); the backends build the servers they choose."""

from __future__ import annotations

import importlib.util


def sglang_installed() -> bool:
    """True when SGLang is installed here (it needs a CUDA build of torch, so: a GPU node)."""
    return importlib.util.find_spec("sglang") is not None


def resolve_backend(requested: str | None) -> str:
    """``--rollout-backend`` (``requested``), or when unset: SGLang if it imports and a GPU is visible,
    else torch."""
    if requested is not None:
        return requested
    if not sglang_installed():
        return "torch"
    from slime.utils.hardware import has_gpu

    return "sglang" if has_gpu() else "torch"


def missing_server_requirements(colocate: bool) -> list[tuple[str, str, str]]:
    """``(slime flag, server flag it adds, Python module the server needs for it)`` for each server
    flag slime sets (``slime.backends.sglang.launcher.server_command``) whose module is not installed
    here (the engine nodes run the driver's image).

    SGLang 0.5.19-0.5.23 import torch_memory_saver for ``--enable-memory-saver`` (set by
    ``--colocate``) in ``utils/torch_memory_saver_adapter.py``; without it the server dies at start.
    """
    if colocate and importlib.util.find_spec("torch_memory_saver") is None:
        return [("--colocate", "--enable-memory-saver", "torch_memory_saver")]
    return []
