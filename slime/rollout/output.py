"""What a rollout function returns: the sample groups to train on and the metrics the rollout measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from slime.rollout.sample import Sample


@dataclass
class RolloutOutput:
    """``--rollout-function-path``'s result.

    Training (``evaluation=False``): ``groups`` are ``--rollout-batch-size`` scored prompt groups, in
    the order to train on. Evaluation: ``groups`` may be empty and ``metrics`` holds ``eval/<name>``.
    ``metrics`` are logged with the rollout (e.g. ``rollout/dynamic_sampling/dropped/<reason>``).
    """

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)
