"""``train_async.py`` end to end on CPU, ``--debug-rollout-only``, and the generate-ahead thread alone.

The e2e runs use one torch engine and one Megatron trainer rank (the overlap needs nothing more), run
in-process on the session's Ray, and read back what a user would: TensorBoard scalars, checkpoint files
and the per-rollout dumps of ``--save-debug-rollout-data``, whose ``weight_versions`` say which weights
generated what. The refusal of ``--colocate`` (a one-line error and exit status 2) runs the script.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from slime.ray.rollouts_ahead import RolloutsAhead
from slime.rollout.train_data import RolloutBatch
from tests.support.in_process import train_in_process
from tests.support.paths import REPO
from tests.support.train_runs import LOOP, ONE_PER_SIDE, read_events

ROLLOUT_BATCH_SIZE, N_SAMPLES = 4, 4


@pytest.mark.e2e
@pytest.mark.slow
def test_train_async_overlaps_generation_and_records_weight_versions(ray_cluster, tiny_run_flags, tmp_path):
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    dump = tmp_path / "rollout_{rollout_id}.pt"
    flags = tiny_run_flags(
        "--save", str(ckpt), "--save-interval", "3", "--tb-dir", str(tb),
        "--save-debug-rollout-data", str(dump), **ONE_PER_SIDE, num_rollout=3,
    )  # fmt: skip
    train_in_process(flags, entry="train_async")

    # Rollout 1 is generated while rollout 0 trains, so with the weights the run started with
    # (version 1); rollout 2 only after the push that followed rollout 0's update (version 2).
    dumps = [torch.load(str(dump).format(rollout_id=r), weights_only=False) for r in range(3)]
    versions = [data["weight_versions"] for data in dumps]
    assert versions == [[["1"]] * 16, [["1"]] * 16, [["2"]] * 16]  # one turn per sample, 4 × 4 samples

    scalars = read_events(tb)
    assert scalars["rollout/staleness"] == [(0, 0.0), (1, 1.0), (2, 1.0)]
    assert [step for step, _ in scalars["train/loss"]] == [0, 1, 2]
    assert [step for step, _ in scalars["perf/rollout_wait_time"]] == [0, 1, 2]
    # Rollout 0 is on-policy; later ones were sampled one update before the trainer's weights.
    diffs = [value for _, value in scalars["train/train_rollout_logprob_abs_diff"]]
    assert diffs[0] < 1e-5 < min(diffs[1:]), diffs
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    position = (ckpt / "rollout" / "data_source_2.json").read_text()
    assert f'"next_group_index": {3 * ROLLOUT_BATCH_SIZE}' in position  # not the prompts taken ahead


@pytest.mark.e2e
@pytest.mark.slow
def test_debug_rollout_only_generates_and_logs_without_a_trainer(ray_cluster, tiny_run_flags, tmp_path):
    tb = tmp_path / "tb"
    # No --lr: a trainer could not be built without it.
    flags = tiny_run_flags(
        "--debug-rollout-only", "--tb-dir", str(tb), **(ONE_PER_SIDE | {"lr": None}), num_rollout=1
    )
    result = train_in_process(flags)
    scalars = read_events(tb)
    assert [step for step, _ in scalars["rollout/raw_reward"]] == [0]
    assert scalars["rollout/num_samples"] == [(0, float(ROLLOUT_BATCH_SIZE * N_SAMPLES))]
    assert not [tag for tag in scalars if tag.startswith("train/") or tag == "perf/update_weights_time"]
    assert "TrainerActor" not in result.started and result.started["RolloutManager"] == 1


@pytest.mark.e2e
def test_train_async_refuses_colocate_in_one_line(tiny_run_flags):
    flags = tiny_run_flags("--colocate", **LOOP)
    result = subprocess.run(
        [sys.executable, "train_async.py", *flags], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --colocate: train_async.py overlaps generation with training and runs disaggregated "
        "only; drop --colocate and pass --rollout-num-gpus N, or run train.py"
    ]


class HeldGeneration:
    """A generate function whose rollout ``r`` starts (``started``) and finishes only once
    ``release[r]`` is set: the test decides when each generation ends."""

    def __init__(self, count: int) -> None:
        self.started: list[int] = []
        self.release = {r: threading.Event() for r in range(count)}

    def __call__(self, rollout_id: int) -> RolloutBatch:
        self.started.append(rollout_id)
        self.release[rollout_id].wait(10)
        return RolloutBatch(data={"rollout": [rollout_id]}, metrics={})

    def wait_until(self, condition, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, self.started
            time.sleep(0.01)


def test_rollouts_ahead_bounds_generation_and_pauses_between_rollouts():
    """With ahead=2, at most two unconsumed rollouts exist; ``paused`` waits out the running one."""
    generate = HeldGeneration(5)
    started, release, wait_until = generate.started, generate.release, generate.wait_until
    with RolloutsAhead(generate, range(5), ahead=2) as ahead:
        wait_until(lambda: started == [0])
        release[0].set()
        wait_until(lambda: started == [0, 1])
        release[1].set()
        time.sleep(0.2)
        assert started == [0, 1]  # two rollouts wait for the trainer: no third starts
        assert ahead.next(0).data["rollout"] == [0]
        wait_until(lambda: started == [0, 1, 2])
        pushed = threading.Event()

        def push() -> None:
            with ahead.paused():
                pushed.set()

        pusher = threading.Thread(target=push)
        pusher.start()
        time.sleep(0.2)
        assert not pushed.is_set()  # rollout 2 is still being generated
        release[2].set()
        pusher.join(5)
        assert pushed.is_set()
        assert ahead.next(1).data["rollout"] == [1] and ahead.next(2).data["rollout"] == [2]
        wait_until(lambda: started == [0, 1, 2, 3])
        release[3].set()
        batch = ahead.next(3)
        assert batch.data["rollout"] == [3] and batch.metrics["perf/rollout_wait_time"] >= 0


def test_rollouts_ahead_raises_the_generation_error_in_the_trainer_thread():
    def generate(rollout_id: int) -> RolloutBatch:
        if rollout_id == 1:
            raise RuntimeError("engine died")
        return RolloutBatch(data={}, metrics={})

    with RolloutsAhead(generate, range(3), ahead=1) as ahead:
        ahead.next(0)
        with pytest.raises(RuntimeError, match="engine died"):
            ahead.next(1)


def test_when_idle_runs_once_generation_stops_until_the_next_rollout_is_taken():
    """The push's pause goes out when the rollout ahead is done and the buffer is full (no generation
    can start before the trainer takes it, and the push comes first): at once when that is so already,
    never while a rollout generates or while the buffer has room, and once."""
    generate = HeldGeneration(6)
    started, release, wait_until = generate.started, generate.release, generate.wait_until
    fired: list[list[int]] = []
    with RolloutsAhead(generate, range(6), ahead=2) as ahead:
        wait_until(lambda: started == [0])
        ahead.when_idle(lambda: fired.append(list(started)))
        time.sleep(0.1)
        assert fired == []  # rollout 0 is generating
        release[0].set()
        wait_until(lambda: started == [0, 1])
        assert fired == []  # the buffer had room: rollout 1 started at once
        release[1].set()
        wait_until(lambda: len(fired) == 1)
        assert fired == [[0, 1]]  # both done, the buffer full: nothing starts before next()
        ahead.next(0)
        wait_until(lambda: started == [0, 1, 2])
        release[2].set()
        ahead.next(1)
        wait_until(lambda: started == [0, 1, 2, 3])
        release[3].set()
        wait_until(lambda: ahead._ready.keys() == {2, 3})
        ahead.when_idle(lambda: fired.append(list(started)))  # idle and full already: runs now
        assert fired == [[0, 1], [0, 1, 2, 3]]
        with ahead.paused():
            pass
        ahead.next(2)
        wait_until(lambda: started == [0, 1, 2, 3, 4])
        release[4].set()
        ahead.next(3)
        wait_until(lambda: started == [0, 1, 2, 3, 4, 5])
        release[5].set()
        time.sleep(0.1)
        assert len(fired) == 2  # each when_idle runs once
