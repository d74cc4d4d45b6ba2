"""The whole run's settings: one part per component (``slime.config.settings``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from slime.config.settings.cluster import ClusterSettings
from slime.config.settings.data import DataSettings
from slime.config.settings.eval import EvalSettings
from slime.config.settings.fault_tolerance import FaultToleranceSettings
from slime.config.settings.loop import LoopSettings
from slime.config.settings.metrics import MetricsSettings
from slime.config.settings.rollout import RolloutSettings
from slime.config.settings.trainer import TrainerSettings, critic_settings
from slime.config.settings.weight_sync import WeightSyncSettings


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    cluster: ClusterSettings
    data: DataSettings
    rollout: RolloutSettings
    eval: EvalSettings
    trainer: TrainerSettings
    critic: TrainerSettings | None
    """PPO's critic: the actor's settings with the ``--critic-*`` overrides; None without a critic."""
    weight_sync: WeightSyncSettings
    fault_tolerance: FaultToleranceSettings
    metrics: MetricsSettings
    loop: LoopSettings
    plugin_args: argparse.Namespace = field(compare=False, repr=False)
    """The validated namespace, for user plugins only (upstream slime's ``args``)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunSettings:
        """Reads a validated namespace (``parse_args``'s) once."""
        cluster = ClusterSettings.from_args(args)
        return cls(
            cluster=cluster,
            data=DataSettings.from_args(args),
            rollout=RolloutSettings.from_args(args),
            eval=EvalSettings.from_args(args),
            trainer=TrainerSettings.from_args(args),
            critic=critic_settings(args) if cluster.has_critic else None,
            weight_sync=WeightSyncSettings.from_args(args),
            fault_tolerance=FaultToleranceSettings.from_args(args),
            metrics=MetricsSettings.from_args(args),
            loop=LoopSettings.from_args(args),
            plugin_args=args,
        )

    def with_num_rollout(self, num_rollout: int) -> RunSettings:
        """The run's length once known (``--num-epoch`` counts it from the data before anything starts)."""
        return dataclasses.replace(
            self,
            trainer=self.trainer.with_num_rollout(num_rollout),
            critic=self.critic.with_num_rollout(num_rollout) if self.critic else None,
            metrics=dataclasses.replace(self.metrics, num_rollout=num_rollout),
            loop=dataclasses.replace(self.loop, num_rollout=num_rollout),
        )

    def overlapped(self) -> RunSettings:
        """The run as ``train_async.py`` runs it: generation beside training
        (``ClusterSettings.overlapped``)."""
        return dataclasses.replace(self, cluster=dataclasses.replace(self.cluster, overlapped=True))

    def resuming_from_save(self) -> RunSettings:
        """The same run pointed at its own latest checkpoint (``--auto-resume``): ``--load`` is ``--save``,
        with the optimizer state whatever ``--ckpt-step`` or ``--no-load-optim`` chose for the first start,
        and the critic's beside it. Plugins see the same in a copy of the namespace."""
        save = self.loop.save
        critic = self.critic
        if critic is not None:  # from where it saved: --critic-save, else <--save>/critic
            critic = _loading(critic, critic.checkpoint.save)
        plugin_args = argparse.Namespace(**vars(self.plugin_args))
        plugin_args.load, plugin_args.ckpt_step, plugin_args.no_load_optim = save, None, False
        plugin_args.critic_load = plugin_args.critic_save
        return dataclasses.replace(
            self,
            trainer=_loading(self.trainer, save),
            critic=critic,
            data=dataclasses.replace(self.data, load=save),
            loop=dataclasses.replace(self.loop, load=save),
            plugin_args=plugin_args,
        )


def _loading(trainer: TrainerSettings, load: str | None) -> TrainerSettings:
    """``trainer`` resuming the latest checkpoint in ``load``, optimizer state included."""
    checkpoint = dataclasses.replace(trainer.checkpoint, load=load, ckpt_step=None, no_load_optim=False)
    return dataclasses.replace(trainer, checkpoint=checkpoint)
