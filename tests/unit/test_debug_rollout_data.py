"""``--save-debug-rollout-data`` / ``--load-debug-rollout-data``: what the one writes, the other reads
back with ``torch.load(weights_only=True)``, and a file that would run code is refused."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slime.config.settings.loop import LoopSettings
from slime.config.settings.metrics import MetricsSettings
from slime.ray.debug_data import METRICS_KEY, load_rollout_data, save_rollout_data
from slime.ray.loop import RolloutLoop
from slime.rollout.errors import RolloutError
from slime.rollout.sample import Sample
from slime.rollout.train_data import RolloutBatch, samples_to_train_data


def train_data() -> RolloutBatch:
    """A rollout's train data as the rollout manager sends it, with the numpy values plugins return: a
    reward dict of numpy numbers and arrays, a rollout function's numpy metric."""
    samples = [
        Sample(index=i, tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-0.5, -0.25],
               reward={"score": np.float32(i), "parts": np.array([0.5, 1.0])}, weight_versions=["1"],
               status=Sample.Status.COMPLETED)
        for i in range(2)
    ]  # fmt: skip
    data = samples_to_train_data([samples], reward_key="score")
    return RolloutBatch(data=data, metrics={"rollout/raw_reward": 0.5, "rollout/custom": np.float64(2.0)})


def rollout_loop(tmp_path: Path, load: str | None = None, save: str | None = None) -> RolloutLoop:
    """The driver's loop with only what ``generate`` reads: no session, no Ray."""
    loop = LoopSettings(
        num_rollout=1, eval_interval=None, skip_eval_before_train=False, save=None, save_interval=None,
        save_hf=None, update_weights_interval=1, async_buffer_size=1, save_debug_rollout_data=save,
        load_debug_rollout_data=load, load=None,
    )  # fmt: skip
    metrics = MetricsSettings(tensorboard_dir=tmp_path / "tb", num_rollout=1)
    settings = SimpleNamespace(loop=loop, metrics=metrics)
    return RolloutLoop(SimpleNamespace(trainer=None, start_rollout_id=0, settings=settings))


def test_saved_rollout_data_loads_back_with_weights_only_and_trains_again(tmp_path):
    saved = tmp_path / "dumps" / "rollout_0.pt"  # the directory does not exist yet
    save_rollout_data(train_data(), str(saved))
    plain = torch.load(saved, weights_only=True)  # what any reader can do, not only slime's
    assert plain["raw_rewards"] == [{"score": 0.0, "parts": [0.5, 1.0]}, {"score": 1.0, "parts": [0.5, 1.0]}]
    assert type(plain["raw_rewards"][0]["score"]) is float  # numpy's float32, as a Python number
    assert type(plain[METRICS_KEY]["rollout/custom"]) is float
    assert plain["tokens"] == [[1, 2, 3, 4]] * 2 and plain["valid_rewards"] == [True, True]

    # --load-debug-rollout-data with --save-debug-rollout-data: the loop reads and writes it again.
    loop = rollout_loop(tmp_path, load=str(tmp_path / "dumps" / "rollout_{rollout_id}.pt"),
                        save=str(tmp_path / "again_{rollout_id}.pt"))  # fmt: skip
    try:
        batch = loop.generate(0)
    finally:
        loop.metrics_logger.close()
    assert batch.metrics.pop("perf/rollout_time") >= 0
    assert {**batch.data, METRICS_KEY: batch.metrics} == plain
    again = torch.load(tmp_path / "again_0.pt", weights_only=True)
    del again[METRICS_KEY]["perf/rollout_time"]
    assert again == plain


def test_a_dump_that_would_run_code_is_refused_and_the_code_never_runs(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))  # unpickling it would create the file

    torch.save({"tokens": [[1]], METRICS_KEY: {}, "raw_rewards": [Payload()]}, tmp_path / "rollout_0.pt")
    loop = rollout_loop(tmp_path, load=str(tmp_path / "rollout_{rollout_id}.pt"))
    try:
        with pytest.raises(RolloutError) as refused:
            loop.generate(0)
    finally:
        loop.metrics_logger.close()
    assert str(refused.value) == (
        f"--load-debug-rollout-data: {tmp_path / 'rollout_0.pt'} names io.open; only tensors and plain "
        "values are loaded (anything else would run code from the file); write it with "
        "--save-debug-rollout-data"
    )
    assert not marker.exists()
    with pytest.raises(RolloutError, match=r"^--load-debug-rollout-data: .*rollout_1\.pt does not exist$"):
        load_rollout_data(str(tmp_path / "rollout_1.pt"))


def test_data_that_would_not_load_back_is_refused_when_saved_naming_where_it_is(tmp_path):
    batch = train_data()
    batch.data["raw_rewards"][1]["judge"] = os  # a module in a reward dict: no safe reader rebuilds it
    with pytest.raises(RolloutError) as refused:
        save_rollout_data(batch, str(tmp_path / "rollout_0.pt"))
    assert str(refused.value).startswith(
        "--save-debug-rollout-data: the rollout's data['raw_rewards'][1]['judge'] is a module, which is "
        "not saved (only tensors, numbers, strings, lists and dicts load back safely)"
    )
    assert not (tmp_path / "rollout_0.pt").exists()
