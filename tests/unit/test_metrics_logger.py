"""The driver's metrics: TensorBoard scalars (written on a thread of their own) and the console line."""

from __future__ import annotations

import logging

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slime.config.settings.metrics import MetricsSettings
from slime.utils.metrics import MetricsLogger


def _settings(tb_dir) -> MetricsSettings:
    return MetricsSettings(tensorboard_dir=tb_dir, num_rollout=3)


def test_every_scalar_is_on_disk_at_its_rollout_once_the_logger_closes(tmp_path, caplog):
    logger = MetricsLogger(_settings(tmp_path))
    with caplog.at_level(logging.INFO, logger="slime"):
        for rollout_id in range(3):
            logger.log(
                rollout_id, {"rollout/raw_reward": 0.25 * rollout_id, "perf/step_time": 1.0 + rollout_id}
            )
    logger.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("rollout/raw_reward")]
    steps = [(e.step, e.value) for e in events.Scalars("perf/step_time")]
    assert rewards == [(0, 0.0), (1, 0.25), (2, 0.5)] and steps == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert [r.getMessage() for r in caplog.records if "rollout 2/3" in r.getMessage()] == [
        "rollout 2/3 | reward 0.500"
    ]
