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

import sys
from pathlib import Path

from slime.config.settings.data import is_vision_checkpoint
from slime.config.settings.rollout import EngineSettings
from slime.config.sglang_args import server_flags
from slime.utils.http import engine_api_key


def server_command(
    engine: EngineSettings,
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
    argv += ["--model-path", str(Path(engine.hf_checkpoint).resolve())]
    argv += ["--host", host, "--port", str(port), "--nccl-port", str(nccl_port)]
    argv += ["--tp-size", str(num_gpus), "--base-gpu-id", "0"]
    argv += ["--random-seed", str(engine.seed + engine_rank)]
    if nnodes > 1:
        assert dist_init_addr is not None  # checked at the top
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if engine.colocate:
        argv.append("--enable-memory-saver")  # release/resume_memory_occupation between turns
    passed = dict(engine.server_args)
    passed.setdefault("log_level", engine.log_level)
    if is_vision_checkpoint(engine.hf_checkpoint):
        # The rollout patched each image with the checkpoint's PIL processor; the same backend here
        # normalises the pixels identically (the torchvision one differs in the last bits).
        passed.setdefault("image_processor_backend", "pil")
    if key := engine_api_key():  # the run's key (``--sglang-api-key`` or one made for a multi-node run)
        passed["api_key"] = key
    return argv + server_flags(passed)
