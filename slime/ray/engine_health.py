"""``--use-fault-tolerance``: each engine's health, and the monitor that probes it.

An engine goes round one cycle: HEALTHY (in the router) -> FAILED (a probe failed, it stopped
answering, or its process died: taken out of the router at once) -> RESTARTING (stopped and started
again on its own bundles) -> STALE (up, but with the weights it started from: kept out of the
router) -> HEALTHY again once the next weight push has given it the trainer's weights and version.
So a restarted engine never serves stale weights. A restart that fails leaves it FAILED, and the
next probe rounds try it again (``EngineRecovery`` gives up after a few in a row, and says so).

``HealthMonitor`` probes the HEALTHY engines every ``--rollout-health-check-interval`` seconds
(``/health_generate`` answers within ``--rollout-health-check-timeout``: on SGLang it checks that
the scheduler made progress, so it is cheap on a busy server, and answers 503 after 20 s without any
output, which one long chunked prefill can cause: a failed answer counts only the second time in a
row, a process that ended at once), from
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
from concurrent.futures import ThreadPoolExecutor
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
    failed_restarts: int = 0  # in a row; reset once it serves again
    strikes: int = 0  # failed probe answers in a row
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
        self.failed_restarts = 0

    def unhealthy_seconds(self, now: float) -> float:
        return self.out_seconds + (now - self.out_since if self.out_since is not None else 0.0)


Probe = Callable[[EngineHealth, bool], "str | None"]
"""Checks one engine: None when it is well, else why not (one line). The flag is ``live_only``: while
the engines are paused or released a probe may not generate (on SGLang a generation waits while
paused, and one sent to a released engine runs on freed memory), so it only checks that the engine's
processes run and that it answers a request that does not generate."""

MAX_PROBES_IN_FLIGHT = 64


class HealthMonitor:
    """Probes every HEALTHY engine of ``engines`` in a thread; ``on_failure(engine, reason)`` per failure,
    and again each round for an engine still FAILED (its restart did not work, or was held).

    Probes run concurrently, each bounded by its own timeout (on SGLang ``/health_generate`` takes at
    least a second, so serial probes of 64 engines would take a minute). The state lock is held only
    to read and write states, never across a probe, so ``pause`` returns at once; a round that was
    under way when a pause came throws its answers away (a probe of an engine being paused may fail
    for that reason alone). ``tick`` is one round (what the thread does every interval); tests call
    it with a fake clock.
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
        self._pauses = 0  # pauses so far: a round that saw one begin throws its answers away
        self._lock = threading.Lock()
        self._round = threading.Lock()  # one round at a time: a failure is acted on once
        self._stop = threading.Event()
        self._wake = threading.Event()  # a round now, not at the end of the interval
        self._thread: threading.Thread | None = None

    @property
    def paused(self) -> bool:
        with self._lock:
            return self._paused > 0

    def tick(self, force: bool = False, wait_s: float | None = None) -> list[EngineHealth]:
        """Probes the HEALTHY engines once (not while paused, nor before the first wait is over, unless
        ``force``: then, while paused, with live-only probes); returns the ones found failed, after
        ``on_failure`` ran for each. A round under way (a restart, say) is waited for, at most
        ``wait_s`` seconds (None: as long as it takes); [] when it did not end in time."""
        if not self._round.acquire(timeout=-1 if wait_s is None else wait_s):
            logger.warning("an engine health round (a restart) is still under way after %.0f s", wait_s)
            return []
        try:
            if not force and self.clock() < self.probing_from:
                return []
            with self._lock:
                if self._paused and not force:
                    return []
                live_only, pauses = self._paused > 0, self._pauses
                failed = [(e, e.reason) for e in self.engines if e.state is EngineState.FAILED]
                targets = [e for e in self.engines if e.state is EngineState.HEALTHY]
            failed += [(e, why) for e, why in self._probe_all(targets, live_only) if why is not None]
            with self._lock:
                if not force and (self._paused or self._pauses != pauses):
                    return []
            for engine, reason in failed:
                self.on_failure(engine, reason)
            return [engine for engine, _ in failed]
        finally:
            self._round.release()

    def _probe_all(
        self, targets: list[EngineHealth], live_only: bool
    ) -> list[tuple[EngineHealth, str | None]]:
        if not targets:
            return []
        workers = min(MAX_PROBES_IN_FLIGHT, len(targets))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engine-probe") as pool:
            reasons = list(pool.map(lambda engine: self.probe(engine, live_only), targets))
        return list(zip(targets, reasons, strict=True))

    def pause(self) -> None:
        """No probe runs until as many ``resume`` calls; never waits for a round under way."""
        with self._lock:
            self._paused += 1
            self._pauses += 1

    def resume(self) -> None:
        """Undoes one ``pause``; the last one starts a round at once when an engine waits for its
        restart (held while paused), instead of a whole interval later."""
        with self._lock:
            self._paused = max(0, self._paused - 1)
            if not self._paused and any(e.state is EngineState.FAILED for e in self.engines):
                self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:  # the monitor must outlive a bad round; the next one tries again
                logger.exception("engine health round failed")

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 60)
