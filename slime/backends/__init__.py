"""The engine and trainer backends; ``resolve_backend`` is the one switch between the engine servers."""

from __future__ import annotations

import argparse


def resolve_backend(args: argparse.Namespace) -> str:
    """``--rollout-backend``, or when unset: SGLang if it imports and a GPU is visible, else torch."""
    if args.rollout_backend is not None:
        return args.rollout_backend
    from slime.backends import sglang

    if not sglang.is_available():
        return "torch"
    from slime.utils.device import has_gpu

    return "sglang" if has_gpu() else "torch"
