"""Reward functions: built-ins (math, exact, f1, remote), custom ones by dotted path, batch scoring.

Rollout code calls ``score_groups(args, groups, reward_settings)``; a custom generate function that
scores as it goes calls ``compute_reward(args, sample)``. New built-ins go into ``BUILTIN_REWARDS`` in
``scoring.py``.
"""

from slime.rollout.rewards.errors import RewardError
from slime.rollout.rewards.math_answer import extract_answer, math_score, normalize_answer
from slime.rollout.rewards.remote import post_reward
from slime.rollout.rewards.scoring import (
    BUILTIN_REWARDS,
    RewardChoice,
    compute_reward,
    resolve_reward_fn,
    score_groups,
)
from slime.rollout.rewards.text import exact_score, f1_score

__all__ = [
    "BUILTIN_REWARDS",
    "RewardChoice",
    "RewardError",
    "compute_reward",
    "exact_score",
    "extract_answer",
    "f1_score",
    "math_score",
    "normalize_answer",
    "post_reward",
    "resolve_reward_fn",
    "score_groups",
]
