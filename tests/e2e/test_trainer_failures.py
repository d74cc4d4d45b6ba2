"""Trainer failures: a rank that dies, raises or does not answer in time is one line naming it, and
``--auto-resume`` restarts the run from its last checkpoint.

The e2e runs kill the one trainer rank of a tiny ``train.py`` run through the trainer actor's test hook
(``SLIME_TEST_KILL_TRAINER_AT_ROLLOUT``), which also saves the rollout the rank was given.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch

from slime.engine_client.calls import EngineCallError
from slime.ray.errors import TrainerFailure
from slime.ray.trainer_faults import KILL_AT_ROLLOUT_ENV, KILL_MARKER_ENV, TrainerKill
from slime.ray.trainer_group import wait_for_ranks
from tests.support.paths import REPO
from tests.support.train_runs import ONE_PER_SIDE, read_events, run_train, write_stale_cluster_file

NODES = ["10.0.0.2", "10.0.0.3"]


@ray.remote(num_cpus=0)
class Rank:
    """A stand-in trainer rank: answers, raises, refuses as an engine would, hangs or dies."""

    def answer(self, value: int) -> int:
        return value

    def fail(self) -> None:
        raise ValueError("bad shard\nsecond line")

    def refuse(self) -> None:
        raise EngineCallError("http://10.0.0.7:30000", "/update_weights_from_distributed", "busy", 400)

    def hang(self) -> None:
        time.sleep(120)

    def exit(self) -> None:
        os._exit(1)


@pytest.mark.e2e
def test_the_first_rank_to_fail_is_named_at_once_and_silent_ranks_after_the_timeout(ray_cluster):
    ranks = [Rank.remote(), Rank.remote()]
    try:
        assert wait_for_ranks([r.answer.remote(i) for i, r in enumerate(ranks)], "Rank.answer", 30) == [0, 1]
        with pytest.raises(EngineCallError):  # an engine's refusal names the engine, not the rank
            wait_for_ranks([ranks[1].refuse.remote()], "Rank.refuse", 30)
        # Rank 0 blocked (as in a collective with its failed peer) does not delay rank 1's failure.
        start = time.monotonic()
        with pytest.raises(TrainerFailure) as raised:
            wait_for_ranks([ranks[0].hang.remote(), ranks[1].fail.remote()], "Rank.fail", 60, nodes=NODES)
        assert time.monotonic() - start < 30
        assert (
            str(raised.value) == "trainer rank 1 (node 10.0.0.3) raised in Rank.fail: ValueError: bad shard"
        )
        with pytest.raises(TrainerFailure) as raised:
            wait_for_ranks(
                [ranks[0].answer.remote(0), ranks[1].exit.remote()], "Rank.exit", 60, "critic", NODES
            )
        died = str(raised.value)
        assert died.startswith("critic rank 1 (node 10.0.0.3) died in Rank.exit: ") and "\n" not in died
        assert "worker process has died" in died and "common causes" not in died, died
        with pytest.raises(TrainerFailure) as raised:  # rank 0 is still in hang()
            wait_for_ranks([ranks[0].answer.remote(0)], "Rank.answer", 1)
        assert str(raised.value) == (
            "trainer ranks [0] did not answer Rank.answer within 1 s (--trainer-call-timeout); "
            "raise it if one call may take longer"
        )
    finally:
        for rank in ranks:
            ray.kill(rank)


@pytest.mark.e2e
def test_after_a_failure_the_group_refuses_calls_at_once_and_stops_without_waiting(
    ray_cluster, tiny_run_flags
):
    """A stopping run checkpoints what it trained (``RolloutLoop``): on a broken trainer world that
    call would wait for ranks stuck in a collective, so it is refused; ``shutdown`` only kills."""
    from slime.config import parse_args
    from slime.config.settings.trainer import TrainerSettings
    from slime.config.settings.weight_sync import WeightSyncSettings
    from slime.ray.cluster import create_placement_group, release_placement_group
    from slime.ray.trainer_group import TrainerGroup

    args = parse_args(tiny_run_flags(rollout_num_gpus=1))
    pg = create_placement_group(1)
    try:
        settings, weight_sync = TrainerSettings.from_args(args), WeightSyncSettings.from_args(args)
        group = TrainerGroup(settings, weight_sync, args, pg, [0])  # not initialised: its trainer is None
        with pytest.raises(TrainerFailure, match=r"^trainer rank 0 \(node not known yet\) raised in "):
            group.memory_events()
        start = time.monotonic()
        with pytest.raises(TrainerFailure) as refused:
            group.save(0)
        assert str(refused.value) == "the trainer ranks failed before; TrainerActor.save cannot run"
        group.shutdown()
        assert time.monotonic() - start < 10
    finally:
        release_placement_group(pg)


def test_the_rank_kill_is_armed_only_by_the_tests_environment_and_fires_once(tmp_path, monkeypatch):
    """A real run builds no kill, so its ranks never reach the test hook; an armed one fires at its
    rollout only, saving what the rank was given, and its marker disarms it for the resumed run."""
    monkeypatch.delenv(KILL_AT_ROLLOUT_ENV, raising=False)
    monkeypatch.setenv(KILL_MARKER_ENV, str(tmp_path / "unused"))
    assert TrainerKill.from_env() is None
    marker = tmp_path / "killed.pt"
    monkeypatch.setenv(KILL_AT_ROLLOUT_ENV, "2")
    monkeypatch.setenv(KILL_MARKER_ENV, str(marker))
    assert TrainerKill.from_env() == TrainerKill(2, str(marker))
    TrainerKill(2, str(marker)).before_training(1, {})  # another rollout: the caller goes on
    rank = (
        "from slime.ray.trainer_faults import TrainerKill; "
        f"TrainerKill(2, {str(marker)!r}).before_training(2, {{'tokens': [[1, 2]]}}); print('trained')"
    )
    killed = subprocess.run([sys.executable, "-c", rank], cwd=REPO, capture_output=True, text=True)
    assert (killed.returncode, killed.stdout) == (1, "")
    assert torch.load(marker, weights_only=True) == {"tokens": [[1, 2]]}
    resumed = subprocess.run([sys.executable, "-c", rank], cwd=REPO, capture_output=True, text=True)
    assert (resumed.returncode, resumed.stdout) == (0, "trained\n")


# --- a killed trainer rank in a real run -------------------------------------------------------------


def run_with_a_kill(flags: list[str], at_rollout: int, marker: Path, exit_code: int, **env: str):
    """``train.py`` whose last trainer rank exits at ``at_rollout`` once, saving its rollout to ``marker``."""
    kill = {KILL_AT_ROLLOUT_ENV: str(at_rollout), KILL_MARKER_ENV: str(marker)}
    return run_train(flags, exit_code, {**kill, **env})


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_trainer_rank_is_resumed_from_the_last_checkpoint(tiny_run_flags, tmp_path):
    """``--auto-resume 1``: the rank killed while training rollout 1 costs that rollout only; the resumed
    session regenerates it exactly (the rollout the rank was given) and finishes the run. The failure
    is one line naming the rank (without ``--auto-resume`` it is the run's last line, exit 1: the CLI's
    one-line path). The run starts Ray under a stale ``ray_current_cluster`` (as after a ``ray start``
    whose cluster died), which it ignores."""
    ckpt, tb, marker = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "killed_at_1.pt"
    flags = tiny_run_flags(
        "--save", str(ckpt), "--save-interval", "1", "--auto-resume", "1", "--tb-dir", str(tb),
        "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt"), **ONE_PER_SIDE, num_rollout=2,
        rollout_seed_per_sample=True,  # regenerated exactly: every sample seeded
    )  # fmt: skip
    ray_tmp = Path(tempfile.mkdtemp(prefix="slime-ray-", dir="/tmp"))  # short: Ray's socket paths
    try:
        write_stale_cluster_file(ray_tmp)
        result = run_with_a_kill(flags, 1, marker, exit_code=0, RAY_TMPDIR=str(ray_tmp))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    resumes = [line for line in result.stderr.splitlines() if "--auto-resume: 1 of 1" in line]
    assert len(resumes) == 1 and "trainer rank 0 (node " in resumes[0], resumes
    assert "died in TrainerActor.train: " in resumes[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"; resuming from the last checkpoint in {ckpt} (" in resumes[0]
    assert f"resumed from {ckpt} at rollout 1" in result.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert [step for step, _ in read_events(tb)["train/loss"]] == [0, 1]
    before = torch.load(marker, weights_only=False)  # what the killed session was training on
    after = torch.load(tmp_path / "rollout_1.pt", weights_only=False)
    for key in ("tokens", "response_lengths", "rewards", "loss_masks", "weight_versions"):
        assert before[key] == after[key], key
