"""Upstream slime's rollout-function return types (``slime.rollout.base_types``) as our ``RolloutOutput``.

A ``--rollout-function-path`` written for THUDM/slime is ``fn(args, rollout_id, data_source,
evaluation=False)`` and returns ``RolloutFnTrainOutput(samples, metrics)`` when training and
``RolloutFnEvalOutput(data, metrics)`` when evaluating (or, in its legacy form, the bare list / dict).
Both classes here are ``RolloutOutput``s, so the rollout manager takes them as they are.
"""

from __future__ import annotations

import statistics
from typing import Any

from slime.rollout.output import RolloutOutput
from slime.rollout.sample import Sample


class RolloutFnTrainOutput(RolloutOutput):
    """Upstream's training result: ``samples`` are the prompt groups to train on."""

    def __init__(self, samples: list[list[Sample]], metrics: dict[str, Any] | None = None) -> None:
        super().__init__(groups=samples, metrics=dict(metrics or {}))

    @property
    def samples(self) -> list[list[Sample]]:
        """Upstream's name of ``groups``."""
        return self.groups


class RolloutFnEvalOutput(RolloutOutput):
    """Upstream's evaluation result: ``data`` maps each eval set's name to ``{"rewards": [...], ...}``;
    each set is logged as ``eval/<name>``, the mean of its rewards, as our evaluation logs it."""

    def __init__(self, data: dict[str, dict[str, Any]], metrics: dict[str, Any] | None = None) -> None:
        means = {
            f"eval/{name}": statistics.fmean(d["rewards"]) for name, d in data.items() if d.get("rewards")
        }
        super().__init__(groups=[], metrics={**means, **(metrics or {})})
        self.data = data
