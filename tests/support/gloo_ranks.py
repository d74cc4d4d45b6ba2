"""Running a test worker module on several gloo ranks, one process each.

A CPU trainer rank patches ``torch.cuda`` for its whole process, so the Megatron checks that build
trainers run as ``python -m <module> <args...> <rank> <world> <port>`` in fresh processes; each writes
its results to ``<out_dir>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from slime.utils.http import free_port
from tests.support.paths import REPO


def run_gloo_ranks(module: str, args: list[str], out_dir: Path, world: int) -> list[Any]:
    """Runs ``module`` with ``args`` on ``world`` ranks; each rank's results, in rank order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    env = {**os.environ, "SLIME_FORCE_CPU": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", module, *args, str(out_dir)]
    procs = [
        subprocess.Popen(
            [*command, str(rank), str(world), port],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = [proc.communicate(timeout=300)[0] for proc in procs]
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-4000:]
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
