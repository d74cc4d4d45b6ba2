"""Started training stacks (Ray actors: engines, router, rollout manager, trainer ranks), one per layout,
shared by the e2e tests that only need one running.

Starting a stack is most of an e2e test's time; a test that pushes weights, generates or trains on a
running stack and leaves it as it found it (an engine group it destroys, it rebuilds) takes the one
of its layout from the session-wide ``stack`` fixture instead of starting its own. Layouts are data:
``LAYOUTS`` names the ``tiny_run_flags`` overrides of each.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping

import psutil
import ray

from slime.config import parse_args
from slime.config.settings.run import RunSettings
from slime.ray.session import TrainingSession
from tests.support.in_process import left_alive, live_actors, live_placement_groups, run_processes
from tests.support.train_runs import LOOP

LAYOUTS: dict[str, dict[str, object]] = {
    "dp2-sglang-0.5.19": LOOP | {"torch_engine_sglang_release": "0.5.19", "rollout_temperature": "0.7"},
    "pp2-sglang-0.5.23": LOOP
    | {
        "torch_engine_sglang_release": "0.5.23",
        "pipeline_model_parallel_size": 2,
        "rollout_temperature": "0.7",
        "use_rollout_logprobs": True,
    },
}
"""Named layouts: 2 engines and 2 trainer ranks each. ``dp2-sglang-0.5.19``: data-parallel trainers,
engines without weight-update sessions; ``pp2-sglang-0.5.23``: two pipeline stages pushing inside the
one session each engine has, with the engines' log-probs as old log-probs (--use-rollout-logprobs)."""

GPU_BUDGET = 4
"""Logical GPUs the open stacks may hold together: half the session cluster's 8, so the tests that
place their own actors still find theirs."""


class Stacks:
    """``stacks(layout)``: the started ``TrainingSession`` of ``layout`` (a name in ``LAYOUTS`` or a
    mapping of ``tiny_run_flags`` overrides), started on first use. Stacks over ``GPU_BUDGET`` are
    closed least recently used first; ``close`` stops them all and checks that no engine or router
    process and no actor outlives them."""

    def __init__(self, flags_of: Callable[..., list[str]]) -> None:
        self._flags_of = flags_of
        self._open: dict[str, TrainingSession] = {}  # least recently used first
        self._started: dict[str, tuple[set[str], set[str], set[int]]] = {}  # actors, groups, processes

    def __call__(self, layout: str | Mapping[str, object]) -> TrainingSession:
        overrides = LAYOUTS[layout] if isinstance(layout, str) else dict(layout)
        key = layout if isinstance(layout, str) else repr(sorted(overrides.items()))
        if key in self._open:
            self._open[key] = self._open.pop(key)
            return self._open[key]
        settings = RunSettings.from_args(parse_args(self._flags_of(**overrides)))
        while self._open and self._gpus() + settings.cluster.total_gpus > GPU_BUDGET:
            self._close(next(iter(self._open)))
        actors, groups, processes = set(live_actors()), live_placement_groups(), set(run_processes())
        sigterm = signal.getsignal(signal.SIGTERM)  # TrainingSession turns SIGTERM into KeyboardInterrupt
        try:
            self._open[key] = TrainingSession(settings).__enter__()
        finally:
            signal.signal(signal.SIGTERM, sigterm)
        self._started[key] = (
            set(live_actors()) - actors,
            live_placement_groups() - groups,
            set(run_processes()) - processes,
        )
        return self._open[key]

    def _gpus(self) -> int:
        return sum(session.settings.cluster.total_gpus for session in self._open.values())

    def _close(self, key: str) -> None:
        session = self._open.pop(key)
        pids = ray.get(session.rollout.pids.remote())
        session.close()
        leaked = left_alive(*self._started.pop(key))
        assert not leaked, f"stack {key} left on the Ray cluster: {leaked}"
        processes = [*pids["engines"], *([pids["router"]] if pids["router"] else [])]
        alive = [pid for pid in processes if _alive(pid)]
        assert not alive, f"stack {key}: engine or router processes left: {alive}"

    def close(self) -> None:
        while self._open:
            self._close(next(iter(self._open)))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
