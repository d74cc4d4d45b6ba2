"""The steps of one rollout that ``train.py`` and ``train_async.py`` share; the two differ only in order.

``RolloutLoop`` owns the metrics logger and the trainer's weight version: 1 for the weights the run
starts with, +1 per rollout trained (a run resumed at rollout ``k`` starts at ``1 + k``, the version
the uninterrupted run had there). Engines are pushed that version and every sample records the
versions it was generated with, so ``rollout/staleness`` — the trainer's version minus the oldest
version a trained sample used — counts how many updates the training data lags behind the policy.
It is 0 in the synchronous loop and at most ``--async-buffer-size`` in the overlapped one (with
``--update-weights-interval 1``).
"""

from __future__ import annotations

import logging
import time

import ray

from slime.ray.debug_data import load_rollout_data, save_rollout_data
from slime.ray.session import TrainingSession
from slime.rollout.train_data import RolloutBatch
from slime.utils.metrics import MetricsLogger
from slime.utils.startup import mark

logger = logging.getLogger("slime")


def should_run(interval: int | None, rollout_id: int, num_rollout: int) -> bool:
    """True every ``interval`` rollouts and after the last one; never when ``interval`` is unset."""
    if not interval:
        return False
    return (rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout


def mean_over_steps(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """``train/<key>`` averaged over the rollout's optimizer steps (the learning rate: the last one);
    the trainer's timings (``perf/train_optimizer_time``, ...) keep their ``perf/`` names."""
    out = {
        key if key.startswith("perf/") else f"train/{key}": sum(m[key] for m in step_metrics)
        / len(step_metrics)
        for key in step_metrics[0]
    }
    out["train/lr"] = step_metrics[-1]["lr"]
    return out


def oldest_weight_version(weight_versions: list[list[str]]) -> int | None:
    """The oldest engine weight version any sample was generated with; None when there is none.

    Versions are strings on the wire (SGLang's ``weight_version``); an engine that never received
    weights reports ``"default"``, which is not a version of this run and is left out.
    """
    versions = [int(v) for per_sample in weight_versions for v in per_sample if v.isdigit()]
    return min(versions, default=None)


class RolloutLoop:
    """Generate, train, save, push, evaluate, log: each step once, for either loop to call in its order."""

    def __init__(self, session: TrainingSession) -> None:
        """``session`` started: it settled the run's length (``--num-epoch`` counts it from the data)."""
        self.session, self.settings = session, session.settings.loop
        # Every rollout before the resumed one was trained once; the checkpoint holds that count.
        self.version = 1 + session.start_rollout_id if session.trainer is not None else 1
        self.metrics_logger = MetricsLogger(session.settings.metrics)
        self._step_start = time.perf_counter()
        self.trained: int | None = None  # the last rollout this session trained on
        self.saved: int | None = None  # the last rollout this session checkpointed

    def __enter__(self) -> RolloutLoop:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """A run that stops on an error checkpoints what it trained first (``--save``); one that
        finishes exports and flushes (``close``)."""
        if exc_type is None:
            self.close()
            return
        if isinstance(exc, Exception):
            self.save_before_stopping()
        self.metrics_logger.close()

    @property
    def num_rollout(self) -> int:
        """The run's length (``--num-rollout``, or counted from ``--num-epoch`` by the session)."""
        assert self.settings.num_rollout is not None  # the session settled it before the loop
        return self.settings.num_rollout

    def rollout_ids(self) -> range:
        return range(self.session.start_rollout_id, self.num_rollout)

    def start(self) -> None:
        """Engines take the trainer's weights (they differ after ``--load``); evaluation before training."""
        settings, session = self.settings, self.session
        mark("driver: loop set up")
        session.push_weights(self.version)
        mark("driver: first weight push done")
        session.check_weight_update()  # --check-weight-update-equal
        session.hand_gpus_to_engines()  # --colocate: the trainer's state leaves the GPUs it shares
        if settings.eval_interval and not settings.skip_eval_before_train:
            rollout_id = session.start_rollout_id - 1
            self.metrics_logger.log(rollout_id, self._evaluate(rollout_id))
        self._step_start = time.perf_counter()

    def generate(self, rollout_id: int) -> RolloutBatch:
        """One rollout's train data and metrics.

        Read from ``--load-debug-rollout-data`` when given, dumped to ``--save-debug-rollout-data``
        (``slime.ray.debug_data``: plain values only, loaded without running code).
        When a checkpoint is due, the prompt position is saved right here, after this rollout's
        prompts were taken: a loop that generates ahead has taken later ones by the time it trains.
        """
        settings = self.settings
        start = time.perf_counter()
        if settings.load_debug_rollout_data:
            batch = load_rollout_data(settings.load_debug_rollout_data.format(rollout_id=rollout_id))
        else:
            self.session.engines_resumed()  # the last push's resume first
            batch = ray.get(self.session.rollout.generate.remote(rollout_id))
        batch.metrics["perf/rollout_time"] = time.perf_counter() - start
        if settings.save_debug_rollout_data:
            save_rollout_data(batch, settings.save_debug_rollout_data.format(rollout_id=rollout_id))
        if self._due(settings.save_interval, rollout_id):
            ray.get(self.session.rollout.save.remote(rollout_id))
        return batch

    def train(self, batch: RolloutBatch) -> dict[str, float]:
        """Trains on one rollout (not with ``--debug-rollout-only``); the rollout's metrics."""
        data, metrics = batch.data, batch.metrics
        oldest = oldest_weight_version(data.get("weight_versions", []))
        if oldest is not None and not self.settings.load_debug_rollout_data:
            metrics["rollout/staleness"] = float(self.version - oldest)
        if self.session.trainer is None:
            return metrics
        start = time.perf_counter()
        metrics.update(mean_over_steps(self.session.trainer.train(data)))
        metrics["perf/train_time"] = time.perf_counter() - start
        self.version += 1
        self.trained = self.session.trainer.next_rollout - 1
        return metrics

    def save(self, rollout_id: int) -> None:
        """The trainer's checkpoint when ``--save-interval`` says so (the prompt position: ``generate``)."""
        if self.session.trainer is not None and self._due(self.settings.save_interval, rollout_id):
            self.session.trainer.save(rollout_id)
            self.saved = rollout_id

    def save_before_stopping(self) -> None:
        """After an error (an engine died, say): the trainer's checkpoint of the last rollout it trained,
        with the data position after that rollout, so ``--load`` continues there. The position is
        written first: a checkpoint without one would make ``--load`` start the data over from the
        first prompt. Best effort: a trainer that is gone cannot save, and that is only logged."""
        rollout_id = self.trained
        if not self.settings.save or self.session.trainer is None or rollout_id in (None, self.saved):
            return
        try:
            ray.get(self.session.rollout.save_position_after.remote(rollout_id), timeout=300)
            self.session.trainer.save(rollout_id)
        except Exception as exc:
            logger.warning("could not checkpoint rollout %d before stopping: %s", rollout_id, exc)
            return
        self.saved = rollout_id
        logger.info(
            "checkpointed rollout %d before stopping; --load %s continues there",
            rollout_id,
            self.settings.save,
        )

    def push_due(self, rollout_id: int) -> bool:
        """Whether the weights go to the engines after this rollout (``--update-weights-interval``)."""
        trains = self.session.trainer is not None
        return trains and self._due(self.settings.update_weights_interval, rollout_id)

    def push_weights(self) -> dict[str, float]:
        start = time.perf_counter()
        self.session.push_weights(self.version)
        return {"perf/update_weights_time": time.perf_counter() - start}

    def finish(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """Evaluation when due, then the rollout's metrics with its wall-clock ``perf/step_time``."""
        if self._due(self.settings.eval_interval, rollout_id):
            metrics.update(self._evaluate(rollout_id))
        now = time.perf_counter()
        metrics["perf/step_time"] = now - self._step_start
        self._step_start = now
        self.metrics_logger.log(rollout_id, metrics)

    def _evaluate(self, rollout_id: int) -> dict[str, float]:
        """The eval sets' metrics, once the engines have resumed after the last push."""
        self.session.engines_resumed()
        return ray.get(self.session.rollout.eval.remote(rollout_id))

    def _due(self, interval: int | None, rollout_id: int) -> bool:
        return should_run(interval, rollout_id, self.num_rollout)

    def close(self) -> None:
        """After the last rollout: the HF export (``--save-hf``) and the logger's last flush."""
        if self.settings.save_hf and self.session.trainer is not None:
            logger.info("HF checkpoint written to %s", self.session.trainer.save_hf(self.settings.save_hf))
        self.metrics_logger.close()
