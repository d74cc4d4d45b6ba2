"""Where a run's processes go: the trainer's GPUs, the engines', the critic's, and the Ray cluster."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime.config.settings.distillation import OpdSettings
from slime.config.validate import uses_engines

# Under --colocate a trainer rank and an engine hold the same bundle's GPU, so each asks for a share
# of it (Ray still gives both that GPU's CUDA_VISIBLE_DEVICES); the shares leave room for small probes.
COLOCATED_GPU_SHARE = {"trainer": 0.4, "engine": 0.2}


@dataclass(frozen=True, kw_only=True)
class ClusterSettings:
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    rollout_num_gpus: int
    """Engines' GPUs (``--rollout-num-gpus``): 0 when the run starts no engines (SFT, train-only)."""
    rollout_num_gpus_per_engine: int
    num_gpus_per_node: int
    colocate: bool
    """``--colocate``: trainer ranks and engines take turns on the same GPUs."""
    critic_num_nodes: int
    critic_num_gpus_per_node: int
    has_critic: bool
    """``--advantage-estimator ppo`` trains a critic on GPUs of its own."""
    debug_rollout_only: bool
    debug_train_only: bool
    uses_engines: bool
    """False for SFT and train-only debugging: no engines, no router."""
    ray_address: str | None
    external_engine_addrs: tuple[str, ...]
    """``--rollout-external-engine-addrs``: engines slime did not start, updated with the others."""
    engine_api_key: str | None
    """``--sglang-api-key``: the key external engines expect (else slime makes one when needed)."""
    teacher_gpus: int = 0
    """GPUs of the on-policy distillation teacher's engines (``--opd-teacher-hf-checkpoint``): their own."""
    overlapped: bool = False
    """``train_async.py``: engines generate while the trainer trains, so on a CPU node the two split its
    cores (``cpu_neighbours``) instead of each taking them all in turn."""

    @property
    def cpu_neighbours(self) -> dict[str, int]:
        """Per role, the processes of the other role that compute beside it on a CPU node at the same
        time: the engines beside the trainer ranks and the ranks beside the engines when overlapped (one
        node: the CPU case), none when the two take turns."""
        if not self.overlapped or not self.uses_engines:
            return {"trainer": 0, "engine": 0}
        return {
            "trainer": self.engine_gpus // self.rollout_num_gpus_per_engine,
            "engine": self.trainer_gpus,
        }

    @property
    def trainer_gpus(self) -> int:
        """GPUs of the trainer group; none with --debug-rollout-only, which starts no trainer."""
        return 0 if self.debug_rollout_only else self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def critic_gpus(self) -> int:
        return self.critic_num_nodes * self.critic_num_gpus_per_node if self.has_critic else 0

    @property
    def engine_gpus(self) -> int:
        return self.rollout_num_gpus if self.uses_engines else 0

    @property
    def total_gpus(self) -> int:
        """Bundles the run needs: trainers and engines share them when colocated; an OPD teacher's engines
        and PPO's critic have their own."""
        if self.colocate:
            return max(self.trainer_gpus, self.engine_gpus) + self.teacher_gpus + self.critic_gpus
        return self.trainer_gpus + self.engine_gpus + self.teacher_gpus + self.critic_gpus

    def actor_gpus(self, role: str) -> float:
        """The ``num_gpus`` an actor of ``role`` asks of its bundle: all of it, or a colocated share."""
        return COLOCATED_GPU_SHARE[role] if self.colocate else 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterSettings:
        return cls(
            actor_num_nodes=args.actor_num_nodes,
            actor_num_gpus_per_node=args.actor_num_gpus_per_node,
            rollout_num_gpus=args.rollout_num_gpus or 0,
            rollout_num_gpus_per_engine=args.rollout_num_gpus_per_engine,
            num_gpus_per_node=args.num_gpus_per_node,
            colocate=bool(args.colocate),
            critic_num_nodes=args.critic_num_nodes,
            critic_num_gpus_per_node=args.critic_num_gpus_per_node,
            has_critic=_has_critic(args),
            debug_rollout_only=bool(args.debug_rollout_only),
            debug_train_only=bool(args.debug_train_only),
            uses_engines=uses_engines(args),
            ray_address=args.ray_address,
            external_engine_addrs=tuple(args.rollout_external_engine_addrs or ()),
            engine_api_key=(args.sglang_server_args or {}).get("api_key") or None,
            teacher_gpus=OpdSettings.from_args(args).teacher_gpus if args.use_opd else 0,
        )


def _has_critic(args: argparse.Namespace) -> bool:
    ppo = args.advantage_estimator == "ppo" and args.loss_type == "policy_loss"
    return ppo and not args.debug_rollout_only
