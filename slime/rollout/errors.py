"""The run-time error types of the rollout package: one line each, the run is stopped."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """A rollout that cannot go on: a generate plugin broke its contract, or the rollout would draw
    prompts without end. Its message is the one line the user sees (``slime.cli``); the run is stopped.
    """


class EngineFailure(RolloutError):
    """Engines that failed during the run: one line naming each, what it answered or how its process
    ended, and what to do (``--use-fault-tolerance``, or that none is left to recover)."""
