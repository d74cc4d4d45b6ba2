"""slime's own flags, training side: algorithm, weight sync, logging, checkpointing, debug."""

from __future__ import annotations

import argparse

ADVANTAGE_ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "gspo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "cispo",
    "ppo",
)
LOSS_AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: algorithm")
    g.add_argument(
        "--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="grpo", help="Advantage estimator."
    )
    g.add_argument(
        "--loss-type",
        choices=["policy_loss", "sft_loss", "custom_loss"],
        default="policy_loss",
        help="Training loss (custom_loss needs --custom-loss-function-path).",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step (derived from the rollout size when omitted).",
    )
    g.add_argument(
        "--num-steps-per-rollout",
        type=int,
        default=None,
        help="Optimizer steps per rollout (derived when omitted).",
    )
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip range, lower side.")
    g.add_argument(
        "--eps-clip-high", type=float, default=None, help="PPO clip range, upper side (default: --eps-clip)."
    )
    g.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip PPO bound (must be > 1).")
    g.add_argument(
        "--use-kl-loss", action="store_true", help="Add a KL(policy ‖ reference) term to the loss."
    )
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="Weight of the KL loss term.")
    g.add_argument(
        "--kl-loss-type",
        choices=["k1", "k2", "k3", "low_var_kl"],
        default="k1",
        help="KL estimator of the KL loss.",
    )
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into the reward.")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="Weight of the entropy bonus.")
    g.add_argument(
        "--loss-agg-mode",
        choices=LOSS_AGGREGATION_MODES,
        default="token_mean",
        help="How token losses of a global batch become one scalar (seq_mean_token_sum: Dr. GRPO).",
    )
    g.add_argument(
        "--disable-grpo-std-normalization",
        action="store_true",
        help="Do not divide GRPO advantages by the group's standard deviation.",
    )
    g.add_argument("--gamma", type=float, default=1.0, help="Discount factor.")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda.")
    g.add_argument(
        "--ref-load", type=str, default=None, help="Megatron checkpoint of the reference model (KL)."
    )
    g.add_argument(
        "--use-tis",
        action="store_true",
        help="Correct the rollout/trainer mismatch with truncated importance sampling.",
    )
    g.add_argument("--tis-clip", type=float, default=2.0, help="Upper clip of the TIS weight.")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="Lower clip of the TIS weight.")
    g.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="Use the engine's log-probs as old log-probs instead of recomputing them.",
    )
    g.add_argument(
        "--custom-advantage-function-path",
        type=str,
        default=None,
        help="Dotted path of a custom advantage function.",
    )
    g.add_argument(
        "--custom-loss-function-path", type=str, default=None, help="Dotted path of a custom loss function."
    )


def add_weight_sync_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: weight sync")
    g.add_argument(
        "--update-weight-buffer-size",
        type=int,
        default=512 * 1024**2,
        help="Bytes per weight-update bucket sent to the engines.",
    )
    g.add_argument(
        "--update-weights-timeout",
        type=float,
        default=300.0,
        help="Seconds to wait for the engines to take new weights.",
    )


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: logging")
    g.add_argument("--tb-dir", type=str, default=None, help="TensorBoard directory (default: derived later).")
    g.add_argument("--use-wandb", action="store_true", help="Also log to Weights & Biases.")
    g.add_argument("--wandb-project", type=str, default=None, help="wandb project.")
    g.add_argument("--wandb-group", type=str, default=None, help="wandb group.")
    g.add_argument(
        "--wandb-mode", choices=["online", "offline", "disabled"], default=None, help="wandb mode."
    )
    g.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default="INFO",
        help="Log level of slime's loggers.",
    )


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: checkpointing")
    g.add_argument(
        "--save-hf", type=str, default=None, help="Directory to export HF safetensors to when saving."
    )


def add_debug_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: debug")
    g.add_argument(
        "--debug-rollout-only", action="store_true", help="Run rollouts only; no trainer is created."
    )
    g.add_argument("--debug-train-only", action="store_true", help="Train only; no engine is created.")
    g.add_argument(
        "--save-debug-rollout-data",
        type=str,
        default=None,
        help="Save each rollout to this path pattern, which must contain {rollout_id}.",
    )
    g.add_argument(
        "--load-debug-rollout-data",
        type=str,
        default=None,
        help="Train on rollouts saved with this {rollout_id} pattern (implies --debug-train-only).",
    )
