"""Upstream's built-in dynamic-sampling filter, at its import path, over ``keep_varied_rewards``."""

from __future__ import annotations

import argparse
from typing import Any

from slime.rollout.filters import FilterResult, varied_rewards
from slime.rollout.sample import Sample

__all__ = ["check_reward_nonzero_std"]


def check_reward_nonzero_std(args: argparse.Namespace, samples: list[Sample], **kwargs: Any) -> FilterResult:
    """Keeps a group whose rewards are not all equal (GRPO learns nothing from it otherwise); a dropped
    group is counted under upstream's reason ``zero_std_<reward>``. Unlike upstream, samples whose
    reward function failed are left out of the comparison (``varied_rewards``)."""
    verdict = varied_rewards(samples, args.reward_key)
    if verdict.keep:
        return verdict
    scored = [s.reward_value(args.reward_key) for s in samples if s.status != Sample.Status.FAILED]
    return FilterResult(False, f"zero_std_{round(scored[0], 1)}" if scored else verdict.reason)
