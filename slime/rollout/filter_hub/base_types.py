"""Upstream's filter verdict type: ``DynamicFilterOutput(keep, reason)`` is our ``FilterResult``, so a
filter written for THUDM/slime returns something our rollout reads. Upstream's third field,
``keep_when_insufficient``, has no counterpart here (docs/guides/upstream-compat.md)."""

from slime.rollout.filters import FilterResult

DynamicFilterOutput = FilterResult

__all__ = ["DynamicFilterOutput"]
