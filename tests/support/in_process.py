"""Running ``train.py`` / ``train_async.py``'s ``train`` inside the test process, on the session's Ray.

A subprocess costs an interpreter, slime's imports and a Ray cluster of its own (≈ 10 s on 2 cores)
before the run starts; a test that reads what a run leaves (TensorBoard scalars, checkpoints, dumps,
log lines) rather than how the process ends needs none of that. Exit codes, Ctrl-C, one-line errors
and orphan processes stay subprocess tests (``tests.support.train_runs.run_train``).
"""

from __future__ import annotations

import importlib.util
import io
import logging
import signal
import time
from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal

import psutil

from slime.cli import check_implemented, check_overlappable
from slime.config import parse_args
from slime.config.settings.run import RunSettings
from tests.support.paths import REPO

Entry = Literal["train", "train_async"]

_ENTRIES: dict[str, ModuleType] = {}

LIVE_ACTOR_STATES = {"DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING"}
RAY_DAEMONS = {"raylet", "gcs_server"}


def _entry_module(entry: Entry) -> ModuleType:
    """``train.py`` or ``train_async.py`` as a module (not ``__main__``), loaded once."""
    if entry not in _ENTRIES:
        spec = importlib.util.spec_from_file_location(f"slime_entry_{entry}", REPO / f"{entry}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _ENTRIES[entry] = module
    return _ENTRIES[entry]


def live_actors() -> dict[str, str]:
    """Actor id to class name of every actor of the cluster that is alive or on its way to be."""
    import ray._private.state

    return {
        actor_id: info["ActorClassName"]
        for actor_id, info in ray._private.state.actors().items()
        if info["State"] in LIVE_ACTOR_STATES
    }


def live_placement_groups() -> set[str]:
    from ray.util import placement_group_table

    return {pg_id for pg_id, info in placement_group_table().items() if info["state"] != "REMOVED"}


@dataclass
class RayFootprint:
    """What a block of code started on the session's Ray cluster, and left there when it ended."""

    started: Counter[str] = field(default_factory=Counter)
    """Class names of the actors started, with their counts."""
    leaked: list[str] = field(default_factory=list)


def run_processes() -> dict[int, str]:
    """This process's descendants that a run starts beside Ray's own (engines, router, data workers),
    pid to command line: Ray's daemons and workers (``ray::...``, ``.../ray/...``) are left out, as
    the cluster keeps or restarts them as it likes."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
            if proc.status() == psutil.STATUS_ZOMBIE or cmdline.startswith("ray::") or "/ray/" in cmdline:
                continue
            if proc.name() in RAY_DAEMONS:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found[proc.pid] = cmdline[:120]
    return found


def left_alive(
    actors: set[str], groups: set[str], processes: Collection[int] = (), wait_s: float = 30.0
) -> list[str]:
    """Which of ``actors`` (ids), placement ``groups`` and ``processes`` (``run_processes`` pids) are
    still there ``wait_s`` from now, as class names, ``placement group <id>`` and ``<pid>: <command>``
    (killed actors take a moment to be marked dead, and their processes to exit)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = {a: name for a, name in live_actors().items() if a in actors}
        pending = live_placement_groups() & groups
        running = {pid: cmd for pid, cmd in run_processes().items() if pid in processes}
        if (not alive and not pending and not running) or time.monotonic() > deadline:
            return [
                *alive.values(),
                *(f"placement group {pg}" for pg in pending),
                *(f"{pid}: {cmd}" for pid, cmd in running.items()),
            ]
        time.sleep(0.5)


@contextmanager
def leaves_nothing_on_ray(wait_s: float = 30.0) -> Iterator[RayFootprint]:
    """Fails unless every actor, placement group and process (engines, router, data workers) the block
    started is gone ``wait_s`` after it ends; yields what was started, filled in on exit."""
    import ray._private.state

    known_before, groups_before = set(ray._private.state.actors()), live_placement_groups()
    processes_before = set(run_processes())
    footprint = RayFootprint()
    try:
        yield footprint
    finally:
        started = {
            a: i["ActorClassName"] for a, i in ray._private.state.actors().items() if a not in known_before
        }
        footprint.started = Counter(started.values())
        processes = set(run_processes()) - processes_before
        footprint.leaked = left_alive(
            set(started), live_placement_groups() - groups_before, processes, wait_s
        )
    assert not footprint.leaked, f"left on the Ray cluster: {footprint.leaked}"


@dataclass
class InProcessRun:
    log: str
    """The driver's ``slime`` log lines at the run's ``--log-level``, as ``train.py`` writes them."""
    started: Counter[str]
    """Class names of the Ray actors the run started."""


def train_in_process(flags: list[str], entry: Entry = "train") -> InProcessRun:
    """``entry``'s ``train`` on ``flags``, as ``run_entry_point`` calls it, on the session's Ray cluster
    (``ray_cluster`` fixture); afterwards no actor or placement group it started is left.
    Errors propagate as raised (a subprocess would have made them exit codes)."""
    module = _entry_module(entry)
    args = parse_args(flags)
    checks = (check_overlappable, check_implemented) if entry == "train_async" else (check_implemented,)
    for check in checks:
        check(args)
    slime_logger = logging.getLogger("slime")
    level = slime_logger.level
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    sigterm = signal.getsignal(signal.SIGTERM)  # TrainingSession turns SIGTERM into KeyboardInterrupt
    slime_logger.setLevel(args.log_level.upper())
    slime_logger.addHandler(handler)
    try:
        with leaves_nothing_on_ray() as footprint:
            module.train(RunSettings.from_args(args))
    finally:
        slime_logger.removeHandler(handler)
        slime_logger.setLevel(level)
        signal.signal(signal.SIGTERM, sigterm)
    return InProcessRun(log=log.getvalue(), started=footprint.started)
