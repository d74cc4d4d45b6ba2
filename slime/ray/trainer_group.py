"""N Megatron trainer ranks as Ray actors on GPU bundles, driven as one group.

The driver puts a rollout's samples into the object store once; every rank fetches it and keeps the
data-parallel shard it owns, with the policy loss's inputs (``slime.backends.megatron.policy_inputs``),
so the driver never needs to know how Megatron orders ranks. The actor itself is only process wiring.

Every call waits on all ranks together, bounded by ``--trainer-call-timeout``: the first rank that dies
or raises stops the wait (the others may be blocked in a collective with it) as a ``TrainerFailure``
naming that rank, its node and the cause; a timeout names the ranks that did not answer.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.config.errors import ConfigError
from slime.config.settings.cluster import COLOCATED_GPU_SHARE
from slime.config.settings.trainer import TrainerSettings
from slime.config.settings.weight_sync import WeightSyncSettings
from slime.config.slime_train_args import TRAINER_CALL_TIMEOUT_S
from slime.engine_client.calls import EngineCallError
from slime.ray.errors import TrainerFailure
from slime.ray.trainer_faults import TrainerKill
from slime.rollout.train_data import TrainData
from slime.utils.hardware import worker_env
from slime.utils.http import free_port
from slime.utils.startup import mark

if TYPE_CHECKING:  # torch and Megatron are imported inside the actor only
    from slime.backends.megatron.policy_inputs import PolicyInputs
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.weight_sync.transport import WeightUpdater

logger = logging.getLogger(__name__)


def check_token_budget(tokens: Sequence[Sequence[int]], max_tokens_per_gpu: int | None) -> None:
    """Refuses a rollout whose longest sample alone exceeds ``--max-tokens-per-gpu`` (None: no budget).
    Checked on the driver when the data arrives: sample lengths are only known then."""
    longest = max((len(t) for t in tokens), default=0)
    if max_tokens_per_gpu is not None and longest > max_tokens_per_gpu:
        raise ConfigError(
            "--max-tokens-per-gpu",
            f"{max_tokens_per_gpu} is below the longest sample ({longest} tokens); "
            f"raise it to at least {longest}",
        )


@ray.remote(num_gpus=1)
class TrainerActor:
    """One trainer rank. Megatron is imported inside the actor, never on the driver."""

    def __init__(
        self,
        settings: TrainerSettings,
        weight_sync: WeightSyncSettings,
        plugin_args: argparse.Namespace,
        rank: int,
        world_size: int,
        env: dict[str, str] | None = None,
        kill: TrainerKill | None = None,
    ) -> None:
        """``plugin_args``: the run's namespace, for the custom loss and advantage plugins only. ``env``:
        this rank's environment (``worker_env``: its CPU threads), set here rather than as the actor's
        Ray runtime_env, which would keep Ray from handing it an idle worker process (it starts a new
        one, through its runtime-env agent: 0.5-1 s more per actor on 2 cores). ``kill``: the
        trainer-failure tests' fault (``slime.ray.trainer_faults``); None in a real run."""
        mark("trainer: actor up")
        os.environ.update(env or {})  # before torch is imported, in init()
        self.settings, self.weight_sync, self.plugin_args = settings, weight_sync, plugin_args
        self.rank, self.world_size = rank, world_size
        self.kill = kill
        self.trainer: MegatronTrainer | None = None
        self.updater: WeightUpdater | None = None
        self.policy_inputs: PolicyInputs | None = None

    @property
    def _trainer(self) -> MegatronTrainer:
        assert self.trainer is not None, "init() builds the trainer first"
        return self.trainer

    @property
    def _policy_inputs(self) -> PolicyInputs:
        assert self.policy_inputs is not None, "init() builds the policy inputs first"
        return self.policy_inputs

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def rendezvous_address(self) -> tuple[str, int]:
        return self.node_ip(), free_port()

    def init(self, master_addr: str, master_port: int) -> int | None:
        """Builds the model from ``--hf-checkpoint``, resumes ``--load``; returns the loaded rollout id."""
        import torch

        from slime.utils.device import import_megatron_core

        import_megatron_core()  # first in this process: see there
        if threads := os.environ.get("OMP_NUM_THREADS"):  # a reused Ray worker may have loaded OpenMP
            torch.set_num_threads(int(threads))
        from slime.backends.megatron.policy_inputs import DataParallel, PolicyInputs
        from slime.backends.megatron.trainer import MegatronTrainer

        mark("trainer: imports done")
        with self._memory_region("weights"):
            trainer = self.trainer = MegatronTrainer(
                self.settings, self.plugin_args, self.rank, self.world_size, master_addr, master_port
            )
        dp = DataParallel.of_megatron(trainer.device)
        self.policy_inputs = PolicyInputs(self.settings, dp, self.plugin_args)
        load = self.settings.checkpoint.load
        loaded = trainer.load(load) if load else None
        mark("trainer: ready")  # with --load, once the checkpoint is in
        return loaded

    def compute_log_probs(self, data: TrainData) -> tuple[int, list] | None:
        """``(data-parallel rank, log-probs of its shard)`` from one reporting rank per shard, else None."""
        return self._per_shard(data, self._trainer.compute_log_probs)

    def compute_values(self, data: TrainData) -> tuple[int, list] | None:
        """The critic's ``(data-parallel rank, values of its shard)`` from one reporting rank per shard."""
        return self._per_shard(data, self._trainer.compute_values)

    def _per_shard(
        self, data: TrainData, forward: Callable[[TrainData], list | None]
    ) -> tuple[int, list] | None:
        from megatron.core import parallel_state as mpu

        from slime.backends.megatron.policy_inputs import step_shard

        dp = self._policy_inputs.dp
        outputs = forward(step_shard(data, 0, 1, dp.rank, dp.size))
        reporting = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
        return (dp.rank, outputs) if outputs is not None and reporting else None

    def train(self, data: TrainData, rollout_id: int, update_policy: bool = True) -> list[dict[str, float]]:
        """``--num-steps-per-rollout`` optimizer steps over rollout ``rollout_id``; metrics of every step.

        ``update_policy`` False (PPO's ``--num-critic-only-steps`` warm-up) prepares the rollout as usual
        (old/ref log-probs, GAE returns for the critic) but takes no optimizer step. Every step's
        metrics carry ``perf/train_log_probs_time``, the seconds that preparation took once per rollout."""
        if self.kill is not None:
            self.kill.before_training(rollout_id, data)
        if self._trainer.memory.offloaded:
            raise RuntimeError("the trainer's memory is offloaded (--colocate); onload it before training")
        with self._memory_region("train_state"):  # Adam's state is created at the first step
            start = time.perf_counter()
            shards = self._step_shards(data)
            prepared = {"perf/train_log_probs_time": time.perf_counter() - start}
            if not update_policy:
                lr = self._trainer.optimizer.param_groups[0]["lr"]
                return [{"lr": lr, "skipped": 1.0, **prepared} for _ in shards]
            return [{**self._trainer.train_step(shard), **prepared} for shard in shards]

    def _memory_region(self, tag: str):
        """Under --colocate, allocations inside can be offloaded as ``tag`` (torch_memory_saver on GPU)."""
        from slime.utils.memory import memory_region

        return memory_region(tag) if self.settings.colocate else contextlib.nullcontext()

    def offload(self, tags: list[str]) -> int:
        return self._trainer.memory.offload(tags)

    def onload(self, tags: list[str]) -> int:
        return self._trainer.memory.onload(tags)

    def memory_events(self) -> list:
        return list(self._trainer.memory.events)

    def returns(self) -> list[tuple[int, list[float]]] | None:
        """``(position in the rollout, GAE returns)`` of this rank's samples of the last PPO rollout, from
        one reporting rank per data-parallel shard (None elsewhere): the critic's targets."""
        from megatron.core import parallel_state as mpu

        reporting = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
        return self._policy_inputs.returns if reporting else None

    def _step_shards(self, data: TrainData) -> list[TrainData]:
        """This rank's shard of every optimizer step, with the policy loss's inputs when it needs them."""
        shards = self._policy_inputs.shards(data)
        if self._policy_inputs.trains_policy:
            self._trainer.add_policy_inputs(shards)
            self._policy_inputs.complete(data, shards)
        return shards

    def hf_state_dict(self) -> dict | None:
        with self._on_device(["weights"]):
            return self._trainer.hf_state_dict(self.weight_sync.bucket_bytes)

    def lora_state_dict(self) -> dict | None:
        with self._on_device(["weights"]):
            return self._trainer.lora_state_dict()

    @contextlib.contextmanager
    def _on_device(self, tags: list[str]):
        """Brings offloaded groups back for a call (a save between colocated rollouts), then offloads them."""
        back = [tag for tag in tags if self._trainer.memory.is_offloaded(tag)]
        self._trainer.memory.onload(back)
        try:
            yield
        finally:
            self._trainer.memory.offload(back)

    def micro_batch_count(self) -> int:
        """Micro-batches this rank ran in its last forward/backward pass."""
        return self._trainer.num_micro_batches

    def connect_engines(self, engine_urls: list[str]) -> None:
        from slime.weight_sync.transport import build_weight_updater

        if self.updater is not None:  # engines restarted under --use-fault-tolerance: new URLs, new groups
            self.updater.disconnect(best_effort=True)
        updater = self.updater = build_weight_updater(self.weight_sync, self._trainer)
        updater.connect(engine_urls)

    def update_weights(self, weight_version: str) -> dict[str, float]:
        assert self.updater is not None, "connect_engines() first"
        return self.updater.update(weight_version)

    def save(self, directory: str, rollout_id: int) -> str:
        with self._on_device(["weights", "train_state"]):
            return self._trainer.save(directory, rollout_id)

    def save_hf(self, directory: str) -> str | None:
        with self._on_device(["weights"]):
            return self._trainer.save_hf(directory, self.weight_sync.bucket_bytes)

    def close(self) -> None:
        if self.updater is not None:
            self.updater.disconnect()
        if self.trainer is not None:
            self.trainer.close()


class TrainerGroup:
    """The trainer world: one actor per bundle, initialised together, called together.

    With ``critic`` (``--advantage-estimator ppo``; a second group of the same class, built from
    ``slime.config.settings.trainer.critic_settings``) this group drives both: the critic values the
    rollout, the actor computes GAE from those values and trains the policy (not during the first
    ``--num-critic-only-steps`` rollouts), then the critic trains on the returns. ``init``, ``save``
    and ``shutdown`` cover both.

    ``weight_sync``: how ``update_weights`` reaches the engines, and the bucket size of ``save_hf``;
    ``plugin_args``: the run's namespace, for the custom loss and advantage plugins only;
    ``call_timeout_s``: ``FaultToleranceSettings.trainer_call_timeout_s`` (0: no limit);
    ``cpu_neighbours``: engines computing beside the ranks on a CPU node (``ClusterSettings.cpu_neighbours``),
    which take their share of its cores.
    """

    def __init__(
        self,
        settings: TrainerSettings,
        weight_sync: WeightSyncSettings,
        plugin_args: argparse.Namespace,
        pg: PlacementGroup,
        bundle_indices: list[int],
        critic: TrainerGroup | None = None,
        call_timeout_s: float = TRAINER_CALL_TIMEOUT_S,
        cpu_neighbours: int = 0,
    ) -> None:
        self.settings = settings
        self.call_timeout_s = call_timeout_s
        self.critic = critic
        self.next_rollout = 0
        self.role = "critic" if settings.is_critic else "trainer"  # the name errors give it
        self.nodes: list[str] = []  # each rank's node IP, once it answered
        self.failed = False  # a rank died, raised or went silent: the world cannot close cleanly
        world_size = len(bundle_indices)
        env = worker_env(processes_per_node=world_size + cpu_neighbours)
        kill = TrainerKill.from_env()  # armed by the trainer-failure tests only: the last rank dies
        self.actors = [
            # ray types an @ray.remote class as the class itself, without .options
            TrainerActor.options(  # type: ignore[attr-defined]
                num_cpus=0,
                num_gpus=COLOCATED_GPU_SHARE["trainer"] if settings.colocate else 1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            ).remote(
                settings,
                weight_sync,
                plugin_args,
                rank,
                world_size,
                env,
                kill if rank == world_size - 1 else None,
            )
            for rank, index in enumerate(bundle_indices)
        ]

    def init(self) -> int | None:
        """Builds every rank; returns the rollout id a ``--load`` checkpoint ended at (None: fresh)."""
        groups = [self, self.critic] if self.critic is not None else [self]
        pending = []
        for group in groups:  # both worlds build at the same time
            group.nodes = group._call("node_ip")
            addr, port = group._wait("rendezvous_address", [group.actors[0].rendezvous_address.remote()])[0]
            pending.append([actor.init.remote(addr, port) for actor in group.actors])
        loaded, *critic = (group._wait("init", refs)[0] for group, refs in zip(groups, pending, strict=True))
        if critic and critic[0] is not None and critic[0] != loaded:
            raise RuntimeError(
                f"the actor resumed at rollout {loaded} but the critic at {critic[0]}; "
                "resume both from the same --save directory (--critic-load for the critic's)"
            )
        if critic and critic[0] is None and loaded is not None:
            logger.warning("no critic checkpoint to resume: the critic starts from --hf-checkpoint")
        for group in groups:  # the critic counts the actor's rollouts (its train() gets their ids)
            group.next_rollout = 0 if loaded is None else loaded + 1
        return loaded

    def _call(self, method: str, *args: Any) -> list:
        """``method`` on every rank; their results in rank order. Refused at once after a failure: the
        survivors may be stuck in a collective, and a call (the checkpoint of a stopping run) would
        wait out the timeout."""
        if self.failed:
            raise TrainerFailure(f"the {self.role} ranks failed before; TrainerActor.{method} cannot run")
        return self._wait(method, [getattr(actor, method).remote(*args) for actor in self.actors])

    def _wait(self, method: str, refs: list[ray.ObjectRef]) -> list:
        call = f"TrainerActor.{method}"
        try:
            return wait_for_ranks(refs, call, self.call_timeout_s, self.role, self.nodes)
        except TrainerFailure:
            self.failed = True
            raise

    def train(self, data: TrainData) -> list[dict[str, float]]:
        """Trains on one rollout; returns rank 0's per-step metrics (already reduced over the world)."""
        check_token_budget(data["tokens"], self.settings.batch.max_tokens_per_gpu)
        rollout_id, self.next_rollout = self.next_rollout, self.next_rollout + 1
        if self.critic is None:
            return self._call("train", ray.put(data), rollout_id)[0]
        data = {**data, "values": self.critic.compute_values(data)}
        update_policy = rollout_id >= self.settings.loss.num_critic_only_steps
        actor_metrics = self._call("train", ray.put(data), rollout_id, update_policy)[0]
        parts = sorted(item for part in self._call("returns") if part for item in part)
        if [position for position, _ in parts] != list(range(len(data["tokens"]))):
            raise RuntimeError(f"GAE returns came back for {len(parts)} of {len(data['tokens'])} samples")
        critic_metrics = self.critic.train({**data, "returns": [ret for _, ret in parts]})
        return [
            {**actor, **{f"critic/{key}": value for key, value in critic.items()}}
            for actor, critic in zip(actor_metrics, critic_metrics, strict=True)
        ]

    def compute_values(self, data: TrainData) -> list:
        """The critic's per-token values of every sample, in order (gathered from the last pipeline
        stage)."""
        return self._gathered("compute_values", data)

    def compute_log_probs(self, data: TrainData) -> list:
        """Response log-probs of every sample, in order (gathered from the last pipeline stage), at the
        temperature the trainer trains at (``TrainerSettings.temperature``)."""
        return self._gathered("compute_log_probs", data)

    def _gathered(self, method: str, data: TrainData) -> list:
        """``method``'s per-sample outputs from every data-parallel shard, in the data's order."""
        check_token_budget(data["tokens"], self.settings.batch.max_tokens_per_gpu)
        results = self._call(method, ray.put(data))
        shards = sorted(result for result in results if result is not None)
        return [output for _, part in shards for output in part]

    def hf_state_dict(self) -> dict:
        return self._call("hf_state_dict")[0]

    def lora_state_dict(self) -> dict:
        """The LoRA adapter as HF PEFT tensors (``--lora-rank``), from global rank 0."""
        return self._call("lora_state_dict")[0]

    def save(self, rollout_id: int) -> str:
        if self.critic is not None and self.critic.settings.checkpoint.save:
            self.critic.save(rollout_id)
        return self._call("save", self.settings.checkpoint.save, rollout_id)[0]

    def save_hf(self, directory: str) -> str:
        """Exports the current weights as an HF checkpoint (transformers- and engine-loadable)."""
        return next(path for path in self._call("save_hf", directory) if path)

    def connect_engines(self, engine_urls: list[str]) -> None:
        """Opens the weight-update groups between the trainer and every engine (again after restarts)."""
        self._call("connect_engines", engine_urls)

    def offload(self, tags: list[str]) -> int:
        """--colocate: moves ``weights`` and/or ``train_state`` off every rank's GPU; returns the bytes
        freed. The critic keeps GPUs of its own, so it stays."""
        return sum(self._call("offload", tags))

    def onload(self, tags: list[str]) -> int:
        return sum(self._call("onload", tags))

    def memory_events(self) -> list:
        """Rank 0's offload/onload transitions (``slime.utils.memory.MemoryEvent``), oldest first."""
        return self._call("memory_events")[0]

    def update_weights(self, weight_version: str) -> dict[str, float]:
        """Pushes the current weights to every engine; bytes summed over the senders (one per PP stage).
        An engine's refusal is raised as its ``EngineCallError``."""
        results = [r for r in self._call("update_weights", weight_version) if r]
        if not results:
            return {}
        return {
            "update_weights_bytes": sum(r["update_weights_bytes"] for r in results),
            "update_weights_time": max(r["update_weights_time"] for r in results),
        }

    def shutdown(self) -> None:
        """Closes the process groups and kills the actors (the critic's too); safe to call twice.

        After a failure the surviving ranks may be blocked in a collective with the failed one, behind
        which ``close`` would queue: they are killed at once."""
        if self.critic is not None:
            self.critic.shutdown()
        if not self.actors:
            return
        # Best effort: the actors may already be dead or stuck; they are killed right after.
        with contextlib.suppress(Exception):
            if not self.failed:
                ray.get([actor.close.remote() for actor in self.actors], timeout=60)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def wait_for_ranks(
    refs: list[ray.ObjectRef], call: str, timeout_s: float, role: str = "trainer", nodes: Sequence[str] = ()
) -> list:
    """The results of ``call`` on every rank (``refs[rank]``), in rank order, or the first failure.

    The first rank that dies or raises is a ``TrainerFailure`` at once, whatever the others do: they
    may be blocked in a collective with it. The ranks still silent after ``timeout_s`` (0: no limit)
    are named in one. An engine's refusal (a weight push) is raised as its own ``EngineCallError``,
    not wrapped in the task error of the rank that sent it. ``nodes[rank]``: the rank's node IP."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            silent = sorted(rank_of[ref] for ref in pending)
            raise TrainerFailure(
                f"{role} ranks {silent} did not answer {call} within {timeout_s:g} s "
                "(--trainer-call-timeout); raise it if one call may take longer"
            )
        rank = rank_of[ready[0]]
        try:
            results[rank] = ray.get(ready[0])
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, EngineCallError):
                raise exc.cause from None
            raise _rank_failure(f"raised in {call}: {_task_cause(exc)}", exc, role, rank, nodes) from None
        except ray.exceptions.RayActorError as exc:
            raise _rank_failure(f"died in {call}: {_death_cause(exc)}", exc, role, rank, nodes) from None
    return results


def _rank_failure(what: str, exc: Exception, role: str, rank: int, nodes: Sequence[str]) -> TrainerFailure:
    """One line: the rank, its node, ``what``; Ray's whole text (a raising rank's traceback) goes to DEBUG."""
    logger.debug("%s rank %d failed: %s", role, rank, exc)
    node = nodes[rank] if rank < len(nodes) else "not known yet"
    return TrainerFailure(f"{role} rank {rank} (node {node}) {what}")


def _task_cause(exc: ray.exceptions.RayTaskError) -> str:
    """``Type: message`` of the exception a rank raised, its first line."""
    cause = exc.cause
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__


# Where Ray's text on a dead actor stops saying what happened and starts listing what might have.
_DEATH_TEXT_ENDS = (" Some common causes", " There are some potential root causes")


def _death_cause(exc: ray.exceptions.RayActorError) -> str:
    """What Ray says of a dead rank's process, in one line: the sentence after its actor's fields."""
    lines = [line for line in str(exc).splitlines() if line.strip() and not line.startswith("\t")]
    base = ray.exceptions.ActorDiedError.BASE_ERROR_MSG
    text = next((line for line in lines if line != base), base)
    for end in _DEATH_TEXT_ENDS:
        text = text.split(end)[0]
    return text.strip().rstrip(".")
