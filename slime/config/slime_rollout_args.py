"""slime's own flags, rollout side: cluster, rollout, fault tolerance, data, large prompt sets, reward,
evaluation."""

from __future__ import annotations

import argparse

from slime.config.arg_types import non_negative_float, non_negative_int, positive_float, positive_int
from slime.engine_client.protocol import SUPPORTED_SGLANG

DEFAULT_ROLLOUT_FUNCTION_PATH = "slime.rollout.sglang_rollout.generate_rollout"


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: cluster")
    g.add_argument("--actor-num-nodes", type=positive_int, default=1, help="Nodes running trainer workers.")
    g.add_argument("--actor-num-gpus-per-node", type=positive_int, default=1, help="Trainer GPUs per node.")
    g.add_argument(
        "--rollout-num-gpus",
        type=int,
        default=None,
        help="GPUs for rollout engines (with --colocate: the trainer's GPUs, derived).",
    )
    g.add_argument(
        "--rollout-num-gpus-per-engine", type=positive_int, default=1, help="GPUs per engine (its TP size)."
    )
    g.add_argument(
        "--colocate", action="store_true", help="Run trainers and engines on the same GPUs, taking turns."
    )
    g.add_argument(
        "--rollout-external-engine-addrs",
        nargs="+",
        default=None,
        metavar="HOST:PORT",
        help="Engines already running outside this run (SGLang protocol): added to the router and "
        "updated with the others, never started or stopped by slime. An engine started with "
        "--api-key K needs --sglang-api-key K here (the run's own engines then get K too).",
    )
    g.add_argument(
        "--rollout-backend",
        choices=["sglang", "torch"],
        default=None,
        help="Engine backend (default: sglang when installed, else the in-repo torch engine).",
    )
    g.add_argument(
        "--torch-engine-sglang-release",
        choices=SUPPORTED_SGLANG,
        default=SUPPORTED_SGLANG[-1],
        help="The SGLang release whose HTTP protocol the torch engine mirrors (weight-update sessions "
        "from 0.5.21, /get_load up to 0.5.20); the oldest checks slime against older servers.",
    )
    g.add_argument(
        "--ray-address", type=str, default=None, help="Ray cluster to join (default: start a local one)."
    )
    g.add_argument(
        "--num-gpus-per-node",
        type=positive_int,
        default=8,
        help="GPUs per physical node; engines larger than this span nodes.",
    )


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "slime: router",
        "sglang-router runs with its health checks, circuit breaker and retries off (slime probes the "
        "engines itself and retries under --use-fault-tolerance; docs/guides/fault-tolerance.md).",
    )
    g.add_argument(
        "--router-request-timeout",
        type=positive_float,
        default=6 * 3600.0,
        help="Seconds the router lets one /generate run before it fails it (sglang-router's default, "
        "1800, cuts long generations of large models).",
    )
    g.add_argument(
        "--router-extra-args",
        type=str,
        default="",
        metavar="FLAGS",
        help="More sglang-router flags, one string, after slime's (e.g. '--policy cache_aware').",
    )


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: rollout")
    g.add_argument(
        "--hf-checkpoint",
        type=str,
        default=None,
        help="HF model directory (config.json, weights, tokenizer) that trainers and engines load.",
    )
    g.add_argument(
        "--rollout-function-path",
        type=str,
        default=DEFAULT_ROLLOUT_FUNCTION_PATH,
        help="Plugin path (pkg.module.fn or file.py:fn) of fn(args, rollout_id, data_source, evaluation) "
        "-> RolloutOutput, which produces one whole rollout.",
    )
    g.add_argument(
        "--custom-generate-function-path",
        type=str,
        default=None,
        help="Plugin path (pkg.module.fn, file.py:fn, or a bare file.py meaning its custom_generate, else "
        "its generate) of async fn(args, sample, sampling_params) -> Sample | list[Sample], the "
        "per-sample step (multi-turn, tools; helpers in slime.rollout.generate_utils), or of async "
        "fn(args, samples, evaluation=False) -> list[Sample], called once per prompt group.",
    )
    g.add_argument(
        "--max-turns",
        type=positive_int,
        default=8,
        help="Most model turns of a multi-turn custom generate function.",
    )
    g.add_argument(
        "--dynamic-sampling-filter-path",
        type=str,
        default=None,
        help="Plugin path of fn(args, group) -> FilterResult | bool deciding whether a finished prompt group "
        "is trained on, e.g. slime.rollout.filters.keep_varied_rewards; the rollout samples "
        "--over-sampling-batch-size prompts at a time until --rollout-batch-size groups are kept.",
    )
    g.add_argument(
        "--buffer-filter-path",
        type=str,
        default=None,
        help="Plugin path of fn(args, buffer, num_groups) -> list of groups picking which returned groups "
        "are served next (default: oldest first).",
    )
    g.add_argument(
        "--data-source-path",
        type=str,
        default=None,
        help="Plugin path of a data source class C(args) with get_samples, add_samples, save and load "
        "(default: prompts from --prompt-data).",
    )
    g.add_argument(
        "--rollout-batch-size", type=positive_int, default=None, help="Prompts per rollout (required)."
    )
    g.add_argument(
        "--n-samples-per-prompt", type=positive_int, default=1, help="Responses sampled per prompt."
    )
    g.add_argument(
        "--over-sampling-batch-size",
        type=positive_int,
        default=None,
        help="Prompts submitted per sampling round when filtering (default: --rollout-batch-size).",
    )
    g.add_argument("--rollout-temperature", type=float, default=1.0, help="Sampling temperature.")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="Nucleus sampling threshold.")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="Top-k sampling (-1 = off).")
    g.add_argument(
        "--rollout-max-response-len", type=positive_int, default=1024, help="Maximum new tokens per response."
    )
    g.add_argument(
        "--rollout-max-prompt-len",
        type=positive_int,
        default=None,
        help="Drop prompts longer than this (tokens).",
    )
    g.add_argument("--rollout-stop", nargs="+", default=None, help="Stop strings.")
    g.add_argument("--rollout-stop-token-ids", nargs="+", type=int, default=None, help="Stop token ids.")
    g.add_argument(
        "--rollout-skip-special-tokens",
        action="store_true",
        help="Drop special tokens from the decoded response text.",
    )
    g.add_argument("--rollout-seed", type=int, default=42, help="Seed of prompt shuffling and sampling.")
    g.add_argument("--rollout-shuffle", action="store_true", help="Shuffle the prompts each epoch.")
    g.add_argument(
        "--rollout-seed-per-sample",
        action="store_true",
        help="Send each sample as its own /generate carrying its own sampling_seed (from --rollout-seed "
        "and the sample's index), so a resumed run samples the same tokens as the uninterrupted one "
        "(the torch engine always; SGLang with deterministic inference). Without it each prompt group "
        "is one batched /generate, which sglang-router passes with one sampling_params for all its "
        "samples, so they carry no seed of their own; it costs less HTTP handling per step.",
    )
    g.add_argument(
        "--sglang-server-concurrency",
        type=positive_int,
        default=512,
        help="Maximum in-flight requests per engine (a slime flag, not passed to SGLang).",
    )
    g.add_argument(
        "--num-rollout",
        type=positive_int,
        default=None,
        help="Rollouts (training steps) to run; derived from --num-epoch when omitted.",
    )
    g.add_argument(
        "--num-epoch",
        type=positive_int,
        default=None,
        help="Passes over --prompt-data; sets --num-rollout once the data size is known.",
    )
    g.add_argument(
        "--partial-rollout",
        action="store_true",
        help="Keep aborted, unfinished responses and continue them in the next rollout.",
    )
    g.add_argument(
        "--mask-offpolicy-in-partial-rollout",
        action="store_true",
        help="With --partial-rollout: leave the tokens generated under older weights out of the loss.",
    )


def add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "slime: fault tolerance",
        "An engine that fails a probe, stops answering or dies is taken out of the router, restarted on "
        "its own bundles and given the current weights at the next push before it serves again; its "
        "requests are sent again to the others. docs/guides/fault-tolerance.md says what each failure costs.",
    )
    g.add_argument(
        "--use-fault-tolerance",
        action="store_true",
        help="Probe the engines, restart failed ones and retry their requests instead of stopping the run.",
    )
    g.add_argument(
        "--rollout-health-check-interval",
        type=positive_float,
        default=10.0,
        help="Seconds between two probes of an engine (GET /health_generate).",
    )
    g.add_argument(
        "--rollout-health-check-timeout",
        type=positive_float,
        default=30.0,
        help="Seconds a probe may take before the engine counts as hung (generous: a loaded engine is slow).",
    )
    g.add_argument(
        "--rollout-health-check-first-wait",
        type=non_negative_float,
        default=300.0,
        help="Seconds after the engines start before the first probe (large MoE models compile first).",
    )
    g.add_argument(
        "--rollout-request-retries",
        type=non_negative_int,
        default=5,
        help="Times a request an engine failed is sent again (0.5 s, 1 s, 2 s ... apart, at most one "
        "health-check interval) before the rollout stops.",
    )


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: data")
    g.add_argument(
        "--prompt-data",
        type=str,
        default=None,
        help="Prompt file, JSONL or Parquet, optionally sliced as PATH@[start:end].",
    )
    g.add_argument("--input-key", type=str, default="input", help="Field holding the prompt.")
    g.add_argument("--label-key", type=str, default=None, help="Field holding the label for the reward.")
    g.add_argument("--metadata-key", type=str, default="metadata", help="Field holding per-sample metadata.")
    g.add_argument("--tool-key", type=str, default=None, help="Field holding tool schemas for the template.")
    g.add_argument(
        "--apply-chat-template", action="store_true", help="Wrap prompts with the tokenizer's chat template."
    )
    g.add_argument(
        "--multimodal-keys",
        type=str,
        default=None,
        metavar="JSON",
        help='Modality -> field holding its items, as a JSON object, e.g. \'{"image": "images"}\' (only '
        '"image" for now). Each item is a path (relative to the prompt file), a base64 string (with or '
        'without a data:image/...;base64, prefix) or {"image": ..., "min_pixels": N, "max_pixels": N}; '
        'the prompt carries one <image> (or {"type": "image"} message part) per item, in order.',
    )


def add_data_loading_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "slime: large prompt sets",
        "How --prompt-data is read. By default every record is read, templated and checked at start-up "
        "and held in memory; docs/guides/large-prompt-sets.md gives the costs measured at 1M prompts.",
    )
    g.add_argument(
        "--streaming-data",
        action="store_true",
        help="Index the prompt file at start-up (12 bytes per JSONL record) and read each prompt when "
        "served: same prompts, same order, same resume as in memory, without holding the data.",
    )
    g.add_argument(
        "--num-data-workers",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="Processes that parse, chat-template and length-check prompts: at start-up in memory, ahead "
        "of each rollout with --streaming-data. The order served does not depend on N (0: in-process).",
    )
    g.add_argument(
        "--on-bad-prompt",
        choices=["stop", "skip"],
        default="stop",
        help="A malformed record (bad JSON, missing or ill-typed key) stops the run with one line naming "
        "file:line (in memory: at start-up; streaming: when served), or is skipped and counted.",
    )


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: reward")
    g.add_argument(
        "--rm-type",
        type=str,
        default=None,
        help="Built-in reward function: math, exact, f1, remote, or upstream slime's deepscaler, dapo "
        "(train with --reward-key score), random, remote_rm; boxed_<type> scores the last \\boxed{} only.",
    )
    g.add_argument(
        "--custom-rm-path",
        type=str,
        default=None,
        help="Plugin path (pkg.module.fn, file.py:fn, or a bare file.py meaning its reward_func, else its "
        "CustomRewardModel) of a custom reward function fn(args, sample), or of a reward-model class "
        "C(model_path) with compute_reward(prompts, responses) -> list, called once per prompt group.",
    )
    g.add_argument(
        "--custom-rm-model-path",
        type=str,
        default=None,
        help="model_path passed to a --custom-rm-path reward-model class when it is built (once per "
        "rollout process).",
    )
    g.add_argument(
        "--rm-batch-size",
        type=positive_int,
        default=None,
        help="At most this many samples per compute_reward call of a --custom-rm-path reward-model "
        "class (default: one call per prompt group).",
    )
    g.add_argument(
        "--group-rm",
        action="store_true",
        help="Call the custom reward function once per prompt group instead of per sample.",
    )
    g.add_argument(
        "--rm-url", type=str, default=None, help="URL of a remote reward model (--rm-type remote)."
    )
    g.add_argument(
        "--custom-reward-post-process-path",
        type=str,
        default=None,
        help="Upstream slime's plugin fn(args, samples) -> (raw_rewards, rewards) over a rollout's samples: "
        "rewards train as they are (no group normalisation), raw_rewards are logged; it may set "
        "sample.teacher_log_probs for --use-opd (slime.rollout.on_policy_distillation.post_process_rewards).",
    )
    g.add_argument(
        "--reward-key", type=str, default=None, help="Key to read when the reward function returns a dict."
    )
    g.add_argument(
        "--max-failed-reward-rollouts",
        type=non_negative_int,
        default=3,
        metavar="N",
        help="Stop the run, naming the reward function, after N rollouts in a row in which it failed on "
        "every sample (raised, or returned no finite number); 0: never stop.",
    )


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slime: evaluation")
    g.add_argument(
        "--eval-interval", type=positive_int, default=None, help="Evaluate every this many rollouts."
    )
    g.add_argument(
        "--eval-prompt-data",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME PATH",
        help="Evaluation sets as NAME PATH pairs, read with the --eval-* flags (or use --eval-config); "
        "the flag may be repeated, one set each.",
    )
    g.add_argument(
        "--eval-config",
        type=str,
        default=None,
        metavar="FILE.yaml",
        help="Evaluation sets as a YAML list, each with its own keys, n, sampling and reward (docs/"
        "guides/evaluation.md); what a set leaves out comes from the --eval-* flags, then the rollout's. "
        "Not with --eval-prompt-data.",
    )
    g.add_argument(
        "--log-passrate",
        action="store_true",
        help="Also log eval/<name>-pass@k for k = 1, 2, 4, ... up to the set's samples per prompt.",
    )
    g.add_argument(
        "--eval-pass-threshold",
        type=float,
        default=1.0,
        help="With --log-passrate: a sample is correct when its reward is at least this.",
    )
    g.add_argument(
        "--eval-output-dir",
        type=str,
        default=None,
        help="Where each evaluation's per-sample results go as rollout_<id>.jsonl (default: "
        "<--save>/eval, else <the run's log directory>/eval).",
    )
    g.add_argument(
        "--n-samples-per-eval-prompt", type=positive_int, default=1, help="Responses per eval prompt."
    )
    g.add_argument(
        "--eval-max-response-len",
        type=positive_int,
        default=None,
        help="Eval max new tokens (default: rollout's).",
    )
    g.add_argument(
        "--eval-temperature", type=float, default=None, help="Eval temperature (default: rollout's)."
    )
    g.add_argument("--eval-top-p", type=float, default=None, help="Eval top-p (default: rollout's).")
    g.add_argument("--eval-top-k", type=int, default=None, help="Eval top-k (default: rollout's).")
    g.add_argument(
        "--skip-eval-before-train", action="store_true", help="Do not evaluate before the first rollout."
    )
    g.add_argument(
        "--eval-input-key", type=str, default=None, help="Prompt field of eval data (default: --input-key)."
    )
    g.add_argument(
        "--eval-label-key", type=str, default=None, help="Label field of eval data (default: --label-key)."
    )
