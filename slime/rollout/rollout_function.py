"""The rollout-function contract: how ``--rollout-function-path`` is called and what it must return."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from slime.rollout.output import RolloutOutput
from slime.utils.plugins import load_function

RolloutFn = Callable[[argparse.Namespace, int, Any, bool], RolloutOutput]


class RolloutFunction:
    """The ``--rollout-function-path`` plugin, ``fn(args, rollout_id, data_source, evaluation)``: called
    once per rollout (``evaluation=False``) and once per evaluation with the eval sets.

    A function written for slime's older contract may return the list of sample groups alone.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fn: RolloutFn = load_function(path)

    def __call__(
        self, args: argparse.Namespace, rollout_id: int, data_source: Any, evaluation: bool = False
    ) -> tuple[RolloutOutput, float]:
        """The rollout's output and the seconds it took."""
        start = time.perf_counter()
        output = self.fn(args, rollout_id, data_source, evaluation)
        if isinstance(output, list):
            output = RolloutOutput(output)
        if not isinstance(output, RolloutOutput):
            raise TypeError(
                f"--rollout-function-path {self.path} returned {type(output).__name__}; "
                "expected RolloutOutput(groups, metrics)"
            )
        return output, time.perf_counter() - start
