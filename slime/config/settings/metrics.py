"""Where a run's metrics go: TensorBoard always, Weights & Biases on request."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime.utils.http import SECRET_FLAGS


@dataclass(frozen=True, kw_only=True)
class MetricsSettings:
    tensorboard_dir: Path
    """``--tb-dir``, else ``<--save>/tensorboard`` (``outputs/tensorboard`` without ``--save``)."""
    num_rollout: int | None
    """The run's length, for the progress the logs show."""
    use_wandb: bool = False
    wandb_project: str | None = None
    wandb_group: str | None = None
    wandb_mode: str | None = None
    run_config: dict[str, Any] = field(default_factory=dict, compare=False)
    """The run's flags as wandb records them, the engines' API key redacted."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MetricsSettings:
        return cls(
            tensorboard_dir=Path(args.tb_dir or Path(args.save or "outputs") / "tensorboard"),
            num_rollout=args.num_rollout,
            use_wandb=bool(args.use_wandb),
            wandb_project=args.wandb_project,
            wandb_group=args.wandb_group,
            wandb_mode=args.wandb_mode,
            run_config=run_config(args) if args.use_wandb else {},
        )


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """``args`` as a run's record keeps them: ``--sglang-api-key`` (the engines' key) never leaves the run."""
    server_args = {
        name: "<redacted>" if f"--{name.replace('_', '-')}" in SECRET_FLAGS else value
        for name, value in (args.sglang_server_args or {}).items()
    }
    return {**vars(args), "sglang_server_args": server_args}
