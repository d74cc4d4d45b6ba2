"""The run-time errors of the Ray layer whose message is the whole story: a trainer rank that failed or
went silent, a Ray cluster that does not answer. Ray-free, so that ``slime.cli`` can name them
without importing Ray before the flags are parsed."""

from __future__ import annotations


class TrainerFailure(RuntimeError):
    """A trainer (or critic) rank died, raised, or did not answer within ``--trainer-call-timeout``.

    Its message names the rank(s), their node and the cause in one line. The trainer world is broken
    after it; ``--auto-resume`` restarts the run from the last checkpoint (``slime.cli``)."""


class RayClusterUnreachable(RuntimeError):
    """The cluster of ``--ray-address`` (or ``RAY_ADDRESS``) does not answer; nothing was started."""
