"""slime's overlapped training loop: rollout n+1 is generated while the trainer trains on rollout n.

    python train_async.py ${MODEL_ARGS[@]} --hf-checkpoint DIR --prompt-data train.jsonl \\
        --rollout-num-gpus 2 --async-buffer-size 1 --update-weights-interval 1 ...

The same flags, logging, checkpoints and exit codes as ``train.py``; engines and trainer need GPUs of
their own (no ``--colocate``). Generation runs at most ``--async-buffer-size`` rollouts ahead; weights
go to the engines every ``--update-weights-interval`` rollouts, between two rollouts' generation.
Each sample is trained on by a policy at most that many updates newer than the one that generated
it: logged as ``rollout/staleness``.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

from slime.cli import check_overlappable, run_entry_point
from slime.config.settings.run import RunSettings
from slime.ray.loop import RolloutLoop
from slime.ray.rollouts_ahead import RolloutsAhead
from slime.ray.session import TrainingSession
from slime.utils.peak_memory import PeakMemoryMonitor

logger = logging.getLogger("slime")


def train(settings: RunSettings) -> None:
    settings = settings.overlapped()
    with PeakMemoryMonitor() as memory, TrainingSession(settings) as session, RolloutLoop(session) as loop:
        rollout_ids = loop.rollout_ids()
        with RolloutsAhead(loop.generate, rollout_ids, settings.loop.async_buffer_size) as ahead:
            for rollout_id in tqdm(rollout_ids, desc="rollouts", unit="rollout"):
                batch = ahead.next(rollout_id)  # generated while the previous rollout trained
                if loop.push_due(rollout_id):  # the engines pause once the rollout ahead is done
                    ahead.when_idle(session.pause_for_push)
                metrics = loop.train(batch)
                loop.save(rollout_id)
                if loop.push_due(rollout_id):
                    with ahead.paused():  # waits only for the rollout being generated right now
                        metrics.update(loop.push_weights())
                loop.finish(rollout_id, metrics)
    logger.info("done; peak memory of all processes %.2f GiB", memory.peak_bytes / 2**30)


if __name__ == "__main__":
    run_entry_point(train, check_overlappable)
