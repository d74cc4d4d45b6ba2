"""slime's own flags, training side: algorithm, weight sync, logging, checkpointing, debug."""

from __future__ import annotations

import argparse

from slime.config.arg_types import non_negative_float, non_negative_int, positive_float, positive_int

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
        type=positive_int,
        default=None,
        help="Samples per optimizer step (derived from the rollout size when omitted).",
    )
    g.add_argument(
        "--num-steps-per-rollout",
        type=positive_int,
        default=None,
        help="Optimizer steps per rollout (derived when omitted).",
    )
    g.add_argument(
        "--qkv-format",
        choices=["thd", "bshd"],
        default="thd",
        help="Micro-batch layout: thd packs the sequences into one row without padding; bshd pads each.",
    )
    g.add_argument(
        "--share-prompts-in-train",
        action="store_true",
        help="In a packed micro-batch, the samples of one prompt share a single copy of it: the prompt "
        "is computed once and each response attends to it (same log-probs, loss and gradient; on the "
        "CPU path's local attention, --transformer-impl local).",
    )
    g.add_argument(
        "--use-dynamic-batch-size",
        action="store_true",
        help="Form micro-batches by --max-tokens-per-gpu instead of --micro-batch-size.",
    )
    g.add_argument(
        "--max-tokens-per-gpu",
        type=positive_int,
        default=None,
        help="Token budget of one micro-batch with --use-dynamic-batch-size (at least the longest sample).",
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
        "--force-old-logprob-pass",
        action="store_true",
        help="Always run the separate forward for old log-probs. By default it is skipped when it cannot "
        "differ from the training forward (one optimizer step per rollout, no dropout, no KL reference, "
        "an outcome-reward estimator, the built-in loss): the detached log-probs of that forward are used.",
    )
    g.add_argument(
        "--ref-update-interval",
        type=positive_int,
        default=None,
        help="Refresh the KL reference from the current policy every N rollouts (default: never).",
    )
    g.add_argument(
        "--use-mis",
        action="store_true",
        help="Masked importance sampling for the rollout/trainer mismatch: drop tokens or sequences whose "
        "π_old/π_rollout leaves [--mis-lower-bound, --mis-upper-bound], weight the rest by it.",
    )
    g.add_argument(
        "--mis-level",
        choices=["token", "sequence", "geometric"],
        default="token",
        help="MIS ratio per token, per sequence (product) or per sequence geometric mean.",
    )
    g.add_argument("--mis-upper-bound", type=float, default=2.0, help="Largest MIS ratio kept.")
    g.add_argument(
        "--mis-lower-bound", type=float, default=None, help="Smallest MIS ratio kept (default 1/upper)."
    )
    c = parser.add_argument_group("slime: critic (--advantage-estimator ppo)")
    c.add_argument("--critic-num-nodes", type=positive_int, default=1, help="Nodes of the critic group.")
    c.add_argument(
        "--critic-num-gpus-per-node", type=positive_int, default=1, help="GPUs per node of the critic."
    )
    c.add_argument("--critic-lr", type=float, default=None, help="Critic learning rate (default: --lr).")
    c.add_argument(
        "--critic-load", type=str, default=None, help="Critic checkpoint dir (default: <--load>/critic)."
    )
    c.add_argument(
        "--critic-save", type=str, default=None, help="Critic checkpoint dir (default: <--save>/critic)."
    )
    c.add_argument("--value-clip", type=float, default=0.2, help="Clip range of the critic's value update.")
    c.add_argument(
        "--num-critic-only-steps",
        type=int,
        default=0,
        help="Train only the critic for the first N rollouts (the policy is not updated).",
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
    g.add_argument(
        "--freeze-vision-tower",
        action="store_true",
        help="Vision-language models: keep the vision tower (visual.*) as loaded; only the language model "
        "is trained (the tower gets no gradient buffer and no optimizer state).",
    )


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: LoRA")
    g.add_argument(
        "--lora-rank",
        type=non_negative_int,
        default=0,
        help="Rank of the LoRA adapters trained instead of the whole model (0: no LoRA, full training).",
    )
    g.add_argument(
        "--lora-alpha",
        type=positive_float,
        default=16.0,
        help="LoRA scaling numerator: updates scale by alpha/rank.",
    )
    g.add_argument(
        "--lora-dropout",
        type=non_negative_float,
        default=0.0,
        help="Dropout on the adapters' input (training only).",
    )
    g.add_argument(
        "--target-modules",
        nargs="+",
        default=["all-linear"],
        help="HF module names that get adapters: all-linear (q/k/v/o and gate/up/down projections) or a list "
        "such as q_proj v_proj.",
    )
    g.add_argument(
        "--exclude-modules",
        nargs="+",
        default=[],
        help="HF module names left without adapters (from --target-modules).",
    )
    g.add_argument(
        "--lora-adapter-path",
        type=str,
        default=None,
        help="Start from this HF PEFT adapter directory (adapter_config.json, adapter_model.safetensors).",
    )
    g.add_argument(
        "--lora-train-only",
        action="store_true",
        help="Train the adapters but keep the engines on the base model (no adapter is pushed): a baseline.",
    )


def add_distillation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: on-policy distillation")
    g.add_argument(
        "--use-opd",
        action="store_true",
        help="On-policy distillation: a teacher engine scores every sampled token (a prefill of the sample) "
        "and each token's advantage loses --opd-kl-coef × (log π_student − log π_teacher), after any "
        "--advantage-estimator.",
    )
    g.add_argument(
        "--opd-type",
        choices=["sglang", "megatron"],
        default=None,
        help="Upstream slime's OPD modes: sglang (the teacher is served by engines; the default here) or "
        "megatron (a teacher checkpoint forwarded by the trainer: not supported, serve it with "
        "--opd-teacher-hf-checkpoint instead).",
    )
    g.add_argument(
        "--opd-kl-coef",
        type=float,
        default=1.0,
        help="Weight of the reverse KL to the teacher in the advantage.",
    )
    g.add_argument(
        "--opd-teacher-urls",
        nargs="+",
        default=[],
        metavar="NAME=URL",
        help="Teachers served elsewhere (SGLang or slime's engine), by name: default=http://host:port. "
        "A sample goes to the teacher its metadata[--opd-teacher-key] names, else to default.",
    )
    g.add_argument(
        "--opd-teacher-hf-checkpoint",
        type=str,
        default=None,
        help="HF checkpoint of a teacher that slime serves itself as the 'default' teacher: engines of their "
        "own behind no router, on GPUs of their own, never given new weights.",
    )
    g.add_argument(
        "--opd-teacher-num-engines",
        type=positive_int,
        default=1,
        help="Engines serving --opd-teacher-hf-checkpoint.",
    )
    g.add_argument(
        "--opd-teacher-num-gpus-per-engine",
        type=positive_int,
        default=None,
        help="GPUs of one teacher engine (default: --rollout-num-gpus-per-engine).",
    )
    g.add_argument(
        "--opd-teacher-key",
        type=str,
        default="teacher",
        help="Sample metadata key that names a sample's teacher (a name of --opd-teacher-urls).",
    )
    g.add_argument(
        "--opd-only",
        action="store_true",
        help="Pure distillation: the task reward is set to 0, the teacher's reverse KL is the only signal.",
    )
    g.add_argument(
        "--opd-teacher-load",
        type=str,
        default=None,
        help="Upstream slime's --opd-type megatron teacher checkpoint: refused here "
        "(use --opd-teacher-hf-checkpoint).",
    )


def add_routing_replay_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: MoE routing replay")
    g.add_argument(
        "--use-rollout-routing-replay",
        action="store_true",
        help="R3: engines return the experts each token was routed to and the trainer's MoE layers use "
        "those (the routing weights still come from the trainer's router, so it trains).",
    )
    g.add_argument(
        "--use-routing-replay",
        action="store_true",
        help="R2: the trainer records its routes in the old-log-prob forward and replays them in training.",
    )


def add_weight_sync_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: weight sync")
    g.add_argument(
        "--update-weight-buffer-size",
        type=positive_int,
        default=512 * 1024**2,
        help="Bytes per weight-update bucket sent to the engines.",
    )
    g.add_argument(
        "--update-weights-timeout",
        type=positive_float,
        default=300.0,
        help="Seconds to wait for the engines to take new weights.",
    )
    g.add_argument(
        "--update-weight-transport",
        choices=["distributed", "tensor", "disk"],
        default=None,
        help="How new weights reach the engines: a broadcast over a trainer-engine process group "
        "(distributed, the default), in place through CUDA IPC / shared memory (tensor, the default "
        "with --colocate), or an HF safetensors snapshot per version that the engines load (disk).",
    )
    g.add_argument(
        "--update-weight-disk-dir",
        type=str,
        default=None,
        help="With --update-weight-transport disk: where the snapshots go (every engine must read it; "
        "only the latest snapshot is kept).",
    )
    g.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        help="Debug the weight sync: before the first push every engine snapshots its weights and fills "
        "them with noise (SGLang's /weights_checker), after it they must equal the snapshot; the run stops "
        "naming the engine and the tensors otherwise. With LoRA the base is not reset (it is never pushed) "
        "and each colocated adapter push is checked by a sha256 per tensor.",
    )
    g.add_argument(
        "--update-weights-interval",
        type=positive_int,
        default=1,
        help="Push the trainer's weights to the engines every N rollouts (and after the last one).",
    )


def add_async_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: overlapped training (train_async.py)")
    g.add_argument(
        "--async-buffer-size",
        type=positive_int,
        default=1,
        help="How many rollouts generation may run ahead of the one being trained.",
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


TRAINER_CALL_TIMEOUT_S = 3600.0
"""Default of ``--trainer-call-timeout``: a rollout's optimizer steps, a checkpoint save or the model
build of a large model take minutes to tens of minutes; an hour without an answer is a hang."""


def add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: fault tolerance (trainer)")
    g.add_argument(
        "--auto-resume",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="When a trainer rank dies, raises or hangs, restart the run from the last checkpoint in "
        "--save (needs --save-interval) up to N times; 0 stops the run at the first such failure.",
    )
    g.add_argument(
        "--trainer-call-timeout",
        type=non_negative_float,
        default=TRAINER_CALL_TIMEOUT_S,
        metavar="SECONDS",
        help="Seconds one call to the trainer ranks (a rollout's training, a save, the model build) may "
        "take before the ranks that did not answer are named and the run stops; 0: no limit.",
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
        help="Save each rollout's train data to this path pattern, which must contain {rollout_id} "
        "(plain values only: numbers, strings, lists, dicts, tensors).",
    )
    g.add_argument(
        "--load-debug-rollout-data",
        type=str,
        default=None,
        help="Train on rollouts saved with this {rollout_id} pattern (implies --debug-train-only); "
        "loaded with torch.load(weights_only=True), so a file cannot run code.",
    )
