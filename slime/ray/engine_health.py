"""``--use-fault-tolerance``: each engine's health, and the monitor that probes it.

An engine goes round one cycle: HEALTHY (in the router) -> FAILED (a probe failed, it stopped
answering, or its process died: taken out of the router at once) -> RESTARTING (stopped and started
again on its own bundles) -> STALE (up, but with the weights it started from: kept out of the
router) -> HEALTHY again once the next weight push has given it the trainer's weights and version.
So a restarted engine never serves stale weights. A restart that fails leaves it FAILED, and every
probe round tries it again.

``HealthMonitor`` probes the HEALTHY engines every ``--rollout-health-check-interval`` seconds
(``/health_generate`` answers within ``--rollout-health-check-timeout``: on SGLang it checks that
the scheduler made progress, so it is cheap on a busy server), from
``--rollout-health-check-first-wait`` seconds after the start on (large MoE models compile on their
first requests). It is paused while the engines are released (``--colocate``) or receive weights.
What it does with a failure is its owner's (``RolloutManager``); the clock is injectable for tests.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    HEALTHY = "healthy"
    FAILED = "failed"
    RESTARTING = "restarting"
    STALE = "stale"


_ALLOWED_FROM = {
    "fail": (EngineState.HEALTHY, EngineState.STALE, EngineState.RESTARTING, EngineState.FAILED),
    "restart": (EngineState.FAILED,),
    "restarted": (EngineState.RESTARTING,),
    "serve": (EngineState.STALE,),
}


@dataclass
class EngineHealth:
    """One engine's state in the cycle, with the seconds it spent out of service."""

    rank: int
    url: str
    state: EngineState = EngineState.HEALTHY
    reason: str = ""
    restarts: int = 0
    out_since: float | None = None
    out_seconds: float = 0.0  # closed spans only; ``unhealthy_seconds`` adds the open one

    def _move(self, event: str, to: EngineState) -> None:
        if self.state not in _ALLOWED_FROM[event]:
            raise ValueError(f"engine {self.rank}: cannot {event} while {self.state.value}")
        self.state = to

    def fail(self, now: float, reason: str) -> None:
        self._move("fail", EngineState.FAILED)
        self.reason = reason
        if self.out_since is None:
            self.out_since = now

    def restart(self) -> None:
        self._move("restart", EngineState.RESTARTING)

    def restarted(self, url: str) -> None:
        self._move("restarted", EngineState.STALE)
        self.url = url
        self.restarts += 1

    def serve(self, now: float) -> None:
        """The engine has the current weights and is back in the router."""
        self._move("serve", EngineState.HEALTHY)
        self.out_seconds += now - (self.out_since if self.out_since is not None else now)
        self.out_since = None
        self.reason = ""

    def unhealthy_seconds(self, now: float) -> float:
        return self.out_seconds + (now - self.out_since if self.out_since is not None else 0.0)


Probe = Callable[[EngineHealth], "str | None"]
"""Checks one engine: None when it is well, else why not (one line)."""


class HealthMonitor:
    """Probes every HEALTHY engine of ``engines`` in a thread; ``on_failure(engine, reason)`` per failure,
    and again each round for an engine still FAILED (its restart did not work).

    ``tick`` is one round (what the thread does every interval); tests call it with a fake clock.
    """

    def __init__(
        self,
        engines: list[EngineHealth],
        probe: Probe,
        on_failure: Callable[[EngineHealth, str], None],
        interval_s: float,
        first_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engines, self.probe, self.on_failure = engines, probe, on_failure
        self.interval_s = interval_s
        self.clock = clock
        self.probing_from = clock() + first_wait_s
        self._paused = 0
        self._lock = threading.Lock()
        self._round = threading.Lock()  # one round at a time: a failure is acted on once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, force: bool = False) -> list[EngineHealth]:
        """Probes the HEALTHY engines once (not while paused, nor before the first wait is over, unless
        ``force``); returns the ones found failed, after ``on_failure`` ran for each. A round under way
        (a restart, say) is waited for."""
        with self._round:
            if not force and self.clock() < self.probing_from:
                return []
            with self._lock:
                if self._paused and not force:
                    return []
                failed = [(e, e.reason) for e in self.engines if e.state is EngineState.FAILED]
                for engine in self.engines:
                    if engine.state is not EngineState.HEALTHY:
                        continue
                    reason = self.probe(engine)
                    if reason is not None:
                        failed.append((engine, reason))
            for engine, reason in failed:
                self.on_failure(engine, reason)
            return [engine for engine, _ in failed]

    def pause(self) -> None:
        """No probe runs until as many ``resume`` calls; a round under way finishes first."""
        with self._lock:
            self._paused += 1

    def resume(self) -> None:
        with self._lock:
            self._paused = max(0, self._paused - 1)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # the monitor must outlive a bad round; the next one tries again
                logger.exception("engine health round failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 60)
