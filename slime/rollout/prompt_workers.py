"""``--num-data-workers N``: prompts parsed, chat-templated and length-checked in N worker processes.

``PromptWorkers`` is a spawn-context process pool whose workers each hold a copy of the
``LazyPrompts`` (index, format, tokenizer) and turn chunks of record positions into Samples.
``Lookahead`` keeps the next positions of the data source's order submitted ahead of their turn (the
next rollout's prompts are read while the current one generates) and hands the results back strictly
in submission order, so what is served never depends on N or on which worker finishes first.

No worker outlives its owner: ``close`` stops them, a worker's crash fails the next ``take`` (a
``BrokenProcessPool``, not a hang), and each worker exits by itself within a second of its parent
dying (killed actors do not run their ``shutdown``).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from slime.rollout.lazy_prompts import LazyPrompts, Outcome

_PROMPTS: LazyPrompts | None = None  # the worker process's copy


def _start_worker(prompts: LazyPrompts, parent_pid: int) -> None:
    global _PROMPTS
    _PROMPTS = prompts
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _outcomes(records: np.ndarray) -> list[Outcome]:
    assert _PROMPTS is not None, "worker started without prompts"
    return _PROMPTS.outcomes(records)


class PromptWorkers:
    """``num_workers`` processes reading ``prompts`` (spawned, so no parent state is forked into them)."""

    def __init__(self, prompts: LazyPrompts, num_workers: int) -> None:
        self.num_workers = num_workers
        self._pool = ProcessPoolExecutor(
            num_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(prompts, os.getpid()),
        )
        self._pids: set[int] = set()

    def submit(self, records: np.ndarray) -> Future[list[Outcome]]:
        """The outcomes of these record positions, computed by some worker."""
        future = self._pool.submit(_outcomes, records)
        self._pids.update(self._pool._processes or {})  # the executor starts workers as work comes
        return future

    def pids(self) -> list[int]:
        """Process ids of every worker started so far, stopped or not (for checks that none is left)."""
        return sorted(self._pids)

    def close(self) -> None:
        """Stops every worker (queued work is dropped); safe to call twice."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class Lookahead:
    """Record positions submitted to the workers ahead of their turn, taken back in the same order."""

    def __init__(self, workers: PromptWorkers) -> None:
        self.workers = workers
        self._pending: deque[tuple[np.ndarray, Future[list[Outcome]]]] = deque()
        self._ready: deque[tuple[int, Outcome]] = deque()
        self.queued = 0
        """Positions submitted and not taken yet."""

    def submit(self, records: np.ndarray) -> None:
        """Queue ``records`` (in serving order), split over the workers."""
        for chunk in np.array_split(records, min(self.workers.num_workers, len(records))):
            self._pending.append((chunk, self.workers.submit(chunk)))
        self.queued += len(records)

    def take(self, record: int) -> Outcome:
        """The outcome of the next queued position, which must be ``record`` (waits for it)."""
        if not self._ready:
            chunk, future = self._pending.popleft()
            self._ready.extend(zip(chunk.tolist(), future.result(), strict=True))
        queued, outcome = self._ready.popleft()
        self.queued -= 1
        if queued != record:
            raise RuntimeError(f"the lookahead read record {queued} where the order has {record}")
        return outcome

    def clear(self) -> None:
        """Forget what was queued (the position moved, e.g. on ``load``); running work is discarded."""
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._ready.clear()
        self.queued = 0
