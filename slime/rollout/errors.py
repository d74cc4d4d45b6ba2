"""The one run-time error type of the rollout package."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """A rollout that cannot go on: a generate plugin broke its contract, or the rollout would draw
    prompts without end. Its message is the one line the user sees (``slime.cli``); the run is stopped.
    """
