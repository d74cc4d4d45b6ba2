"""N Megatron trainer ranks as Ray actors on GPU bundles, driven as one group.

The driver puts a rollout's samples into the object store once; every rank fetches it and keeps the
data-parallel shard it owns (``slime.ray.train_data``), so the driver never needs to know how
Megatron orders ranks.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.backends.megatron.batching import TrainData
from slime.utils.device import worker_env
from slime.utils.http import free_port


@ray.remote(num_gpus=1)
class TrainerActor:
    """One trainer rank. Megatron is imported inside the actor, never on the driver."""

    def __init__(self, args: argparse.Namespace, rank: int, world_size: int) -> None:
        self.args, self.rank, self.world_size = args, rank, world_size
        self.trainer = None
        self.updater = None

    def rendezvous_address(self) -> tuple[str, int]:
        address = ray.util.get_node_ip_address()
        return address, free_port()

    def init(self, master_addr: str, master_port: int) -> int | None:
        """Builds the model from ``--hf-checkpoint``, resumes ``--load``; returns the loaded rollout id."""
        from slime.backends.megatron.trainer import MegatronTrainer

        self.trainer = MegatronTrainer(self.args, self.rank, self.world_size, master_addr, master_port)
        if self.args.load:
            return self.trainer.load(self.args.load)
        return None

    def compute_log_probs(self, data: TrainData, temperature: float) -> tuple[int, list] | None:
        """``(data-parallel rank, log-probs of its shard)`` from one reporting rank per shard, else None."""
        from megatron.core import parallel_state as mpu

        from slime.ray.train_data import step_shard

        dp_rank = mpu.get_data_parallel_rank()
        shard = step_shard(data, 0, 1, dp_rank, mpu.get_data_parallel_world_size())
        log_probs = self.trainer.compute_log_probs(shard, temperature)
        reporting = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
        return (dp_rank, log_probs) if log_probs is not None and reporting else None

    def train(self, data: TrainData) -> list[dict[str, float]]:
        """``--num-steps-per-rollout`` optimizer steps over one rollout; metrics of every step."""
        return [self.trainer.train_step(shard) for shard in self._step_shards(data)]

    def _step_shards(self, data: TrainData) -> list[TrainData]:
        """This rank's shard of every optimizer step, with the policy loss's inputs when it needs them.

        Outcome-reward advantages are computed over the whole rollout (groups may straddle shards), as
        are ``--custom-advantage-function-path``'s (``fn(args, data)``: one list of per-token floats per
        sample, used instead of the built-in estimator);
        token-level ones (``reinforce_plus_plus``) after ``add_policy_inputs``, from the old and reference
        log-probs, whitened with moments summed over the data-parallel ranks.
        """
        from megatron.core import parallel_state as mpu

        from slime.algorithms import advantages as adv
        from slime.ray.train_data import step_shard

        args = self.args
        # A custom loss gets the policy loss's inputs (advantages, old/ref log-probs) too.
        policy = args.loss_type in ("policy_loss", "custom_loss")
        custom = args.custom_advantage_function_path is not None
        token_level = not custom and args.advantage_estimator in adv.TOKEN_LEVEL_ESTIMATORS
        if policy and custom:
            fn = getattr(self, "_custom_advantage_fn", None)  # loaded once per actor
            if fn is None:
                from slime.rollout.sglang_rollout import load_function

                fn = self._custom_advantage_fn = load_function(args.custom_advantage_function_path)
            advantages = [[float(x) for x in a] for a in fn(args, data)]
            lengths = [len(m) for m in data["loss_masks"]]
            if [len(a) for a in advantages] != lengths:
                raise ValueError(
                    f"{args.custom_advantage_function_path} returned advantages of lengths "
                    f"{[len(a) for a in advantages]}; expected one per response token: {lengths}"
                )
            data = {**data, "advantages": advantages}
        elif policy and not token_level:
            advantages = adv.outcome_advantages(
                data["rewards"],
                data["response_lengths"],
                args.n_samples_per_prompt,
                args.advantage_estimator,
                normalize_std=not args.disable_grpo_std_normalization,
                loss_masks=data["loss_masks"],
            )
            data = {**data, "advantages": advantages}
        dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        steps = args.num_steps_per_rollout
        shards = [step_shard(data, s, steps, dp_rank, dp_size, args.loss_agg_mode) for s in range(steps)]
        if not policy:
            return shards
        self.trainer.add_policy_inputs(shards)
        # Only the last pipeline stage has log-probs, and only it computes the loss.
        if token_level and "old_log_probs" in shards[0]:
            keys = ("rewards", "old_log_probs", "ref_log_probs", "loss_masks")
            merged = {k: [v for shard in shards for v in shard[k]] for k in keys if k in shards[0]}
            advantages = adv.reinforce_plus_plus_advantages(
                merged["rewards"],
                merged["old_log_probs"],
                merged.get("ref_log_probs"),
                merged["loss_masks"],
                args.kl_coef,
                args.gamma,
                reduce=self._sum_over_data_parallel,
            )
            remaining = iter(advantages)
            for shard in shards:
                shard["advantages"] = [next(remaining) for _ in shard["tokens"]]
        return shards

    def _sum_over_data_parallel(self, value: Any) -> Any:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        group = mpu.get_data_parallel_group()
        if dist.get_world_size(group) == 1:
            return value
        value = value.to(self.trainer.device)
        dist.all_reduce(value, group=group)
        return value.cpu()

    def hf_state_dict(self) -> dict | None:
        return self.trainer.hf_state_dict()

    def connect_engines(self, engine_urls: list[str], ranks_per_engine: int) -> None:
        from slime.weight_sync.distributed import DistributedWeightUpdater

        self.updater = DistributedWeightUpdater(self.args, self.trainer)
        self.updater.connect(engine_urls, ranks_per_engine)

    def update_weights(self, weight_version: str) -> dict[str, float]:
        return self.updater.update(weight_version)

    def save(self, directory: str, rollout_id: int) -> str:
        return self.trainer.save(directory, rollout_id)

    def save_hf(self, directory: str) -> str | None:
        return self.trainer.save_hf(directory)

    def close(self) -> None:
        if self.updater is not None:
            self.updater.disconnect()
        if self.trainer is not None:
            self.trainer.close()


class TrainerGroup:
    """The trainer world: one actor per bundle, initialised together, called together."""

    def __init__(self, args: argparse.Namespace, pg: PlacementGroup, bundle_indices: list[int]) -> None:
        self.args = args
        world_size = len(bundle_indices)
        env = {"runtime_env": {"env_vars": worker_env(processes_per_node=world_size)}}
        self.actors = [
            TrainerActor.options(
                num_cpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
                **env,
            ).remote(args, rank, world_size)
            for rank, index in enumerate(bundle_indices)
        ]

    def init(self) -> int | None:
        """Builds every rank; returns the rollout id a ``--load`` checkpoint ended at (None: fresh)."""
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        loaded = ray.get([actor.init.remote(addr, port) for actor in self.actors])
        return loaded[0]

    def _call(self, method: str, *args: Any) -> list:
        return ray.get([getattr(actor, method).remote(*args) for actor in self.actors])

    def train(self, data: TrainData) -> list[dict[str, float]]:
        """Trains on one rollout; returns rank 0's per-step metrics (already reduced over the world)."""
        return self._call("train", ray.put(data))[0]

    def compute_log_probs(self, data: TrainData, temperature: float = 1.0) -> list:
        """Response log-probs of every sample, in order (gathered from the last pipeline stage)."""
        results = self._call("compute_log_probs", ray.put(data), temperature)
        shards = sorted(result for result in results if result is not None)
        return [log_prob for _, part in shards for log_prob in part]

    def hf_state_dict(self) -> dict:
        return self._call("hf_state_dict")[0]

    def save(self, rollout_id: int) -> str:
        return self._call("save", self.args.save, rollout_id)[0]

    def save_hf(self, directory: str) -> str:
        """Exports the current weights as an HF checkpoint (transformers- and engine-loadable)."""
        return next(path for path in self._call("save_hf", directory) if path)

    def connect_engines(self, engine_urls: list[str], ranks_per_engine: int) -> None:
        """Opens the weight-update groups between the trainer and every engine."""
        self._call("connect_engines", engine_urls, ranks_per_engine)

    def update_weights(self, weight_version: str) -> dict[str, float]:
        """Pushes the current weights to every engine; bytes summed over the senders (one per PP stage)."""
        results = [r for r in self._call("update_weights", weight_version) if r]
        if not results:
            return {}
        return {
            "update_weights_bytes": sum(r["update_weights_bytes"] for r in results),
            "update_weights_time": max(r["update_weights_time"] for r in results),
        }

    def shutdown(self) -> None:
        """Closes the process groups and kills the actors; safe to call twice."""
        if not self.actors:
            return
        # Best effort: the actors may already be dead or stuck; they are killed right after.
        with contextlib.suppress(Exception):
            ray.get([actor.close.remote() for actor in self.actors], timeout=60)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
