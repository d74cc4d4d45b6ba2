"""The names ``--rm-type`` accepts, as data: validation refuses an unknown one before anything starts,
and ``slime.rollout.rewards.scoring`` maps each to its function (``BUILTIN_REWARDS``, same order)."""

from __future__ import annotations

BUILTIN_REWARD_TYPES: tuple[str, ...] = (
    "math",
    "exact",
    "f1",
    "remote",
    "remote_rm",
    "deepscaler",
    "dapo",
    "random",
)
"""``deepscaler``, ``dapo``, ``random`` and ``remote_rm`` are upstream slime's names."""

BOXED_PREFIX = "boxed_"
"""``--rm-type boxed_<type>`` (upstream's): ``<type>`` scores the response's last ``\\boxed{}`` only."""
