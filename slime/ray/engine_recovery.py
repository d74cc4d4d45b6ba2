"""What a failed engine costs on the rollout side: with ``--use-fault-tolerance`` it is replaced while
the run goes on (``EngineRecovery``); without, the run stops in one line naming it (``EngineWatch``).

``EngineRecovery`` owns the engines' health (``engine_health``) and acts on a failure at once:
the engine leaves the router (no new request reaches it; the requests it held fail and the
rollout sends them again, ``generate_utils``), every process of it is stopped and it is started
again on its own bundles (``EnginePool.restart``). It then waits, STALE and out of the router, for
the next weight push, which gives it the trainer's weights and version (``TrainingSession``
reconnects the trainer to the engines' new URLs first); ``weights_pushed`` puts it back.

Both probe the same way (``engine_health.HealthMonitor``, ``engines.engine_problem``), so a hung engine
is found in a plain run too: the rollout sets no total timeout on its requests (a long generation is not
an error), and without the probes a hung engine would hold the run for good.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable

from slime.ray.engine_health import EngineHealth, EngineState, HealthMonitor
from slime.ray.engines import ADD_FAULT_TOLERANCE, EnginePool, EngineStartError, engine_problem
from slime.rollout.errors import EngineFailure
from slime.rollout.router import Router, RouterError

logger = logging.getLogger(__name__)

RESTART_FAILED = "; its restart failed: "


class _ProbedEngines:
    """The engines of one ``EnginePool``, HEALTHY at first, probed as the ``--rollout-health-check-*``
    flags say; what a failure does is the subclass's ``_on_failure``."""

    def __init__(
        self, args: argparse.Namespace, pool: EnginePool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pool, self.clock = pool, clock
        timeout_s = args.rollout_health_check_timeout
        self.engines = [EngineHealth(rank, url) for rank, url in enumerate(pool.urls)]
        self.monitor = HealthMonitor(
            self.engines,
            lambda engine: engine_problem(engine.url, pool.exit_codes(engine.rank), timeout_s),
            self._on_failure,
            interval_s=args.rollout_health_check_interval,
            first_wait_s=args.rollout_health_check_first_wait,
            clock=clock,
        )

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
        self, args: argparse.Namespace, pool: EnginePool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(args, pool, clock)
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
        args: argparse.Namespace,
        pool: EnginePool,
        router: Router,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(args, pool, clock)
        self.router = router
        self._lock = threading.Lock()

    def _on_failure(self, engine: EngineHealth, reason: str) -> None:
        """Out of the router, stopped, started again; STALE until the next push (FAILED if it does not
        come up: the run goes on with the others, the next round tries again, and the run stops when
        none is left)."""
        logger.warning("engine %d (%s) %s; restarting it", engine.rank, engine.url, reason)
        with self._lock:
            engine.fail(self.clock(), reason)
        try:
            self.router.remove_worker(engine.url)
        except RouterError as exc:  # not listed any more: nothing to take out
            logger.info("engine %d: %s", engine.rank, exc)
        with self._lock:
            engine.restart()
        try:
            url = self.pool.restart(engine.rank)
        except EngineStartError as exc:
            logger.error("engine %d did not come back: %s", engine.rank, exc)
            cause = reason.split(RESTART_FAILED)[0]  # a retry keeps the first cause, not a growing chain
            with self._lock:
                engine.fail(self.clock(), f"{cause}{RESTART_FAILED}{str(exc).splitlines()[0]}")
            return
        with self._lock:
            engine.restarted(url)
        logger.info("engine %d restarted at %s; it serves again after the next weight push", engine.rank, url)

    def check_now(self) -> None:
        """One probe round at once (before a push: an engine that died since the last round is
        restarted now, so this push gives it the weights instead of failing on it)."""
        self.monitor.tick(force=True)

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

    def weights_pushed(self, urls: list[str]) -> list[int]:
        """After a push to ``urls``: the STALE engines among them rejoin the router; their ranks."""
        with self._lock:
            back = [e for e in self.engines if e.state is EngineState.STALE and e.url in urls]
        for engine in back:
            self.router.add_worker(engine.url)
            with self._lock:
                engine.serve(self.clock())
            logger.info("engine %d (%s) has the current weights and serves again", engine.rank, engine.url)
        return [engine.rank for engine in back]

    def counters(self) -> dict[str, float]:
        """Totals so far: ``fault/engine_restarts`` and ``fault/unhealthy_seconds`` (summed over engines)."""
        now = self.clock()
        with self._lock:
            return {
                "fault/engine_restarts": float(sum(e.restarts for e in self.engines)),
                "fault/unhealthy_seconds": sum(e.unhealthy_seconds(now) for e in self.engines),
            }
