"""Everything a training run starts, started in order and stopped in reverse, whatever happens.

``TrainingSession`` is a context manager: leaving it normally, by an exception or by Ctrl-C stops the
trainer actors, the engines, the router and the placement group, and shuts down the Ray cluster the
run started itself, so no process outlives the run.
"""

from __future__ import annotations

import argparse
import logging
import signal
from types import FrameType

import ray

from slime.ray.cluster import (
    create_placement_group,
    release_placement_group,
    start_ray,
    total_gpus,
    trainer_gpus,
)
from slime.ray.trainer_group import TrainerGroup

logger = logging.getLogger("slime")


def _sigterm_to_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def uses_engines(args: argparse.Namespace) -> bool:
    """SFT and train-only debugging need no rollout engines."""
    return not args.debug_train_only and args.loss_type != "sft_loss"


class TrainingSession:
    """Ray, one placement group, the rollout manager and the trainer group of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pg = None
        self.trainer: TrainerGroup | None = None
        self.rollout = None
        self.start_rollout_id = 0
        self.weight_version = 0
        self._owns_ray = False

    def __enter__(self) -> TrainingSession:
        signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        from slime.ray.rollout_manager import RolloutManager, load_eval_datasets
        from slime.rollout.data_source import PromptDataSource

        args = self.args
        # Read (and so check) the data before any process starts: a bad line is a one-line error.
        data_source = PromptDataSource.from_args(args)
        eval_datasets = load_eval_datasets(args)
        self._owns_ray = not ray.is_initialized() and not args.ray_address
        start_ray(args)
        engines = uses_engines(args)
        num_trainers = trainer_gpus(args)
        self.pg = create_placement_group(total_gpus(args) if engines else num_trainers)
        trainer_bundles = list(range(num_trainers))
        rollout_bundles = []
        if engines:
            first = 0 if args.colocate else num_trainers
            rollout_bundles = list(range(first, first + args.rollout_num_gpus))
        self.rollout = RolloutManager.options(num_cpus=0).remote(
            args, self.pg, rollout_bundles, data_source=data_source, eval_datasets=eval_datasets
        )
        self.trainer = TrainerGroup(args, self.pg, trainer_bundles)
        # Engines load their weights while the trainer builds its model.
        engine_urls_ref = self.rollout.start.remote()
        loaded = self.trainer.init()
        engine_urls, _router_url = ray.get(engine_urls_ref)
        if loaded is not None:
            self.start_rollout_id = loaded + 1
            ray.get(self.rollout.load.remote(loaded))
            logger.info("resumed from %s at rollout %d", args.load, self.start_rollout_id)
        if engines:
            self.trainer.connect_engines(engine_urls, args.rollout_num_gpus_per_engine)

    def push_weights(self) -> dict[str, float]:
        """Trainer weights to every engine; the engines' ``weight_version`` becomes the number of pushes.

        Generation is paused around the update (nothing runs in the synchronous loop, but a request
        must never decode with half-updated weights); the last bucket flushes the engines' caches.
        """
        if not uses_engines(self.args):
            return {}
        self.weight_version += 1
        ray.get(self.rollout.pause.remote(mode="abort"))
        try:
            return self.trainer.update_weights(str(self.weight_version))
        finally:
            ray.get(self.rollout.resume.remote())

    def close(self) -> None:
        """Stops everything that was started, in reverse order; safe after a partial start."""
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None
        if self.rollout is not None:
            try:
                ray.get(self.rollout.shutdown.remote(), timeout=120)
            except Exception as exc:  # the manager died: its engines die with their actors below
                logger.warning("rollout manager shutdown failed: %s", exc)
            ray.kill(self.rollout)
            self.rollout = None
        if self.pg is not None:
            release_placement_group(self.pg)
            self.pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
