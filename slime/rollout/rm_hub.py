"""Upstream slime's reward entry points (``slime.rollout.rm_hub``) over ``slime.rollout.rewards``.

Custom generate and reward functions written for THUDM/slime call ``await async_rm(args, sample)`` to
score with the run's reward flags, or ``batched_async_rm(args, samples)`` for a list. Which function
scores is ours (``rewards.scoring``: ``--custom-rm-path``, then ``metadata["rm_type"]``, then
``--rm-type``), so the built-in names are ours (``math``, ``exact``, ``f1``, ``remote``), not
upstream's (docs/guides/upstream-compat.md).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from slime.rollout.rewards.scoring import RewardValue, compute_reward, load_reward_function
from slime.rollout.sample import Sample


async def async_rm(args: argparse.Namespace, sample: Sample, **kwargs: Any) -> RewardValue:
    """The reward of one sample by the reward flags, as its function returned it (``kwargs``, which
    upstream forwards to a custom function, are accepted for its callers and not used)."""
    return await compute_reward(args, sample)


async def batched_async_rm(
    args: argparse.Namespace, samples: list[Sample], **kwargs: Any
) -> list[RewardValue]:
    """The rewards of ``samples``: as upstream, ``--custom-rm-path`` is called once with the whole list
    (a batch reward function, ``fn(args, samples) -> list``); otherwise each sample is scored
    concurrently."""
    if args.custom_rm_path is not None:
        result = load_reward_function(args.custom_rm_path)(args, samples)
        return list(await result if asyncio.iscoroutine(result) else result)
    return list(await asyncio.gather(*(compute_reward(args, sample) for sample in samples)))
