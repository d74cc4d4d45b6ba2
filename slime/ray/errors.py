"""The run-time errors of the Ray layer whose message is the whole story: a Ray cluster that does not
answer. Ray-free, so that ``slime.cli`` can name them without importing Ray before the flags are
parsed."""

from __future__ import annotations


class RayClusterUnreachable(RuntimeError):
    """The cluster of ``--ray-address`` (or ``RAY_ADDRESS``) does not answer; nothing was started."""
