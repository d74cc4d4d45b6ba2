"""Generation that runs ahead of training: the overlap ``train_async.py`` is built on.

The rollout manager is its own Ray actor, so a driver thread can wait on rollout n+1's generation
while the main thread waits on the trainer's step over rollout n. Rollouts are generated one at a
time and in order, so the data source hands out prompts exactly as in ``train.py``; at most
``ahead`` finished rollouts wait for the trainer, which bounds how stale their weights can be.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from slime.rollout.train_data import RolloutBatch


class RolloutsAhead:
    """Generates ``rollout_ids`` on a background thread; ``next`` hands them to the trainer in order.

    ``paused()`` is for weight pushes: it waits for the rollout being generated to finish (never
    aborting it halfway, which would cut responses short) and starts no new one until the push is
    done, so every rollout is generated with one set of weights. ``when_idle`` lets the push's
    preparation (the engines' pause) run as soon as generation has stopped, while the trainer trains.
    """

    def __init__(self, generate: Callable[[int], RolloutBatch], rollout_ids: range, ahead: int) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {ahead}")
        self._generate, self._rollout_ids, self._ahead = generate, rollout_ids, ahead
        self._ready: dict[int, RolloutBatch] = {}
        self._generating = self._held = self._stopped = False
        self._error: BaseException | None = None
        self._on_idle: Callable[[], None] | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rollouts-ahead", daemon=True)

    def __enter__(self) -> RolloutsAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # A generation still running ends when the session stops the rollout manager.
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _may_start(self) -> bool:
        return self._stopped or (not self._held and len(self._ready) < self._ahead)

    def _run(self) -> None:
        for rollout_id in self._rollout_ids:
            with self._cond:
                self._cond.wait_for(self._may_start)
                if self._stopped:
                    return
                self._generating = True
            try:
                batch = self._generate(rollout_id)
            except BaseException as error:
                with self._cond:
                    self._error, self._generating = error, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[rollout_id] = batch
                self._generating = False
                self._fire_if_idle()
                self._cond.notify_all()

    def when_idle(self, action: Callable[[], None]) -> None:
        """Calls ``action`` (once) as soon as nothing generates and nothing can start until the trainer
        takes the next rollout: now, or when the running generation ends. For the push after the
        rollout being trained, which comes before that ``next``."""
        with self._cond:
            self._on_idle = action
            self._fire_if_idle()

    def _fire_if_idle(self) -> None:
        """Under ``_cond``: runs the ``when_idle`` action if generation has stopped until the next ``next``
        (the buffer is full). ``action`` must not block: it runs with the lock held."""
        if self._on_idle is not None and not self._generating and len(self._ready) >= self._ahead:
            action, self._on_idle = self._on_idle, None
            action()

    def next(self, rollout_id: int) -> RolloutBatch:
        """Rollout ``rollout_id``'s data, waiting if it is not generated yet (``perf/rollout_wait_time``).

        Raises the generation's error if generation failed before reaching it.
        """
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: rollout_id in self._ready or self._error is not None)
            if rollout_id not in self._ready:
                assert self._error is not None  # what wait_for returned on
                raise self._error
            batch = self._ready.pop(rollout_id)
            self._cond.notify_all()
        batch.metrics["perf/rollout_wait_time"] = time.perf_counter() - start
        return batch

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No generation inside: waits for the running one, holds the next one back until exit."""
        with self._cond:
            self._held = True
            self._cond.wait_for(lambda: not self._generating)
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()
