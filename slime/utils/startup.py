"""Start-up milestones of a run, written by every process that reaches one, for the start-up split.

A run's start-up spans processes: the driver, the rollout manager, each engine actor and its server
process, each trainer rank. Each marks what it reached with ``mark("what")``; with ``SLIME_STARTUP_LOG``
set to a file (``bench/step_profile.py`` sets it), every mark is appended there as one JSON line
(wall time, process id, what), so one file orders the milestones of all processes on one machine.
Without it a mark costs one dictionary lookup. Ray workers and engine servers inherit the variable
from the driver's environment.
"""

from __future__ import annotations

import json
import os
import time

STARTUP_LOG_ENV = "SLIME_STARTUP_LOG"

_reached: set[str] = set()


def mark(what: str, once: bool = False) -> None:
    """Records that this process reached ``what`` now; with ``once`` only its first time."""
    path = os.environ.get(STARTUP_LOG_ENV)
    if not path or (once and what in _reached):
        return
    _reached.add(what)
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "what": what})
    with open(path, "a") as log:  # one short append per line: lines of processes never interleave
        log.write(line + "\n")


def read_marks(path: str | os.PathLike[str]) -> list[dict]:
    """The marks of ``path`` in time order."""
    with open(path) as log:
        marks = [json.loads(line) for line in log if line.strip()]
    return sorted(marks, key=lambda m: m["t"])
