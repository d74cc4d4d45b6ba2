"""Where metrics go: TensorBoard (default), wandb (optional), and one console line per rollout."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger("slime")

_CONSOLE_KEYS = (
    ("rollout/raw_reward", "reward {:.3f}"),
    ("rollout/response_length", "len {:.1f}"),
    ("train/loss", "loss {:.4f}"),
    ("train/ppo_kl", "ppo_kl {:.2e}"),
    ("train/grad_norm", "grad {:.3f}"),
    ("perf/rollout_time", "rollout {:.1f}s"),
    ("perf/train_time", "train {:.1f}s"),
    ("perf/update_weights_time", "sync {:.2f}s"),
)


def setup_logging(level: str = "INFO") -> None:
    """One format for the driver's log lines; library loggers stay at WARNING."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("slime").setLevel(level.upper())


def tensorboard_dir(args: argparse.Namespace) -> Path:
    """``--tb-dir``, else ``<--save>/tensorboard``, else ``outputs/tensorboard``."""
    if args.tb_dir:
        return Path(args.tb_dir)
    return Path(args.save or "outputs") / "tensorboard"


class MetricsLogger:
    """Writes every metric keyed by rollout id, so curves of resumed runs line up."""

    def __init__(self, args: argparse.Namespace) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = tensorboard_dir(args)
        self.writer = SummaryWriter(log_dir=str(self.directory))
        self.num_rollout = args.num_rollout
        self.wandb = None
        if args.use_wandb:
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project, group=args.wandb_group, mode=args.wandb_mode, config=vars(args)
            )

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, rollout_id)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({**metrics, "rollout_id": rollout_id}, step=rollout_id)
        parts = [fmt.format(metrics[key]) for key, fmt in _CONSOLE_KEYS if key in metrics]
        parts += [
            f"{key} {value:.3f}"
            for key, value in metrics.items()
            if key.count("/") == 1 and key[:5] == "eval/"
        ]
        where = "before training" if rollout_id < 0 else f"rollout {rollout_id}/{self.num_rollout}"
        logger.info("%s | %s", where, " | ".join(parts))

    def close(self) -> None:
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
