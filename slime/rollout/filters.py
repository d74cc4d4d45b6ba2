"""Dynamic-sampling filters: which finished prompt groups a rollout trains on.

``--dynamic-sampling-filter-path`` names ``fn(args, group) -> FilterResult | bool``. The rollout keeps
sampling ``--over-sampling-batch-size`` prompts at a time until ``--rollout-batch-size`` groups are
kept, then aborts what is still generating; dropped groups are counted per ``reason`` in the rollout
metrics (``rollout/dynamic_sampling/dropped/<reason>``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime.config.settings.rollout import RewardSettings
from slime.rollout.plugin_args import settings_of
from slime.rollout.sample import Sample

DEFAULT_DROP_REASON = "filtered"


@dataclass(frozen=True)
class FilterResult:
    """A filter's verdict on one group; ``reason`` names why it was dropped (a metric key)."""

    keep: bool
    reason: str | None = None


def as_filter_result(verdict: FilterResult | bool) -> FilterResult:
    """A filter may answer a plain bool; anything else is a contract error."""
    if isinstance(verdict, FilterResult):
        return verdict
    if isinstance(verdict, bool):
        return FilterResult(verdict, None if verdict else DEFAULT_DROP_REASON)
    raise TypeError(
        f"a dynamic-sampling filter returned {type(verdict).__name__}; expected FilterResult or bool"
    )


def keep_varied_rewards(args: argparse.Namespace, group: list[Sample]) -> FilterResult:
    """Drops groups whose rewards all agree: with group-relative advantages they train on nothing.

    Samples whose reward function failed have no reward: they neither vary a group nor count in it.
    """
    return varied_rewards(group, settings_of(args, RewardSettings).reward_key)


def varied_rewards(group: list[Sample], reward_key: str | None) -> FilterResult:
    """``keep_varied_rewards`` with the reward key given (upstream's filter reads it from its ``args``)."""
    rewards = [s.reward_value(reward_key) for s in group if s.status != Sample.Status.FAILED]
    if len(rewards) < 2 or max(rewards) == min(rewards):
        return FilterResult(False, "rewards_all_equal")
    return FilterResult(True)
