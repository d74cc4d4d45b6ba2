"""The trainer's policy-input pipeline (rewards → advantages → step shards) without Ray or Megatron.

A data-parallel group of two ranks is two threads meeting at a barrier, so what a rank computes from
its shard and the collectives can be checked against one rank holding the whole rollout.
"""

from __future__ import annotations

import argparse
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from slime.backends.megatron.policy_inputs import DataParallel, PolicyInputs
from slime.config.settings.trainer import TrainerSettings
from tests.support.trainers import bare_settings

PLUGIN_ARGS = argparse.Namespace()  # what a custom advantage function gets; the ones here ignore it


def flags(**overrides) -> TrainerSettings:
    return bare_settings(**{"n_samples_per_prompt": 2, "num_steps_per_rollout": 1, **overrides})


def rollout():
    """Two prompts × two samples; response lengths 1, 2, 1, 2."""
    return {
        "tokens": [[1, 2], [1, 3, 4], [5, 6], [5, 7, 8]],
        "response_lengths": [1, 2, 1, 2],
        "loss_masks": [[1], [1, 1], [1], [1, 0]],
        "rewards": [1.0, 0.0, 1.0, 1.0],
    }


def with_log_probs(shards, old, ref):
    """What ``MegatronTrainer.add_policy_inputs`` adds on the last stage: log-probs by rollout position."""
    for shard in shards:
        shard["old_log_probs"] = [torch.tensor(old[p]) for p in shard["positions"]]
        shard["ref_log_probs"] = [torch.tensor(ref[p]) for p in shard["positions"]]
    return shards


OLD = [[-1.0], [-0.5, -2.0], [-1.5], [-0.25, -1.0]]
REF = [[-1.25], [-0.5, -1.0], [-1.0], [-0.25, -3.0]]


class ThreadGroup:
    """``size`` ranks in threads: every collective waits for all of them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size

    def rank(self, rank: int) -> DataParallel:
        def gather(value):
            self.slots[rank] = value
            self.barrier.wait()
            parts = list(self.slots)
            self.barrier.wait()
            return parts

        return DataParallel(rank, self.size, sum=lambda value: sum(gather(value)), gather=gather)


def advantages_of(args, dp_size: int) -> list[list[float]]:
    """Every sample's advantages in rollout order, from ``dp_size`` ranks' shards."""
    group = ThreadGroup(dp_size)

    def run(rank: int):
        pipeline = PolicyInputs(args, group.rank(rank) if dp_size > 1 else DataParallel.single(), PLUGIN_ARGS)
        data = rollout()
        shards = with_log_probs(pipeline.shards(data), OLD, REF)
        pipeline.complete(data, shards)
        return [(p, a.tolist()) for s in shards for p, a in zip(s["positions"], s["advantages"], strict=True)]

    with ThreadPoolExecutor(dp_size) as pool:
        parts = list(pool.map(run, range(dp_size)))
    return [a for _, a in sorted(item for part in parts for item in part)]


def test_grpo_advantages_are_group_normalised_rewards_on_every_response_token():
    # Group 1 rewards (1, 0): mean 0.5, std 0.7071 -> ±0.7071; group 2 (1, 1): 0 for both.
    got = advantages_of(flags(advantage_estimator="grpo"), dp_size=1)
    assert got == [
        pytest.approx([0.70711], abs=1e-4),
        pytest.approx([-0.70711, -0.70711], abs=1e-4),
        [0.0],
        [0.0, 0.0],
    ]


def test_kl_shaped_grpo_rewards_are_gathered_over_data_parallel_ranks():
    # One group of four, so that it straddles the two ranks.
    args = flags(advantage_estimator="grpo", kl_coef=1.0, n_samples_per_prompt=4)
    # k1 summed over unmasked tokens: 0.25, -1.0, -0.5, 0 -> shaped rewards 0.75, 1.0, 1.5, 1.0:
    # mean 1.0625, std 0.31458.
    one = advantages_of(args, dp_size=1)
    assert [a[0] for a in one] == pytest.approx([-0.99338, -0.19868, 1.39073, -0.19868], abs=1e-4)
    assert advantages_of(args, dp_size=2) == one


def test_reinforce_plus_plus_whitening_sums_its_moments_over_data_parallel_ranks():
    args = flags(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=1.0)
    one = advantages_of(args, dp_size=1)
    unmasked = torch.tensor([one[0][0], *one[1], one[2][0], one[3][0]])
    assert unmasked.mean().item() == pytest.approx(0.0, abs=1e-5)  # whitened over the 5 unmasked tokens
    two = advantages_of(args, dp_size=2)
    assert [pytest.approx(a, abs=1e-6) for a in one] == two


def test_steps_and_ranks_split_the_rollout_and_keep_positions():
    dp = DataParallel(1, 2, sum=None, gather=None)
    pipeline = PolicyInputs(flags(num_steps_per_rollout=2), dp, PLUGIN_ARGS)
    shards = pipeline.shards(rollout())
    assert [s["positions"] for s in shards] == [[1], [3]]
    assert [s["rewards"] for s in shards] == [[0.0], [1.0]]


def test_a_custom_advantage_function_of_the_wrong_length_names_its_path(tmp_path, monkeypatch):
    (tmp_path / "short_advantages.py").write_text(
        "def fn(args, data):\n    return [[1.0] for _ in data['tokens']]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pipeline = PolicyInputs(
        flags(custom_advantage_function_path="short_advantages.fn"), DataParallel.single(), PLUGIN_ARGS
    )
    with pytest.raises(
        ValueError, match=r"short_advantages.fn returned advantages of lengths \[1, 1, 1, 1\]"
    ):
        pipeline.shards(rollout())
