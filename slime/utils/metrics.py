"""Where metrics go: TensorBoard (default), wandb (optional), and one console line per rollout."""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

from slime.config.settings.metrics import MetricsSettings

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


class _BackgroundScalars:
    """TensorBoard scalars written on a thread of their own: a rollout's 40-odd ``add_scalar`` calls and
    the flush cost the driver ≈ 3 ms, on the path from one quickstart rollout (≈ 0.25 s) to the next,
    while the thread writes them as the next rollout generates. ``close`` writes what is queued.

    The events are written with TensorBoard's own writer, not ``torch.utils.tensorboard``, which would
    import torch into the driver (1 s of start-up and 250 MB on 2 cores) for the same files."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(directory))
        self._queue: queue.SimpleQueue[tuple[int, dict[str, float]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="tensorboard-scalars", daemon=True)
        self._thread.start()

    def put(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self._queue.put((rollout_id, dict(metrics)))

    def _write(self) -> None:
        while (item := self._queue.get()) is not None:
            rollout_id, metrics = item
            try:
                values = [Summary.Value(tag=key, simple_value=value) for key, value in metrics.items()]
                summary = Summary(value=values)
                self.writer.add_event(Event(wall_time=time.time(), step=rollout_id, summary=summary))
                self.writer.flush()
            except Exception as exc:  # a full disk, say: the run goes on, the console line says it
                logger.warning("TensorBoard scalars of rollout %d not written: %s", rollout_id, exc)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.writer.close()


class MetricsLogger:
    """Writes every metric keyed by rollout id, so curves of resumed runs line up."""

    def __init__(self, settings: MetricsSettings) -> None:
        self.directory = settings.tensorboard_dir
        self.scalars = _BackgroundScalars(self.directory)
        self.num_rollout = settings.num_rollout
        self.wandb = None
        if settings.use_wandb:
            import wandb

            self.wandb = wandb.init(
                project=settings.wandb_project,
                group=settings.wandb_group,
                mode=settings.wandb_mode,
                config=settings.run_config,
            )

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self.scalars.put(rollout_id, metrics)
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
        self.scalars.close()
        if self.wandb is not None:
            self.wandb.finish()
