"""The critic of ``--advantage-estimator ppo``: a second trainer group, configured from the actor's flags.

The critic is the actor's ``MegatronTrainer`` with a scalar value head (``slime.backends.megatron.
value_head``) and the value loss, selected by ``loss_type = "value_loss"`` on its own copy of the
arguments. It has the actor's architecture and parallel layout and starts from ``--hf-checkpoint``
(or resumes ``--critic-load``); ``--critic-*`` flags override GPUs, learning rate and checkpoints.
"""

from __future__ import annotations

import argparse
import copy
import os


def uses_critic(args: argparse.Namespace) -> bool:
    ppo = args.advantage_estimator == "ppo" and args.loss_type == "policy_loss"
    return ppo and not args.debug_rollout_only


def critic_gpus(args: argparse.Namespace) -> int:
    return args.critic_num_nodes * args.critic_num_gpus_per_node if uses_critic(args) else 0


def critic_args(args: argparse.Namespace) -> argparse.Namespace:
    """The actor's arguments with the critic's overrides.

    Checkpoints: ``--critic-save`` (default ``<--save>/critic``) and ``--critic-load`` (default
    ``<--load>/critic``), so that saving and resuming the actor saves and resumes the critic with it.
    No reference model, no plugins: the critic only regresses values on returns.
    """
    critic = copy.copy(args)
    critic.loss_type = "value_loss"
    critic.colocate = False  # its own GPUs (the last bundles), never offloaded for the engines
    critic.actor_num_nodes = args.critic_num_nodes
    critic.actor_num_gpus_per_node = args.critic_num_gpus_per_node
    critic.world_size = args.critic_num_nodes * args.critic_num_gpus_per_node
    critic.lr = args.critic_lr if args.critic_lr is not None else args.lr
    critic.save = args.critic_save or (os.path.join(args.save, "critic") if args.save else None)
    critic.load = args.critic_load or (os.path.join(args.load, "critic") if args.load else None)
    critic.use_kl_loss = False
    critic.kl_coef = 0.0
    critic.ref_update_interval = None
    critic.custom_loss_function_path = None
    critic.custom_advantage_function_path = None
    critic.entropy_coef = 0.0
    return critic
