"""Stopping a run whose reward function fails on everything.

A reward function that raises or returns no finite number fails only its own sample (``scoring``):
one odd response must not stop a run. One that fails on every sample (a bug, a reward server that is
down, a ``--reward-key`` its dicts do not have) would leave the run training on nothing, a warning per
sample, for as long as it runs. ``RewardFailureStreak`` counts the training rollouts in a row in which
the reward failed on every sample and stops the run in one line naming the reward function once there
are ``--max-failed-reward-rollouts`` of them. A sample counts as scoring marks it: FAILED with
``metadata["reward_error"]``. Samples FAILED in generation (a prompt that fills the context) are not
the reward function's doing, and a rollout with any sample it scored is not a failed one.
"""

from __future__ import annotations

from slime.config.settings.rollout import RewardSettings
from slime.rollout.errors import RolloutError
from slime.rollout.rewards.scoring import RewardChoice
from slime.rollout.sample import Sample


class RewardFailureStreak:
    """The rollouts in a row whose rewards all failed; ``limit`` of them stop the run (0: never)."""

    def __init__(self, limit: int, reward: RewardChoice) -> None:
        self.limit, self.reward = limit, reward
        self.failed_rollouts: list[int] = []

    @classmethod
    def from_settings(cls, reward: RewardSettings) -> RewardFailureStreak:
        return cls(reward.max_failed_reward_rollouts, RewardChoice.from_settings(reward))

    def observe(self, rollout_id: int, groups: list[list[Sample]]) -> None:
        """Counts rollout ``rollout_id``; raises ``RolloutError`` when it makes ``limit`` in a row."""
        samples = [sample for group in groups for sample in group]
        if not samples or not all(_reward_failed(sample) for sample in samples):
            self.failed_rollouts = []
            return
        self.failed_rollouts.append(rollout_id)
        if self.limit and len(self.failed_rollouts) >= self.limit:
            raise RolloutError(self._message(samples[0]))

    def _message(self, sample: Sample) -> str:
        first, last = self.failed_rollouts[0], self.failed_rollouts[-1]
        rollouts = f"rollout {last}" if first == last else f"rollouts {first}-{last}"
        why = str(sample.metadata["reward_error"]).strip().split("\n")[0][:300]
        return (
            f"the reward function {self._function(sample)} failed on every sample of {rollouts} "
            f"({len(self.failed_rollouts)} in a row, --max-failed-reward-rollouts {self.limit}), e.g. "
            f"sample {sample.index}: {why}; fix it (it must return a finite number, or a dict holding "
            "one under --reward-key)"
        )

    def _function(self, sample: Sample) -> str:
        """The reward function that scored ``sample``, as ``resolve_reward_fn`` chose it."""
        if self.reward.custom_rm_path is not None:
            return f"--custom-rm-path {self.reward.custom_rm_path}"
        if sample.metadata.get("rm_type"):
            return f"rm_type {sample.metadata['rm_type']!r} (of the sample's data)"
        return f"--rm-type {self.reward.rm_type}"


def _reward_failed(sample: Sample) -> bool:
    return sample.status == Sample.Status.FAILED and "reward_error" in sample.metadata
