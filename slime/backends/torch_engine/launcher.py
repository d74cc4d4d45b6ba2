"""The command line of one torch engine server process (``python -m slime.backends.torch_engine``).

The CPU side of the engine seam, shaped like ``slime.backends.sglang.launcher``: ``server_command``
builds a run's engine from slime's settings; ``command_line`` is the one spelling of the argv, which
benchmarks and tests also use to start an engine on a checkpoint of their own (``serving``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from slime.backends.engine_server import ServerCommand
from slime.config.settings.rollout import EngineSettings
from slime.config.sglang_args import server_flags
from slime.utils.http import engine_api_key


def command_line(model_path: str | os.PathLike[str], *flags: str) -> list[str]:
    """``python -m slime.backends.torch_engine --model-path DIR`` followed by ``flags`` (SGLang names)."""
    return [sys.executable, "-m", "slime.backends.torch_engine", "--model-path", str(model_path), *flags]


def serving(model_path: str | os.PathLike[str], *flags: str) -> ServerCommand:
    """The engine on ``model_path`` with ``flags``, at whatever address ``start_engine_server`` picks."""
    return lambda host, port: command_line(model_path, "--host", host, "--port", str(port), *flags)


def server_command(
    engine: EngineSettings, host: str, port: int, *, engine_rank: int, num_gpus: int
) -> list[str]:
    """The argv of engine ``engine_rank``: slime's settings, then every ``--sglang-*`` option.

    The torch engine honours the SGLang options it implements and exits with status 2 naming any
    other, so an unsupported option fails start-up instead of being dropped silently.
    """
    passed = dict(engine.server_args)  # slime's own fields are refused by validation
    flags = ["--host", host, "--port", str(port), "--sglang-release", engine.torch_engine_sglang_release]
    if num_gpus != 1:
        flags += ["--tp-size", str(num_gpus)]  # refused by the torch engine with a clear line
    passed["random_seed"] = engine.seed + engine_rank
    if key := engine_api_key():  # the run's key (``--sglang-api-key`` or one made for a multi-node run)
        passed["api_key"] = key
    passed.setdefault("log_level", engine.log_level)
    return command_line(Path(engine.hf_checkpoint).resolve(), *flags, *server_flags(passed))
