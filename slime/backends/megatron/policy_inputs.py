"""What a trainer rank trains on from one rollout: advantages, KL-shaped rewards, and the samples of each
optimizer step on this data-parallel rank.

The pipeline runs in two halves around the trainer's own forward (``MegatronTrainer.add_policy_inputs``,
which adds old and reference log-probs):

1. ``PolicyInputs.shards``: outcome-reward advantages (or ``--custom-advantage-function-path``'s) over
   the whole rollout, since prompt groups may straddle shards; then the cut into steps and ranks.
2. ``PolicyInputs.complete``: what needs log-probs: token-level advantages (REINFORCE++, PPO's GAE)
   whitened with moments summed over the data-parallel ranks, or outcome advantages of KL-shaped
   rewards gathered over them.

Loss weights are computed per global batch (one optimizer step) before the cut, so that a step's loss
and gradient do not depend on how many data-parallel ranks or micro-batches share it.

Neither Ray nor Megatron is needed here: the data-parallel group comes in as ``DataParallel``, which
``DataParallel.of_megatron`` builds on a trainer rank and a test builds by hand.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime.algorithms import advantages as adv
from slime.algorithms.aggregation import loss_weights
from slime.algorithms.distillation import opd_advantages
from slime.backends.megatron.batching import SAMPLE_KEYS, check_train_data
from slime.config.settings.trainer import TrainerSettings
from slime.rollout.train_data import TrainData


@dataclass(frozen=True)
class DataParallel:
    """This rank's place in the data-parallel group and the two collectives the pipeline needs."""

    rank: int
    size: int
    sum: Callable[[torch.Tensor], torch.Tensor]
    """All-reduce (sum) of a CPU tensor over the group; the result is on the CPU."""
    gather: Callable[[Any], list[Any]]
    """Every rank's picklable object, in rank order."""

    @classmethod
    def single(cls) -> DataParallel:
        return cls(rank=0, size=1, sum=lambda value: value, gather=lambda value: [value])

    @classmethod
    def of_megatron(cls, device: torch.device) -> DataParallel:
        """The data-parallel group of megatron-core's parallel state; tensors are reduced on ``device``."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        group = mpu.get_data_parallel_group()
        size = dist.get_world_size(group)
        if size == 1:
            return cls.single()

        def all_reduce(value: torch.Tensor) -> torch.Tensor:
            value = value.to(device)
            dist.all_reduce(value, group=group)
            return value.cpu()

        def all_gather(value: Any) -> list[Any]:
            parts = [None] * size
            dist.all_gather_object(parts, value, group=group)
            return parts

        return cls(rank=mpu.get_data_parallel_rank(), size=size, sum=all_reduce, gather=all_gather)


def step_shard(
    data: TrainData, step: int, num_steps: int, dp_rank: int, dp_size: int, aggregation: str = "token_mean"
) -> TrainData:
    """The samples data-parallel rank ``dp_rank`` trains on in optimizer step ``step`` of a rollout.

    Step ``s`` takes the ``s``-th contiguous global batch; within it rank ``r`` takes the ``r``-th
    contiguous slice.
    """
    total = check_train_data(data, SAMPLE_KEYS)
    if total % (num_steps * dp_size):
        raise ValueError(f"{total} samples do not split into {num_steps} steps × {dp_size} DP ranks")
    per_step = total // num_steps
    per_rank = per_step // dp_size
    step_slice = slice(step * per_step, (step + 1) * per_step)
    weights = loss_weights(data["loss_masks"][step_slice], aggregation)
    begin = step * per_step + dp_rank * per_rank
    shard = {key: values[begin : begin + per_rank] for key, values in data.items()}
    shard["loss_weights"] = weights[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return shard


class PolicyInputs:
    """One trainer rank's pipeline from a rollout's rewards to the per-token inputs of the policy loss.

    ``returns`` holds ``(position in the rollout, GAE returns)`` of this rank's samples after a PPO
    rollout: the critic's targets. ``plugin_args``, the run's namespace, goes to a
    ``--custom-advantage-function-path`` plugin only.
    """

    def __init__(self, settings: TrainerSettings, dp: DataParallel, plugin_args: argparse.Namespace) -> None:
        self.loss, self.batch, self.dp = settings.loss, settings.batch, dp
        self.plugin_args = plugin_args
        # A custom loss gets the policy loss's inputs (advantages, old/ref log-probs) too.
        self.trains_policy = self.loss.loss_type in ("policy_loss", "custom_loss")
        self.custom = self.loss.custom_advantage_function_path is not None
        self.token_level = not self.custom and self.loss.advantage_estimator in adv.TOKEN_LEVEL_ESTIMATORS
        self.returns: list[tuple[int, list[float]]] | None = None
        self._custom_advantage_fn: Callable[..., Any] | None = None

    def shards(self, data: TrainData) -> list[TrainData]:
        """This rank's shard of every optimizer step, with the advantages that need no log-probs."""
        if self.trains_policy and self.custom:
            data = {**data, "advantages": self._custom_advantages(data)}
        elif self.trains_policy and not self.token_level:
            data = {**data, "advantages": self.outcome_advantages(data, data["rewards"])}
        # Where each sample sits in the rollout, so that values computed per shard find their sample.
        data = {**data, "positions": list(range(len(data["tokens"])))}
        steps = self.batch.num_steps_per_rollout
        aggregation = self.loss.loss_agg_mode
        return [step_shard(data, s, steps, self.dp.rank, self.dp.size, aggregation) for s in range(steps)]

    def complete(self, data: TrainData, shards: list[TrainData]) -> None:
        """Adds the advantages that need the old and reference log-probs the trainer added to ``shards``.

        Only the last pipeline stage has log-probs (and computes the loss): elsewhere nothing is added.
        """
        if not self.trains_policy or "old_log_probs" not in shards[0]:
            return
        if self.token_level:
            self._token_level_advantages(shards)
        elif self.loss.kl_coef and not self.custom:
            self._kl_shaped_outcome_advantages(data, shards)
        if self.loss.use_opd:
            for shard in shards:
                self._distilled(shard)

    def _distilled(self, shard: TrainData) -> None:
        """``--use-opd``: the teacher's reverse KL at each token, against the old policy's log-probs (the
        policy that sampled), taken off the estimator's advantages."""
        if "teacher_log_probs" not in shard:
            raise KeyError("--use-opd needs the teacher's log-probs in the train data (teacher_log_probs)")
        shard["advantages"] = opd_advantages(
            shard["advantages"],
            shard["old_log_probs"],
            shard["teacher_log_probs"],
            shard["loss_masks"],
            self.loss.opd_kl_coef,
        )

    def outcome_advantages(self, data: TrainData, rewards: list[float]) -> list:
        """``--advantage-estimator``'s per-token advantages of the rollout ``data`` for ``rewards``
        (the data's own, or KL-shaped), normalised over the rollout's prompt groups; rewards that a
        ``--custom-reward-post-process-path`` made are final and only spread over the tokens."""
        if self.loss.rewards_post_processed:
            final = torch.tensor(rewards, dtype=torch.float32)
            return adv.broadcast_to_tokens(final, data["response_lengths"])
        return adv.outcome_advantages(
            rewards,
            data["response_lengths"],
            data.get("prompt_groups") or self.batch.n_samples_per_prompt,
            self.loss.advantage_estimator,
            normalize_std=not self.loss.disable_grpo_std_normalization,
            loss_masks=data["loss_masks"],
            valid=data.get("valid_rewards"),
        )

    def _custom_advantages(self, data: TrainData) -> list[list[float]]:
        """``--custom-advantage-function-path``'s ``fn(args, data)``: one list of per-token floats per
        sample, used instead of the built-in estimator (loaded once per rank)."""
        path = self.loss.custom_advantage_function_path
        if self._custom_advantage_fn is None:
            from slime.utils.plugins import load_function

            self._custom_advantage_fn = load_function(path)
        advantages = [[float(x) for x in a] for a in self._custom_advantage_fn(self.plugin_args, data)]
        lengths = [len(m) for m in data["loss_masks"]]
        if [len(a) for a in advantages] != lengths:
            raise ValueError(
                f"{path} returned advantages of lengths {[len(a) for a in advantages]}; "
                f"expected one per response token: {lengths}"
            )
        return advantages

    def _token_level_advantages(self, shards: list[TrainData]) -> None:
        """REINFORCE++ returns or PPO's GAE over this rank's samples of the rollout, whitened with moments
        summed over the data-parallel ranks; PPO also keeps the returns for the critic (``returns``)."""
        loss = self.loss
        keys = ("rewards", "old_log_probs", "ref_log_probs", "loss_masks", "values", "positions")
        merged = {k: [v for shard in shards for v in shard[k]] for k in keys if k in shards[0]}
        if loss.advantage_estimator == "ppo":
            if "values" not in merged:
                raise KeyError("ppo needs the critic's values in the train data (TrainerGroup adds them)")
            advantages, returns = adv.ppo_advantages(
                merged["rewards"],
                [torch.as_tensor(v).float() for v in merged["values"]],
                merged["old_log_probs"],
                merged.get("ref_log_probs"),
                merged["loss_masks"],
                loss.kl_coef,
                loss.gamma,
                loss.lambd,
                reduce=self.dp.sum,
            )
            self.returns = [(p, r.tolist()) for p, r in zip(merged["positions"], returns, strict=True)]
        else:
            advantages = adv.reinforce_plus_plus_advantages(
                merged["rewards"],
                merged["old_log_probs"],
                merged.get("ref_log_probs"),
                merged["loss_masks"],
                loss.kl_coef,
                loss.gamma,
                reduce=self.dp.sum,
            )
        remaining = iter(advantages)
        for shard in shards:
            shard["advantages"] = [next(remaining) for _ in shard["tokens"]]

    def _kl_shaped_outcome_advantages(self, data: TrainData, shards: list[TrainData]) -> None:
        """``--kl-coef`` with an outcome-reward estimator: every rank shapes the rewards of its samples
        (``r - kl_coef · Σ_t k1_t``, which needs its old and reference log-probs), the shaped rewards of
        the whole rollout are gathered over the data-parallel ranks, and the estimator runs on them
        (its groups may straddle ranks)."""
        keys = ("rewards", "old_log_probs", "ref_log_probs", "loss_masks", "positions")
        merged = {k: [v for shard in shards for v in shard[k]] for k in keys}
        shaped = adv.kl_shaped_rewards(
            merged["rewards"],
            merged["old_log_probs"],
            merged["ref_log_probs"],
            merged["loss_masks"],
            self.loss.kl_coef,
        )
        rewards = list(data["rewards"])
        for part in self.dp.gather(list(zip(merged["positions"], shaped, strict=True))):
            for position, reward in part:
                rewards[position] = reward
        advantages = self.outcome_advantages(data, rewards)
        for shard in shards:
            shard["advantages"] = [advantages[p] for p in shard["positions"]]
