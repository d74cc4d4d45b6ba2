"""slime's synchronous training loop: generate a rollout, train on it, push the weights, repeat.

    python train.py ${MODEL_ARGS[@]} --hf-checkpoint DIR --prompt-data train.jsonl \\
        --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout 100 --rollout-num-gpus 2 ...

Everything that varies (engines, rollout function, loss, parallel layout) lives behind the session
and the loop's steps (``slime.ray.loop``, shared with ``train_async.py``); this file is only the order
of events. ``python train.py --help`` lists every flag:
Megatron-LM's, ``--sglang-*`` and slime's own.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

from slime.cli import run_entry_point
from slime.config.settings.run import RunSettings
from slime.ray.loop import RolloutLoop
from slime.ray.session import TrainingSession
from slime.utils.peak_memory import PeakMemoryMonitor

logger = logging.getLogger("slime")


def train(settings: RunSettings) -> None:
    with PeakMemoryMonitor() as memory, TrainingSession(settings) as session, RolloutLoop(session) as loop:
        for rollout_id in tqdm(loop.rollout_ids(), desc="rollouts", unit="rollout"):
            batch = loop.generate(rollout_id)
            session.hand_gpus_to_trainer()  # --colocate: engines release their memory, the trainer takes it
            if loop.push_due(rollout_id):
                session.pause_for_push()  # nothing generates while the trainer trains: pause now
            metrics = loop.train(batch)
            loop.save(rollout_id)
            if loop.push_due(rollout_id):
                metrics.update(loop.push_weights())
            session.hand_gpus_to_engines()  # --colocate: the trainer releases its memory, engines take it
            loop.finish(rollout_id, metrics)
    logger.info("done; peak memory of all processes %.2f GiB", memory.peak_bytes / 2**30)


if __name__ == "__main__":
    run_entry_point(train)
