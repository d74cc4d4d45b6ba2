"""The one exception type of the reward package."""

from __future__ import annotations


class RewardError(Exception):
    """A reward that cannot be computed: bad configuration, a broken reward function or reward server.

    Raised while resolving the reward function (configuration: stops the rollout) or while scoring one
    sample (that sample is marked FAILED by ``score_groups``).
    """
