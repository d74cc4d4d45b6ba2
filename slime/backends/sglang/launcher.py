"""The command line of one SGLang server process (``python -m sglang.launch_server``).

slime owns the fields that tie a server to its placement (``SLIME_CONTROLLED`` in
``slime.config.sglang_args``, refused as ``--sglang-*`` flags); everything else comes from the
user's ``--sglang-*`` flags unchanged. An engine larger than a node runs one server process per node
(``--nnodes``/``--node-rank``), all meeting at the first node's ``--dist-init-addr``; only that
first node serves the HTTP API, the others answer ``/health`` once their TP ranks are up.

The GPUs are chosen by the environment, not by flags: the engine actor sets ``CUDA_VISIBLE_DEVICES``
to the GPUs of its bundles on that node, so ``--base-gpu-id`` is always 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from slime.config.sglang_args import server_flags
from slime.utils.http import engine_api_key


def missing_server_requirements(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """``(slime flag, server flag it adds, Python module the server needs for it)`` for each server
    flag slime sets whose module is not installed here (the engine nodes run the driver's image).

    SGLang 0.5.19-0.5.23 import torch_memory_saver for ``--enable-memory-saver`` (set by
    ``--colocate``) in ``utils/torch_memory_saver_adapter.py``; without it the server dies at start.
    """
    if getattr(args, "colocate", False) and importlib.util.find_spec("torch_memory_saver") is None:
        return [("--colocate", "--enable-memory-saver", "torch_memory_saver")]
    return []


def is_available() -> bool:
    """True when SGLang is installed here (it needs a CUDA build of torch, so: a GPU node)."""
    return importlib.util.find_spec("sglang") is not None


def server_command(
    args: argparse.Namespace,
    host: str,
    port: int,
    *,
    engine_rank: int,
    num_gpus: int,
    nccl_port: int,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
) -> list[str]:
    """The argv of one SGLang server: engine ``engine_rank`` (``num_gpus`` GPUs in all, its TP size),
    the part of it on node ``node_rank`` of ``nnodes``; ``dist_init_addr`` is required when
    ``nnodes > 1``."""
    if nnodes > 1 and not dist_init_addr:
        raise ValueError(f"engine {engine_rank} spans {nnodes} nodes: it needs a dist_init_addr")
    argv = [sys.executable, "-m", "sglang.launch_server"]
    argv += ["--model-path", str(Path(args.hf_checkpoint).resolve())]
    argv += ["--host", host, "--port", str(port), "--nccl-port", str(nccl_port)]
    argv += ["--tp-size", str(num_gpus), "--base-gpu-id", "0"]
    argv += ["--random-seed", str(args.rollout_seed + engine_rank)]
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if getattr(args, "colocate", False):
        argv.append("--enable-memory-saver")  # release/resume_memory_occupation between turns
    passed = dict(args.sglang_server_args or {})
    passed.setdefault("log_level", str(getattr(args, "log_level", "info")).lower())
    if key := engine_api_key():  # the run's key (``--sglang-api-key`` or one made for a multi-node run)
        passed["api_key"] = key
    return argv + server_flags(passed)
