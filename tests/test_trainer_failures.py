"""Trainer failures: a rank that dies, raises or does not answer in time is one line naming it."""

from __future__ import annotations

import os
import time

import pytest
import ray

from slime.ray.errors import TrainerFailure
from slime.ray.trainer_group import wait_for_ranks
from slime.weight_sync.engine_client import EngineCallError

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
    from slime.ray.cluster import create_placement_group, release_placement_group
    from slime.ray.trainer_group import TrainerGroup

    args = parse_args(tiny_run_flags(rollout_num_gpus=1))
    pg = create_placement_group(1)
    try:
        group = TrainerGroup(args, pg, [0])  # not initialised: its trainer is None
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
