"""Shared by the checkpoint conversion tools: parse train.py's flags, run a trainer group, clean up.

The conversion tools only build the model and save or load it, so the flags train.py requires for
training (``--rollout-batch-size``, ``--num-rollout``, ``--lr``) are given defaults here; the user's
own values, when given, come later on the command line and win.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

from slime.config import ConfigError, parse_args

_CONVERSION_DEFAULTS = ["--debug-train-only", "--rollout-batch-size", "1", "--num-rollout", "1", "--lr", "0"]


def fail(flag: str, message: str) -> NoReturn:
    """One ``error: <flag>: <problem>; <fix>`` line on stderr and exit 2, as the parser does."""
    sys.stderr.write(ConfigError(flag, message).line() + "\n")
    sys.exit(2)


def parse_conversion_args(
    argv: list[str] | None, check: Callable[[argparse.Namespace], None]
) -> argparse.Namespace:
    """train.py's parser with the training-only flags defaulted; ``check`` raises ConfigError on bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args([*_CONVERSION_DEFAULTS, *argv])
    try:
        check(args)
    except ConfigError as e:
        fail(e.flag, e.message)
    return args


@contextlib.contextmanager
def trainer_group(args: argparse.Namespace) -> Iterator:
    """A started TrainerGroup on one bundle per trainer rank; Ray and the bundles are released after."""
    import ray

    from slime.config.settings.run import RunSettings
    from slime.ray.cluster import bundle_order, create_placement_group, release_placement_group, start_ray
    from slime.ray.trainer_group import TrainerGroup

    settings = RunSettings.from_args(args)
    pg = group = None
    try:
        start_ray(settings.cluster)
        world = settings.cluster.trainer_gpus
        pg = create_placement_group(world)
        group = TrainerGroup(
            settings.trainer,
            settings.weight_sync,
            settings.plugin_args,
            pg,
            bundle_order(pg, world),
            call_timeout_s=settings.fault_tolerance.trainer_call_timeout_s,
        )
        group.init()
        yield group
    finally:
        if group is not None:
            group.shutdown()
        with contextlib.suppress(Exception):
            release_placement_group(pg)
        ray.shutdown()
