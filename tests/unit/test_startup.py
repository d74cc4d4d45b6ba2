"""Start-up: the milestones every process marks, and the processes that must not import torch."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

from slime.utils import hardware, startup

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_marks_are_written_only_with_the_env_and_once_when_asked(tmp_path, monkeypatch):
    log = tmp_path / "marks.jsonl"
    monkeypatch.delenv(startup.STARTUP_LOG_ENV, raising=False)
    startup.mark("before the env")
    monkeypatch.setenv(startup.STARTUP_LOG_ENV, str(log))
    monkeypatch.setattr(startup, "_reached", set())
    startup.mark("a")
    startup.mark("b", once=True)
    startup.mark("b", once=True)
    startup.mark("a")
    marks = startup.read_marks(log)
    assert [m["what"] for m in marks] == ["a", "b", "a"]
    assert all(m["pid"] == os.getpid() for m in marks)
    assert marks[0]["t"] <= marks[1]["t"] <= marks[2]["t"]


def test_the_driver_and_the_rollout_side_import_no_torch_megatron_or_transformers():
    """The driver (train.py, train_async.py), the rollout manager's and the engine actors' modules: torch
    alone cost each of these processes about 1 s of CPU and 250 MB at start-up (2 cores)."""
    code = (
        "import sys; sys.path.insert(0, '.'); import train, train_async; "
        "import slime.ray.rollout_manager, slime.ray.engines, slime.ray.trainer_group, slime.utils.metrics; "
        "print([m for m in ('torch', 'megatron', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


class _FakeCuda:
    """``libcuda.so.1`` with ``count`` devices (``cuInit`` failing when ``init_error``)."""

    def __init__(self, count: int, init_error: int = 0) -> None:
        self.count, self.init_error = count, init_error

    def cuInit(self, flags: int) -> int:  # the driver API's name
        return self.init_error

    def cuDeviceGetCount(self, out) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int)).contents.value = self.count
        return 0


def test_without_torch_loaded_the_gpu_probe_asks_the_cuda_driver(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("SLIME_FORCE_CPU", raising=False)
    for lib, expected in [(_FakeCuda(2), True), (_FakeCuda(0), False), (_FakeCuda(2, init_error=100), False)]:
        monkeypatch.setattr(hardware.ctypes, "CDLL", lambda name, lib=lib: lib)
        hardware.cuda_device_count.cache_clear()
        assert hardware.has_gpu() is expected
    monkeypatch.setenv("SLIME_FORCE_CPU", "1")
    assert hardware.has_gpu() is False

    def missing(name: str):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.delenv("SLIME_FORCE_CPU")
    monkeypatch.setattr(hardware.ctypes, "CDLL", missing)
    hardware.cuda_device_count.cache_clear()
    assert hardware.has_gpu() is False
    hardware.cuda_device_count.cache_clear()
