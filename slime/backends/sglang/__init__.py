"""Launching real SGLang servers (GPU nodes): the ``--rollout-backend sglang`` side of the engine seam.

``slime.ray.engines.engine_command`` asks this module for the command line of one engine. The
launcher itself arrives with the GPU work: it has to map ``--sglang-*`` onto SGLang's ServerArgs,
give a multi-GPU engine the GPUs of all its bundles (``base_gpu_id``, ``tp_size``, visible devices)
and ``dist_init_addr`` / ``nnodes`` for engines that span nodes. Until then asking for it is one
clear error instead of a half-working guess.
"""

from __future__ import annotations

import argparse


class SGLangUnavailableError(RuntimeError):
    """The SGLang backend was chosen but cannot be launched by this version of slime."""


def is_available() -> bool:
    """True when ``import sglang`` works in this process (it needs a CUDA build of torch)."""
    try:
        import sglang  # noqa: F401
    except Exception:
        return False
    return True


def server_command(
    args: argparse.Namespace, host: str, port: int, *, engine_rank: int, num_gpus: int
) -> list[str]:
    """The argv of one SGLang server; not implemented yet (see the module docstring)."""
    raise SGLangUnavailableError(
        "--rollout-backend sglang: the SGLang launcher arrives with the GPU issue; "
        "use --rollout-backend torch (the in-repo engine) until then"
    )
