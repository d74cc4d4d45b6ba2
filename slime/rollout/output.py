"""What a rollout function returns: the sample groups to train on and the metrics the rollout measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from slime.rollout.sample import Sample


@dataclass
class RolloutOutput:
    """``--rollout-function-path``'s result.

    Training (``evaluation=False``): ``groups`` are ``--rollout-batch-size`` scored prompt groups, in
    the order to train on. Evaluation: ``groups`` may be empty, ``metrics`` holds ``eval/<name>`` and
    ``eval_groups`` each set's scored groups (one per prompt, in the set's order), which the rollout
    manager writes out one sample a line; a rollout function that leaves it empty writes no file.
    ``metrics`` are logged with the rollout (e.g. ``rollout/dynamic_sampling/dropped/<reason>``).
    """

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)
    eval_groups: dict[str, list[list[Sample]]] = field(default_factory=dict)
