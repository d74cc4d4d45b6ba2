"""Family 3: slime's own flags (cluster, rollout, data, algorithm, reward, weight sync, evaluation,
logging, checkpointing, debug), split by side into two modules to keep each one readable."""

from __future__ import annotations

import argparse

from slime.config import slime_rollout_args as rollout
from slime.config import slime_train_args as train
from slime.config.slime_rollout_args import DEFAULT_ROLLOUT_FUNCTION_PATH

# Every flag whose value is a ``module.attr`` dotted path to a user function. Validation imports
# each one it is given, so a typo fails at start-up rather than inside a Ray actor.
PLUGIN_FLAGS: tuple[str, ...] = (
    "--rollout-function-path",
    "--custom-generate-function-path",
    "--custom-rm-path",
    "--custom-advantage-function-path",
    "--custom-loss-function-path",
)

__all__ = ["DEFAULT_ROLLOUT_FUNCTION_PATH", "PLUGIN_FLAGS", "add_slime_arguments"]


def add_slime_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add slime's own argument groups, in the order a user reads a launch script."""
    rollout.add_cluster_arguments(parser)
    rollout.add_rollout_arguments(parser)
    rollout.add_data_arguments(parser)
    train.add_algorithm_arguments(parser)
    rollout.add_reward_arguments(parser)
    train.add_weight_sync_arguments(parser)
    rollout.add_eval_arguments(parser)
    train.add_logging_arguments(parser)
    train.add_checkpoint_arguments(parser)
    train.add_debug_arguments(parser)
    return parser
