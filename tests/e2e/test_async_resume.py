"""A ``train_async.py`` run that stops with generation ahead of the trainer resumes at the right prompts.

With ``--async-buffer-size B`` the prompts of up to ``B + 1`` rollouts past the last one trained have
been drawn when a run stops, so the rollout manager keeps the data positions of that many rollouts
(``KeptPositions``) and the checkpoint written before stopping gets the position after the rollout it
holds. Before, only the position before the last generated rollout was kept: with ``B >= 2`` the
checkpoint had none and ``--load`` served the data again from the first prompt.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from slime.ray.rollouts_ahead import RolloutsAhead
from slime.rollout.data_source import KeptPositions
from slime.rollout.train_data import RolloutBatch
from tests.support.paths import REPO
from tests.support.rollouts import prompts_of, source
from tests.support.train_runs import ONE_PER_SIDE, assert_none_left, crash_env


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("buffer_size", [1, 2, 3])
def test_kept_positions_cover_every_rollout_an_async_run_can_stop_after(tmp_path, buffer_size):
    """Generation as far ahead as ``RolloutsAhead`` lets it, positions kept as ``RolloutManager.generate``
    keeps them: while rollout ``r`` trains (the last trained is ``r - 1``) and at its push (``r``),
    the position after either is there and a resumed source serves the next rollout's prompts."""
    data = source(tmp_path, n=40)
    positions = KeptPositions(data, tmp_path / "kept", buffer_size + 1)
    drawn: dict[int, list[str]] = {}

    def generate(rollout_id: int) -> RolloutBatch:
        if rollout_id > 0:
            positions.keep(rollout_id - 1)
        drawn[rollout_id] = prompts_of(data.get_samples(2))
        positions.generated = rollout_id
        return RolloutBatch(data={}, metrics={})

    def resumed_after(rollout_id: int) -> list[str]:
        checkpoint = tmp_path / f"ckpt_{rollout_id}_{len(drawn)}"
        positions.save_after(rollout_id, checkpoint)
        fresh = source(tmp_path, n=40)
        assert fresh.load(rollout_id, checkpoint)
        return prompts_of(fresh.get_samples(2))

    with RolloutsAhead(generate, range(10), buffer_size) as ahead:
        for rollout_id in range(5):
            ahead.next(rollout_id)
            furthest = rollout_id + buffer_size  # as far as generation may go while rollout_id trains
            wait_until(lambda furthest=furthest: positions.generated == furthest)
            if rollout_id > 0:  # stopped while training rollout_id
                assert resumed_after(rollout_id - 1) == drawn[rollout_id]
            assert resumed_after(rollout_id) == drawn[rollout_id + 1]  # stopped at its push
    assert len(positions.kept) == buffer_size + 1
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == sorted(map(str, positions.kept))


def run_async(flags: list[str], exit_code: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``train_async.py`` as a user runs it, ending with ``exit_code``; no process of it left afterwards."""
    tag = uuid.uuid4().hex
    command = [sys.executable, "train_async.py", *flags]
    env = {**os.environ, **env, "SLIME_TEST_RUN": tag}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == exit_code, result.stderr[-3000:]
    assert_none_left(tag)
    return result


def prompts(dump: Path) -> list[tuple[int, tuple[int, ...]]]:
    """``(sample index, prompt ids)`` of each sample of a ``--save-debug-rollout-data`` dump."""
    import torch

    data = torch.load(str(dump), weights_only=False)
    pairs = zip(data["sample_indices"], data["tokens"], data["response_lengths"], strict=True)
    return [(index, tuple(tokens[: len(tokens) - n])) for index, tokens, n in pairs]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_stopped_two_rollouts_ahead_resumes_at_the_prompts_after_its_checkpoint(
    tiny_run_flags, tmp_path
):
    """``--async-buffer-size 2``, 4 prompt groups (one /generate each) per rollout on one engine: rollouts
    1 and 2 are generated while rollout 0 trains, and the engine is killed at rollout 2's first request.
    The push after rollout 0 fails, so the run checkpoints rollout 0 with the position after its
    prompts, though rollout 2's were drawn too; resumed, rollout 1 gets the prompts it got before."""
    ckpt = tmp_path / "ckpt"
    first, second = tmp_path / "first_{rollout_id}.pt", tmp_path / "second_{rollout_id}.pt"
    common = ["--save", str(ckpt), "--save-interval", "10", "--async-buffer-size", "2"]
    flags = tiny_run_flags(*common, "--save-debug-rollout-data", str(first), **ONE_PER_SIDE, num_rollout=3)
    result = run_async(flags, 1, crash_env(tmp_path, "ahead", 9))
    assert "was killed by SIGKILL" in result.stderr
    assert "checkpointed rollout 0 before stopping" in result.stderr, result.stderr[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert '"next_group_index": 4' in (ckpt / "rollout" / "data_source_0.json").read_text()

    flags = tiny_run_flags(
        *common, "--load", str(ckpt), "--save-debug-rollout-data", str(second), **ONE_PER_SIDE, num_rollout=2
    )
    result = run_async(flags, 0, {})
    assert "at rollout 1" in result.stderr
    served = prompts(Path(str(second).format(rollout_id=1)))
    assert served == prompts(Path(str(first).format(rollout_id=1)))
    assert served != prompts(Path(str(first).format(rollout_id=0)))  # what a replay from the start serves
