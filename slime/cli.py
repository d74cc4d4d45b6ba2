"""The command-line wrapper shared by ``train.py`` and ``train_async.py``: flags, logging, exit codes.

Both entry points behave alike for the user: a configuration or data error is one line and exit
status 2 before anything starts; Ctrl-C (or SIGTERM) stops every process of the run and exits 130.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from slime.config import ConfigError, check_implemented, parse_args
from slime.rollout.data_source import DataError
from slime.utils.metrics import setup_logging
from slime.weight_sync.engine_client import EngineCallError

logger = logging.getLogger("slime")

Check = Callable[[argparse.Namespace], None]


def run_entry_point(train: Callable[[argparse.Namespace], None], *checks: Check) -> None:
    """Parses the flags, runs ``checks`` (entry-point specific, raising ``ConfigError``), then ``train``."""
    args = parse_args()
    setup_logging(args.log_level)
    try:
        for check in (*checks, check_implemented):
            check(args)
        train(args)
    except (ConfigError, DataError) as error:  # raised before any process started
        print(error.line(), file=sys.stderr)
        sys.exit(2)
    except EngineCallError as error:  # the run stopped; the session stopped every process first
        logger.error("%s; every process of the run was stopped", error)
        sys.exit(1)
    except KeyboardInterrupt:
        logger.error("interrupted; every process of the run was stopped")
        sys.exit(130)
