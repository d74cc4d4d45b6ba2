"""Killing a trainer rank on purpose, for the trainer-failure tests (``tests/e2e/test_trainer_failures.py``).

Real ranks die of OOM, NCCL errors or lost nodes; the tests need one that dies at a chosen rollout of
a ``train.py`` run they start as a subprocess, so the kill is armed by that run's environment:
``SLIME_TEST_KILL_TRAINER_AT_ROLLOUT=k`` and ``SLIME_TEST_KILL_TRAINER_MARKER=FILE``. The trainer
group reads them once, when it is built, and hands a ``TrainerKill`` to its last rank only then; a
run without them builds none, and its ranks train without calling into this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

KILL_AT_ROLLOUT_ENV = "SLIME_TEST_KILL_TRAINER_AT_ROLLOUT"
KILL_MARKER_ENV = "SLIME_TEST_KILL_TRAINER_MARKER"


@dataclass(frozen=True)
class TrainerKill:
    """The rank that holds it saves the train data of rollout ``at_rollout`` to ``marker`` and exits its
    process at once, as a killed rank does. An existing ``marker`` disarms it, so the run resumed after
    the kill (``--auto-resume``, a new trainer group in the same driver) goes on."""

    at_rollout: int
    marker: str

    @classmethod
    def from_env(cls) -> TrainerKill | None:
        """The kill this process's environment arms; None (the production case) without both variables."""
        at_rollout, marker = os.environ.get(KILL_AT_ROLLOUT_ENV), os.environ.get(KILL_MARKER_ENV)
        if not at_rollout or not marker:
            return None
        return cls(int(at_rollout), marker)

    def before_training(self, rollout_id: int, data: dict[str, Any]) -> None:
        """Dies here if ``rollout_id`` is the chosen one and the marker does not exist yet."""
        if rollout_id != self.at_rollout or os.path.exists(self.marker):
            return
        import torch

        torch.save(data, self.marker)
        os._exit(1)
