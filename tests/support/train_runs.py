"""Running ``train.py`` as a user does and reading what it leaves: flags, TensorBoard events, processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slime.utils.http import free_port
from tests.support.paths import REPO

LOOP = {
    "n_samples_per_prompt": 4, "rollout_max_response_len": 6, "rollout_num_gpus": 2,
    "actor_num_gpus_per_node": 2, "lr": "1e-4", "use_kl_loss": True, "kl_loss_coef": "0.01",
    "log_level": "INFO",
}  # fmt: skip
"""``tiny_run_flags`` overrides of the loop tests: GRPO with a KL loss, 2 engines and 2 trainer ranks."""


ONE_PER_SIDE = LOOP | {"rollout_num_gpus": 1, "actor_num_gpus_per_node": 1}
"""``LOOP`` with one engine and one trainer rank instead of two of each (test_train_async, test_ppo_e2e)."""


def processes_tagged(tag: str) -> list[str]:
    """Live processes that inherited ``SLIME_TEST_RUN=tag``: everything a run started, however deep."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("SLIME_TEST_RUN") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.info['pid']}: {' '.join(proc.info['cmdline'] or [])[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_none_left(tag: str, timeout_s: float = 10.0) -> None:
    """No live process inherited ``SLIME_TEST_RUN=tag`` within ``timeout_s``: processes killed a moment
    ago may still be exiting, so they are given that long (polled) rather than a fixed pause."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left


def read_events(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run_train(
    flags: list[str], exit_code: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``train.py`` as a user runs it (``env`` added to this environment), ending with ``exit_code``;
    afterwards no process it started (Ray, engines, router) is alive."""
    tag = uuid.uuid4().hex
    env = {**os.environ, **(env or {}), "SLIME_TEST_RUN": tag}
    command = [sys.executable, "train.py", *flags]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == exit_code, result.stderr[-3000:]
    assert_none_left(tag)
    return result


def crash_env(tmp_path, name: str, at_request: int) -> dict[str, str]:
    """One engine of the run (the first to get there) is SIGKILLed at its ``at_request``-th /generate."""
    return {
        "SLIME_TORCH_ENGINE_FAULT": f"crash@{at_request}",
        "SLIME_TORCH_ENGINE_FAULT_ONCE": str(tmp_path / f"{name}.fired"),
    }


def write_stale_cluster_file(temp_root: Path) -> str:
    """``ray_current_cluster`` as a ``ray start`` whose cluster died without ``ray stop`` leaves it."""
    address = f"127.0.0.1:{free_port()}"
    (temp_root / "ray").mkdir(parents=True)
    (temp_root / "ray" / "ray_current_cluster").write_text(address)
    return address
