"""slime's synchronous training loop: generate a rollout, train on it, push the weights, repeat.

    python train.py ${MODEL_ARGS[@]} --hf-checkpoint DIR --prompt-data train.jsonl \\
        --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout 100 --rollout-num-gpus 2 ...

Everything that varies (engines, rollout function, loss, parallel layout) lives behind the three
handles below; this file is only the order of events. ``python train.py --help`` lists every flag:
Megatron-LM's, ``--sglang-*`` and slime's own.
"""

from __future__ import annotations

import logging
import sys
import time

import ray
from tqdm import tqdm

from slime.config import ConfigError, check_implemented, parse_args
from slime.ray.session import TrainingSession
from slime.rollout.data_source import DataError
from slime.utils.memory import PeakMemoryMonitor
from slime.utils.metrics import MetricsLogger, setup_logging

logger = logging.getLogger("slime")


def should_run(interval: int | None, rollout_id: int, num_rollout: int) -> bool:
    """True every ``interval`` rollouts and after the last one; never when ``interval`` is unset."""
    return bool(interval) and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout)


def mean_over_steps(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """``train/<key>`` averaged over the rollout's optimizer steps (the learning rate: the last one)."""
    out = {f"train/{key}": sum(m[key] for m in step_metrics) / len(step_metrics) for key in step_metrics[0]}
    out["train/lr"] = step_metrics[-1]["lr"]
    return out


def train(args) -> None:
    with PeakMemoryMonitor() as memory, TrainingSession(args) as session:
        rollout, trainer = session.rollout, session.trainer
        metrics_logger = MetricsLogger(args)
        session.push_weights()  # engines start from the trainer's weights (they differ after --load)
        if args.eval_interval and not args.skip_eval_before_train:
            metrics_logger.log(
                session.start_rollout_id - 1, ray.get(rollout.eval.remote(session.start_rollout_id - 1))
            )

        for rollout_id in tqdm(
            range(session.start_rollout_id, args.num_rollout), desc="rollouts", unit="rollout"
        ):
            start = time.perf_counter()
            data = ray.get(rollout.generate.remote(rollout_id))
            metrics = data.pop("metrics")
            metrics["perf/rollout_time"] = time.perf_counter() - start

            start = time.perf_counter()
            step_metrics = trainer.train(data)
            metrics["perf/train_time"] = time.perf_counter() - start
            metrics.update(mean_over_steps(step_metrics))

            if should_run(args.save_interval, rollout_id, args.num_rollout):
                trainer.save(rollout_id)
                ray.get(rollout.save.remote(rollout_id))

            start = time.perf_counter()
            session.push_weights()
            metrics["perf/update_weights_time"] = time.perf_counter() - start

            if should_run(args.eval_interval, rollout_id, args.num_rollout):
                metrics.update(ray.get(rollout.eval.remote(rollout_id)))
            metrics_logger.log(rollout_id, metrics)
        if args.save_hf:
            logger.info("HF checkpoint written to %s", trainer.save_hf(args.save_hf))
        metrics_logger.close()
    logger.info("done; peak memory of all processes %.2f GiB", memory.peak_bytes / 2**30)


def main() -> None:
    args = parse_args()
    setup_logging(args.log_level)
    try:
        check_implemented(args)
        train(args)
    except (ConfigError, DataError) as error:  # raised before any process started
        print(error.line(), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        logger.error("interrupted; every process of the run was stopped")
        sys.exit(130)


if __name__ == "__main__":
    main()
