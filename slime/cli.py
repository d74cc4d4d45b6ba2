"""The command-line wrapper shared by ``train.py`` and ``train_async.py``: flags, logging, exit codes.

Both entry points behave alike for the user: a configuration or data error is one line and exit
status 2 before anything starts; Ctrl-C (or SIGTERM) stops every process of the run and exits 130;
a run-time error that names its culprit (an engine, a plugin, a trainer rank, the Ray cluster) is
one line and exit status 1. With ``--auto-resume N`` a trainer failure restarts the run from its
last checkpoint, at most N times, before it counts as that error.
The checks that depend on the entry point rather than on the flags alone live here too: a flag
whose feature has not landed (every entry point) and the overlapped loop's (``train_async.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from slime.config import ConfigError, parse_args
from slime.config.settings.run import RunSettings
from slime.engine_client.calls import EngineCallError
from slime.ray.errors import RayClusterUnreachable, TrainerFailure
from slime.rollout.errors import RolloutError
from slime.rollout.prompt_files import DataError
from slime.utils.metrics import setup_logging
from slime.utils.startup import mark

logger = logging.getLogger("slime")

Check = Callable[[argparse.Namespace], None]
Train = Callable[[RunSettings], None]

# Run-time errors whose message is the whole story (they name the engine, plugin, rank or cluster at fault).
# DataError here: under --streaming-data a malformed record is met when it is served.
ONE_LINE_RUN_ERRORS = (EngineCallError, RolloutError, TrainerFailure, RayClusterUnreachable, DataError)

# Flags the parser knows (so scripts written for slime parse) whose implementation has not landed:
# refusing them beats silently training without them. Each entry: (flag, is it set?, what to do).
_NOT_YET_IMPLEMENTED = (
    ("--ref-load", lambda a: a.ref_load is not None, "drop it (the reference is --hf-checkpoint)"),
)


def check_implemented(args: argparse.Namespace) -> None:
    """Raises ConfigError for a flag whose feature has not landed yet (entry points call it)."""
    for flag, is_set, fix in _NOT_YET_IMPLEMENTED:
        if is_set(args):
            raise ConfigError(flag, f"is not implemented in this version yet; {fix}")


def check_overlappable(args: argparse.Namespace) -> None:
    """train_async.py generates while it trains, so engines and trainer need GPUs of their own."""
    if args.colocate:
        raise ConfigError(
            "--colocate",
            "train_async.py overlaps generation with training and runs disaggregated only; "
            "drop --colocate and pass --rollout-num-gpus N, or run train.py",
        )


def one_line_cause(error: BaseException) -> BaseException | None:
    """The ``ONE_LINE_RUN_ERRORS`` behind ``error``: itself, or the cause a Ray task error carries
    (raised in an actor, it reaches the driver wrapped, with the actor's traceback as its text)."""
    seen: BaseException | None = error
    while seen is not None:
        cause = getattr(seen, "cause", None)  # ray.exceptions.RayTaskError
        if cause is None and isinstance(seen, ONE_LINE_RUN_ERRORS):
            return seen
        seen = cause if cause is not None else seen.__cause__
    return None


def train_resuming(train: Train, settings: RunSettings) -> None:
    """``train(settings)``; on a ``TrainerFailure``, up to ``--auto-resume`` more times from the last
    checkpoint in ``--save``. The failed run's session has stopped every process; each new call builds
    a fresh one, which resumes as ``--load`` does (rollout id, data position, sampling seeds)."""
    resumed, allowed = 0, settings.fault_tolerance.auto_resume
    while True:
        try:
            return train(settings)
        except TrainerFailure as failure:
            if resumed == allowed:
                raise
            resumed += 1
            count = f"--auto-resume: {resumed} of {allowed}"
            logger.warning(
                "%s; resuming from the last checkpoint in %s (%s)", failure, settings.loop.save, count
            )
            settings = settings.resuming_from_save()


def run_entry_point(train: Train, *checks: Check) -> None:
    """Parses the flags, runs ``checks`` (entry-point specific, raising ``ConfigError``), then ``train``
    with the run's settings."""
    mark("driver: imports done")
    args = parse_args()
    setup_logging(args.log_level)
    mark("driver: flags parsed")
    try:
        for check in (*checks, check_implemented):
            check(args)
        train_resuming(train, RunSettings.from_args(args))
    except (ConfigError, DataError) as error:  # raised before any process started
        print(error.line(), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        logger.error("interrupted; every process of the run was stopped")
        sys.exit(130)
    except Exception as error:  # the run stopped; the session stopped every process first
        cause = one_line_cause(error)
        if cause is None:
            raise
        logger.error("%s; every process of the run was stopped", cause)
        sys.exit(1)
