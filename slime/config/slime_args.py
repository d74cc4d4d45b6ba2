"""Family 3: slime's own flags (cluster, rollout, data, algorithm, reward, weight sync, evaluation,
logging, checkpointing, debug), split by side into two modules to keep each one readable."""

from __future__ import annotations

import argparse

from slime.config import slime_rollout_args as rollout
from slime.config import slime_train_args as train
from slime.config.slime_rollout_args import DEFAULT_ROLLOUT_FUNCTION_PATH
from slime.utils.plugins import PLUGIN_CONTRACTS

# Every flag whose value is a plugin path (``pkg.module.fn`` or ``file.py:fn``), from the one table of
# plugin contracts. Validation loads and signature-checks each one given, so a typo or a wrong
# signature fails at start-up rather than inside a Ray actor.
PLUGIN_FLAGS: tuple[str, ...] = tuple(PLUGIN_CONTRACTS)

__all__ = ["DEFAULT_ROLLOUT_FUNCTION_PATH", "PLUGIN_FLAGS", "add_slime_arguments"]


def add_slime_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add slime's own argument groups, in the order a user reads a launch script."""
    rollout.add_cluster_arguments(parser)
    rollout.add_router_arguments(parser)
    rollout.add_rollout_arguments(parser)
    rollout.add_fault_tolerance_arguments(parser)
    rollout.add_data_arguments(parser)
    rollout.add_data_loading_arguments(parser)
    train.add_algorithm_arguments(parser)
    rollout.add_reward_arguments(parser)
    train.add_distillation_arguments(parser)
    train.add_routing_replay_arguments(parser)
    train.add_lora_arguments(parser)
    train.add_weight_sync_arguments(parser)
    train.add_async_arguments(parser)
    rollout.add_eval_arguments(parser)
    train.add_logging_arguments(parser)
    train.add_checkpoint_arguments(parser)
    train.add_fault_tolerance_arguments(parser)
    train.add_debug_arguments(parser)
    return parser
