"""On-policy distillation: which teachers score a rollout's tokens, and how much their reverse KL weighs.

The rollout side asks a teacher engine for the log-probs of every sampled token (``slime.rollout.teacher``)
and the trainer shapes each token's advantage with them (``slime.algorithms.distillation``). Teachers are
engines of their own: served elsewhere (``--opd-teacher-urls``) or started by the run from
``--opd-teacher-hf-checkpoint`` on GPUs no trainer or rollout engine uses, never given new weights.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from slime.config.errors import ConfigError

DEFAULT_TEACHER = "default"
"""The teacher of every sample whose metadata names none; a run with OPD always has one."""


def parse_teacher_urls(values: list[str]) -> dict[str, str]:
    """``--opd-teacher-urls name=url ...`` as ``{name: url}`` (a URL without a scheme gets ``http://``)."""
    teachers: dict[str, str] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url:
            raise ConfigError(
                "--opd-teacher-urls", f"{value!r} is not NAME=URL (e.g. default=http://host:30000)"
            )
        if name in teachers:
            raise ConfigError("--opd-teacher-urls", f"teacher {name!r} is given twice")
        teachers[name] = url if url.startswith(("http://", "https://")) else f"http://{url}"
    return teachers


@dataclass(frozen=True)
class OpdSettings:
    enabled: bool = False
    """``--use-opd``."""
    kl_coef: float = 1.0
    """``--opd-kl-coef``: each token's advantage loses ``kl_coef · (log π_student − log π_teacher)``."""
    teacher_urls: dict[str, str] = field(default_factory=dict)
    """Teachers by name (``--opd-teacher-urls``, plus ``default`` once the run's own teacher engines are
    up). Several URLs of one run-started teacher are joined by spaces and used in turn."""
    teacher_hf_checkpoint: str | None = None
    """``--opd-teacher-hf-checkpoint``: the run starts ``num_teacher_engines`` engines of it."""
    num_teacher_engines: int = 1
    teacher_gpus_per_engine: int = 1
    teacher_key: str = "teacher"
    """``--opd-teacher-key``: the sample metadata entry that names its teacher."""
    opd_only: bool = False
    """``--opd-only``: the task reward is 0 and the teacher is the only signal."""

    @property
    def teacher_gpus(self) -> int:
        """GPUs (placement bundles) of the run's own teacher engines."""
        return self.num_teacher_engines * self.teacher_gpus_per_engine if self.teacher_hf_checkpoint else 0

    @property
    def scores_in_rollout(self) -> bool:
        """Whether the rollout asks teachers itself; without any, a plugin must set ``teacher_log_probs``
        (upstream slime's reward + post-process form)."""
        return self.enabled and bool(self.teacher_urls or self.teacher_hf_checkpoint)

    def teacher_of(self, metadata: dict[str, Any]) -> str:
        """The name of a sample's teacher: ``metadata[teacher_key]``, else ``default``."""
        name = metadata.get(self.teacher_key) or DEFAULT_TEACHER
        if name not in self.teacher_urls:
            raise KeyError(
                f"sample metadata {self.teacher_key}={name!r} names no teacher; "
                f"--opd-teacher-urls has {', '.join(sorted(self.teacher_urls)) or 'none'}"
            )
        return str(name)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OpdSettings:
        return cls(
            enabled=bool(args.use_opd),
            kl_coef=float(args.opd_kl_coef),
            teacher_urls=parse_teacher_urls(args.opd_teacher_urls or []),
            teacher_hf_checkpoint=args.opd_teacher_hf_checkpoint,
            num_teacher_engines=args.opd_teacher_num_engines,
            teacher_gpus_per_engine=args.opd_teacher_num_gpus_per_engine or args.rollout_num_gpus_per_engine,
            teacher_key=args.opd_teacher_key,
            opd_only=bool(args.opd_only),
        )
