"""What a failed engine costs on the rollout side: with ``--use-fault-tolerance`` it is replaced while
the run goes on (``EngineRecovery``); without, the run stops in one line naming it (``EngineWatch``).

``EngineRecovery`` owns the engines' health (``engine_health``) and acts on a failure at once:
the engine leaves the router (no new request reaches it; the requests it held fail and the
rollout sends them again, ``generate_utils``), every process of it is stopped and it is started
again on its own bundles (``EnginePool.restart``). It then waits, STALE and out of the router, for
the next weight push, which gives it the trainer's weights and version (``TrainingSession``
reconnects the trainer to the engines' new URLs first); ``rejoin_router`` puts it back once the
engines generate again. While the engines are paused or released the probes only check liveness and
a restart waits for the resume (``--colocate``: the trainer holds the GPUs then).

Both probe the same way (``engine_health.HealthMonitor``, ``engines.engine_problem``), so a hung engine
is found in a plain run too: the rollout sets no total timeout on its requests (a long generation is not
an error), and without the probes a hung engine would hold the run for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from slime.config.settings.fault_tolerance import FaultToleranceSettings
from slime.ray.engine_health import EngineHealth, EngineState, HealthMonitor
from slime.ray.engines import ADD_FAULT_TOLERANCE, EnginePool, engine_problem
from slime.rollout.errors import EngineFailure
from slime.rollout.router import Router, RouterError

logger = logging.getLogger(__name__)

RESTART_FAILED = "; its restart failed: "
PROBE_STRIKES = 2  # failed probe answers in a row that make an engine FAILED
MAX_FAILED_RESTARTS = 3  # restarts in a row that did not come up before an engine is given up


class _ProbedEngines:
    """The engines of one ``EnginePool``, HEALTHY at first, probed as the ``--rollout-health-check-*``
    flags say; what a failure does is the subclass's ``_on_failure``."""

    def __init__(
        self,
        fault_tolerance: FaultToleranceSettings,
        pool: EnginePool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool, self.clock = pool, clock
        self.timeout_s = fault_tolerance.health_check_timeout_s
        self.engines = [EngineHealth(rank, url) for rank, url in enumerate(pool.urls)]
        self.monitor = HealthMonitor(
            self.engines,
            self._probe,
            self._on_failure,
            interval_s=fault_tolerance.health_check_interval_s,
            first_wait_s=fault_tolerance.health_check_first_wait_s,
            clock=clock,
        )

    def _probe(self, engine: EngineHealth, live_only: bool) -> str | None:
        """Why ``engine`` failed, or None. An answer that is not 200 counts the second time in a row
        only: SGLang's ``/health_generate`` answers 503 after 20 s without output, and one long chunked
        prefill gives none (``entrypoints/http_server.py``, 0.5.19-0.5.23). An ended process counts
        at once."""
        codes = self.pool.exit_codes(engine.rank)
        reason = engine_problem(engine.url, codes, self.timeout_s, generate=not live_only)
        if reason is None or any(code is not None for code in codes):
            engine.strikes = 0
            return reason
        engine.strikes += 1
        if engine.strikes < PROBE_STRIKES:
            logger.warning(
                "engine %d (%s) %s; it fails if the next probe does too", engine.rank, engine.url, reason
            )
            return None
        engine.strikes = 0
        return reason

    def _on_failure(self, engine: EngineHealth, reason: str) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.monitor.start()

    def stop(self) -> None:
        self.monitor.stop()


class EngineWatch(_ProbedEngines):
    """Without ``--use-fault-tolerance``: the first failed engine ends the run with ``failure``.

    It is stopped at once: the requests it holds fail (a hung engine would hold them for good), so the
    rollout ends and the manager raises ``failure`` instead of what the requests saw.
    """

    def __init__(
        self,
        fault_tolerance: FaultToleranceSettings,
        pool: EnginePool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(fault_tolerance, pool, clock)
        self.failure: EngineFailure | None = None

    def _on_failure(self, engine: EngineHealth, reason: str) -> None:
        if engine.state is EngineState.FAILED:  # stopped already, at the round that found it
            return
        engine.fail(self.clock(), reason)
        if self.failure is None:
            self.failure = EngineFailure(
                f"engine {engine.rank} ({engine.url}) {reason}; {ADD_FAULT_TOLERANCE}"
            )
        logger.error("engine %d (%s) %s; stopping it, and the run", engine.rank, engine.url, reason)
        self.pool.stop(engine.rank)


class EngineRecovery(_ProbedEngines):
    """Health monitoring and replacement of the engines of one ``EnginePool`` behind one ``Router``."""

    def __init__(
        self,
        fault_tolerance: FaultToleranceSettings,
        pool: EnginePool,
        router: Router,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(fault_tolerance, pool, clock)
        self.router = router
        self._lock = threading.Lock()

    def _on_failure(self, engine: EngineHealth, reason: str) -> None:
        """Out of the router, stopped, started again; STALE until the next push (FAILED if it does not
        come up: the run goes on with the others, the next rounds try again, ``MAX_FAILED_RESTARTS``
        times in a row, and the run stops when none is left).

        While the monitor is paused the engines are paused for a push or have released their memory
        (``--colocate``: the trainer holds the GPUs), so the restart waits for the next round after the
        resume: a fresh engine takes its whole memory share at start."""
        if engine.failed_restarts >= MAX_FAILED_RESTARTS:
            return
        held = self.monitor.paused
        if engine.state is not EngineState.FAILED:
            logger.warning("engine %d (%s) %s; restarting it", engine.rank, engine.url, reason)
            with self._lock:
                engine.fail(self.clock(), reason)
            try:
                self.router.remove_worker(engine.url)
            except RouterError as exc:  # not listed any more: nothing to take out
                logger.info("engine %d: %s", engine.rank, exc)
            if held:
                self.pool.stop(engine.rank)
                logger.info("engine %d: it restarts once the engines are resumed", engine.rank)
        if held:
            return
        with self._lock:
            engine.restart()
        try:
            url = self.pool.restart(engine.rank)
        except Exception as exc:  # EngineStartError, or anything else: never left RESTARTING
            self._restart_failed(engine, reason, exc)
            return
        with self._lock:
            engine.restarted(url)
        logger.info("engine %d restarted at %s; it serves again after the next weight push", engine.rank, url)

    def _restart_failed(self, engine: EngineHealth, reason: str, exc: Exception) -> None:
        cause = reason.split(RESTART_FAILED)[0]  # a retry keeps the first cause, not a growing chain
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        with self._lock:
            engine.fail(self.clock(), f"{cause}{RESTART_FAILED}{first}")
            engine.failed_restarts += 1
            given_up = engine.failed_restarts >= MAX_FAILED_RESTARTS
        if given_up:
            others = sum(e.state is not EngineState.FAILED for e in self.engines)
            logger.error(
                "engine %d did not come back after %d restarts in a row (%s); "
                "the run goes on with the %d other engines up",
                engine.rank,
                engine.failed_restarts,
                first,
                others,
            )
        else:
            logger.error("engine %d did not come back: %s", engine.rank, first)

    def check_now(self, wait_s: float | None = None) -> None:
        """One probe round at once (before a push: an engine that died since the last round is
        restarted now, so this push gives it the weights instead of failing on it). A restart under
        way is waited for at most ``wait_s`` seconds (default: its start timeout and placement
        allowance); the push then goes to the engines up."""
        if wait_s is None:
            wait_s = self.pool.start_timeout_s + self.pool.scheduling_allowance_s
        self.monitor.tick(force=True, wait_s=wait_s)

    def serving_urls(self) -> list[str]:
        """The engines up now (HEALTHY, or STALE awaiting weights), in rank order: what a push reaches.

        Raises ``EngineFailure`` naming every engine when none is up.
        """
        with self._lock:
            up = [e.url for e in self.engines if e.state in (EngineState.HEALTHY, EngineState.STALE)]
            if not up:
                raise EngineFailure(
                    "no rollout engine is left: "
                    + "; ".join(f"engine {e.rank} ({e.url}) {e.reason}" for e in self.engines)
                )
        return up

    def rejoin_router(self, urls: list[str]) -> list[int]:
        """After a push to ``urls``, once those engines generate again (resumed, their memory back):
        the STALE engines among them rejoin the router; their ranks.

        Not before: with its health checks off the router still sends one ``GET /health`` when a worker
        is added, and on SGLang that is a generation, 503 while the engine is paused (a restarted
        engine added then was never accepted) and a generation on freed memory while it is released.
        An engine that does not answer a liveness probe, or that the router refuses, is FAILED again
        (the next round restarts it)."""
        with self._lock:
            back = [e for e in self.engines if e.state is EngineState.STALE and e.url in urls]
        rejoined = []
        for engine in back:
            codes = self.pool.exit_codes(engine.rank)
            problem = engine_problem(engine.url, codes, self.timeout_s, generate=False)
            if problem is None:
                try:
                    self.router.add_worker(engine.url)
                except RouterError as exc:
                    problem = str(exc)
            with self._lock:
                if problem is not None:
                    engine.fail(self.clock(), problem)
                else:
                    engine.serve(self.clock())
            if problem is not None:
                logger.error(
                    "engine %d (%s) could not rejoin the router: %s", engine.rank, engine.url, problem
                )
                continue
            rejoined.append(engine.rank)
            logger.info("engine %d (%s) has the current weights and serves again", engine.rank, engine.url)
        return rejoined

    def counters(self) -> dict[str, float]:
        """Totals so far: ``fault/engine_restarts`` and ``fault/unhealthy_seconds`` (summed over engines)."""
        now = self.clock()
        with self._lock:
            return {
                "fault/engine_restarts": float(sum(e.restarts for e in self.engines)),
                "fault/unhealthy_seconds": sum(e.unhealthy_seconds(now) for e in self.engines),
            }
