"""Validation and derived settings: everything that can be known wrong before anything starts.

A wrong flag, a missing file, an unimportable plugin or inconsistent batch arithmetic must be one
clear line at start-up, not a Ray traceback ten minutes later (DESIGN.md §4). Each check raises a
``ConfigError`` naming the flag to change and how; each derived value is written back onto
``args`` so that every later reader sees one settled configuration.

Checks run in dependency order: modes and required flags, value ranges, paths, the model shape
(filled from / checked against the HF config.json), cluster layout, batch arithmetic, parallel
layout, algorithm, evaluation, and last the plugins (they import user code).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
from collections.abc import Callable, Collection
from typing import Any

from slime.config.errors import ConfigError
from slime.config.hf_config import apply_hf_config, load_hf_config
from slime.config.megatron_args import add_megatron_arguments
from slime.config.slime_args import DEFAULT_ROLLOUT_FUNCTION_PATH, PLUGIN_FLAGS

_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


def validate_args(args: argparse.Namespace, explicit: Collection[str] | None = None) -> None:
    """Check ``args`` and set every derived value on it; raises ``ConfigError`` on the first problem.

    ``explicit`` is the set of dests the user typed (``parse_args`` passes it). A model flag not in
    it is filled from config.json; one in it must match. Without it, a Megatron flag still at its
    Megatron default counts as omitted.
    """
    given = _given_fn(args, explicit)
    if not hasattr(args, "sglang_server_args"):
        args.sglang_server_args = {}
    _check_modes(args)
    _check_required(args)
    _check_ranges(args)
    _check_paths(args)
    _derive_model(args, given)
    _check_cluster(args)
    _check_batch(args)
    _check_parallelism(args)
    _check_algorithm(args)
    _check_eval(args)
    _check_plugins(args)


def split_data_path(spec: str) -> tuple[str, slice | None]:
    """Split ``PATH@[start:end]`` (either bound optional) into the path and a ``slice``.

    Raises ``ValueError`` for a malformed suffix; a path without ``@[`` has no slice.
    """
    if "@[" not in spec:
        return spec, None
    match = _SLICE.match(spec)
    if match is None:
        raise ValueError(
            f"bad slice in {spec!r}; write PATH@[start:end] with integer bounds, e.g. data.jsonl@[0:100]"
        )
    start, stop = (int(v) if v else None for v in match.group("start", "stop"))
    return match.group("path"), slice(start, stop)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


@functools.cache
def _megatron_defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser(add_help=False)
    add_megatron_arguments(parser)
    return vars(parser.parse_args([]))


def _given_fn(args: argparse.Namespace, explicit: Collection[str] | None) -> Callable[[str], bool]:
    if explicit is not None:
        names = set(explicit)
        if "use_rotary_position_embeddings" in names:
            names.add("position_embedding_type")
        return names.__contains__
    defaults = _megatron_defaults()
    return lambda dest: getattr(args, dest, None) != defaults.get(dest)


def _check_modes(args: argparse.Namespace) -> None:
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True
    if args.debug_rollout_only and args.debug_train_only:
        flag = "--load-debug-rollout-data" if args.load_debug_rollout_data else "--debug-train-only"
        raise ConfigError(flag, "cannot be combined with --debug-rollout-only (nothing would run); keep one")
    for dest in ("save_debug_rollout_data", "load_debug_rollout_data"):
        pattern = getattr(args, dest)
        if pattern is not None and "{rollout_id}" not in pattern:
            raise ConfigError(
                _flag(dest), f"{pattern!r} has no {{rollout_id}}; use e.g. /tmp/rollout_{{rollout_id}}.pt"
            )
    if args.bf16 and args.fp16:
        raise ConfigError("--fp16", "cannot be combined with --bf16; keep one")


def _check_required(args: argparse.Namespace) -> None:
    if args.hf_checkpoint is None:
        raise ConfigError(
            "--hf-checkpoint", "required; pass the HF model directory (config.json, weights, tokenizer)"
        )
    if args.rollout_batch_size is None:
        raise ConfigError("--rollout-batch-size", "required; pass the number of prompts per rollout, e.g. 32")
    if args.lr is None and not args.debug_rollout_only:
        raise ConfigError("--lr", "required to train; pass e.g. --lr 1e-6 (or add --debug-rollout-only)")
    if args.num_rollout is None and args.num_epoch is None:
        raise ConfigError("--num-rollout", "required; pass --num-rollout N (or --num-epoch N)")


_POSITIVE = (
    "actor_num_nodes",
    "actor_num_gpus_per_node",
    "rollout_num_gpus_per_engine",
    "num_gpus_per_node",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "over_sampling_batch_size",
    "rollout_max_response_len",
    "rollout_max_prompt_len",
    "sglang_server_concurrency",
    "num_rollout",
    "num_epoch",
    "global_batch_size",
    "num_steps_per_rollout",
    "micro_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "update_weight_buffer_size",
    "update_weights_timeout",
    "eval_interval",
    "n_samples_per_eval_prompt",
    "eval_max_response_len",
    "save_interval",
)


def _check_ranges(args: argparse.Namespace) -> None:
    for dest in _POSITIVE:
        value = getattr(args, dest)
        if value is not None and value <= 0:
            raise ConfigError(_flag(dest), f"must be positive, got {value}; pass a value >= 1")
    if args.rollout_num_gpus is not None and args.rollout_num_gpus < 0:
        raise ConfigError("--rollout-num-gpus", f"must not be negative, got {args.rollout_num_gpus}")
    for prefix in ("rollout", "eval"):
        temperature, top_p, top_k = (
            getattr(args, f"{prefix}_{k}") for k in ("temperature", "top_p", "top_k")
        )
        if temperature is not None and temperature < 0:
            raise ConfigError(f"--{prefix}-temperature", f"must be >= 0, got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ConfigError(f"--{prefix}-top-p", f"must be in (0, 1], got {top_p}")
        if top_k is not None and top_k != -1 and top_k < 1:
            raise ConfigError(f"--{prefix}-top-k", f"must be -1 (off) or >= 1, got {top_k}")
    if args.lr is not None and args.lr < 0:
        raise ConfigError("--lr", f"must not be negative, got {args.lr}")


def _check_data_file(flag: str, spec: str) -> None:
    try:
        path, _ = split_data_path(spec)
    except ValueError as e:
        raise ConfigError(flag, str(e)) from e
    if not os.path.exists(path):
        raise ConfigError(flag, f"{path} does not exist; pass an existing JSONL or Parquet file")


def _check_paths(args: argparse.Namespace) -> None:
    # --hf-checkpoint is read (and so checked) by _derive_model; --load may be missing: that is
    # a fresh start, as in Megatron-LM; --load-debug-rollout-data is a {rollout_id} pattern.
    if args.prompt_data is not None:
        _check_data_file("--prompt-data", args.prompt_data)
    if args.ref_load is not None and not os.path.exists(args.ref_load):
        raise ConfigError(
            "--ref-load", f"{args.ref_load} does not exist; pass the reference checkpoint directory"
        )
    specs = args.eval_prompt_data or []
    if len(specs) % 2:
        raise ConfigError(
            "--eval-prompt-data",
            f"got {len(specs)} value(s), expected NAME PATH pairs; e.g. aime /data/aime.jsonl",
        )
    args.eval_datasets = list(zip(specs[::2], specs[1::2], strict=True))
    names = [name for name, _ in args.eval_datasets]
    if len(set(names)) != len(names):
        raise ConfigError(
            "--eval-prompt-data", f"dataset names repeat in {names}; give each set its own NAME"
        )
    for _, spec in args.eval_datasets:
        _check_data_file("--eval-prompt-data", spec)


def _derive_model(args: argparse.Namespace, given: Callable[[str], bool]) -> None:
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    config, path = load_hf_config(args.hf_checkpoint)
    apply_hf_config(args, config, path, given)
    hf_keys = {
        "num_layers": "num_hidden_layers",
        "hidden_size": "hidden_size",
        "num_attention_heads": "num_attention_heads",
        "vocab_size": "vocab_size",
    }
    for dest, key in hf_keys.items():
        value = getattr(args, dest)
        if value is None:
            raise ConfigError(_flag(dest), f"not given and {path} has no {key}; pass {_flag(dest)} N")
        if value <= 0:
            raise ConfigError(_flag(dest), f"must be positive, got {value}")
    hidden, heads = args.hidden_size, args.num_attention_heads
    if args.ffn_hidden_size is None:  # Megatron-LM's rule
        args.ffn_hidden_size = int(4 * hidden * 2 / 3 / 64) * 64 if args.swiglu else 4 * hidden
    if args.kv_channels is None:
        if hidden % heads:
            raise ConfigError(
                "--kv-channels",
                f"not given and --hidden-size {hidden} is not divisible by {heads} heads; pass it",
            )
        args.kv_channels = hidden // heads
    if not args.group_query_attention:
        args.num_query_groups = heads  # Megatron ignores --num-query-groups without GQA
    elif args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron-LM's default
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    # Megatron-LM keeps the negative dest and hands TransformerConfig the positive one.
    args.persist_layer_norm = not args.no_persist_layer_norm
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size


def _check_cluster(args: argparse.Namespace) -> None:
    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    trainer = (
        f"{args.world_size} (--actor-num-nodes {args.actor_num_nodes} × "
        f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node})"
    )
    if args.colocate:
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = args.world_size
        elif args.rollout_num_gpus != args.world_size:
            raise ConfigError(
                "--rollout-num-gpus",
                f"{args.rollout_num_gpus} differs from the trainer's GPUs {trainer} under --colocate; "
                "drop --rollout-num-gpus or make them equal",
            )
    elif args.rollout_num_gpus is None:
        if not args.debug_train_only and args.loss_type != "sft_loss":
            raise ConfigError(
                "--rollout-num-gpus",
                "required without --colocate; pass the engines' GPU count or add --colocate",
            )
        args.rollout_num_gpus = 0  # SFT and train-only debugging start no engines
    per_engine, per_node = args.rollout_num_gpus_per_engine, args.num_gpus_per_node
    if args.rollout_num_gpus % per_engine:
        raise ConfigError(
            "--rollout-num-gpus",
            f"{args.rollout_num_gpus} is not divisible by --rollout-num-gpus-per-engine {per_engine}; "
            f"use a multiple of {per_engine}",
        )
    if per_engine > per_node and per_engine % per_node:
        raise ConfigError(
            "--rollout-num-gpus-per-engine",
            f"{per_engine} spans nodes but is not a multiple of --num-gpus-per-node {per_node}; "
            f"use a multiple of {per_node}",
        )


def _check_batch(args: argparse.Namespace) -> None:
    rbs, n = args.rollout_batch_size, args.n_samples_per_prompt
    gbs, steps = args.global_batch_size, args.num_steps_per_rollout
    samples = rbs * n
    rollout = f"--rollout-batch-size × --n-samples-per-prompt = {rbs} × {n} = {samples}"
    if gbs is None:
        steps = steps or 1
        if samples % steps:
            raise ConfigError(
                "--num-steps-per-rollout",
                f"{rollout} samples cannot be split into {steps} equal steps; use a divisor of {samples}",
            )
        gbs = samples // steps
    elif steps is None:
        if samples % gbs:
            raise ConfigError(
                "--global-batch-size",
                f"{rollout} samples per rollout is not a multiple of {gbs}; use a divisor of {samples}, "
                f"e.g. --global-batch-size {samples}",
            )
        steps = samples // gbs
    elif gbs * steps != samples:
        if samples % steps == 0:
            fix = f"use --global-batch-size {samples // steps}"
        elif samples % gbs == 0:
            fix = f"use --num-steps-per-rollout {samples // gbs}"
        else:
            fix = f"make their product {samples}"
        raise ConfigError(
            "--global-batch-size",
            f"{rollout} but --global-batch-size × --num-steps-per-rollout = {gbs} × {steps} = {gbs * steps}; "
            + fix,
        )
    args.global_batch_size, args.num_steps_per_rollout = gbs, steps
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = rbs
    elif args.over_sampling_batch_size < rbs:
        raise ConfigError(
            "--over-sampling-batch-size",
            f"{args.over_sampling_batch_size} is below --rollout-batch-size {rbs}; use at least {rbs}",
        )


def _check_parallelism(args: argparse.Namespace) -> None:
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    sizes = {
        "--tensor-model-parallel-size": tp,
        "--pipeline-model-parallel-size": pp,
        "--context-parallel-size": cp,
    }
    model_parallel = tp * pp * cp
    if args.world_size % model_parallel:
        flag = next((f for f, size in sizes.items() if size > 1), "--tensor-model-parallel-size")
        raise ConfigError(
            flag,
            f"trainer GPUs {args.world_size} are not divisible by TP × PP × CP = {tp} × {pp} × {cp}; "
            f"use sizes whose product divides {args.world_size}",
        )
    args.data_parallel_size = dp = args.world_size // model_parallel
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if gbs % (mbs * dp):
        raise ConfigError(
            "--global-batch-size",
            f"{gbs} is not divisible by --micro-batch-size × data-parallel size = {mbs} × {dp}; "
            f"make the global batch (rollout batch × samples / steps) a multiple of {mbs * dp}",
        )
    layers, heads, groups = args.num_layers, args.num_attention_heads, args.num_query_groups
    if layers % pp:
        raise ConfigError(
            "--pipeline-model-parallel-size",
            f"{pp} does not divide --num-layers {layers}; use a divisor of {layers}",
        )
    vpp = args.num_layers_per_virtual_pipeline_stage
    if vpp is not None and (layers // pp) % vpp:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage",
            f"{vpp} does not divide the {layers // pp} layers of each pipeline stage; use a divisor",
        )
    if heads % tp:
        raise ConfigError(
            "--tensor-model-parallel-size",
            f"{tp} does not divide --num-attention-heads {heads}; use a divisor",
        )
    if groups % tp:
        raise ConfigError(
            "--tensor-model-parallel-size", f"{tp} does not divide --num-query-groups {groups}; use a divisor"
        )
    if heads % groups:
        raise ConfigError(
            "--num-query-groups", f"{groups} does not divide --num-attention-heads {heads}; use a divisor"
        )
    if args.sequence_parallel and tp == 1:
        raise ConfigError(
            "--sequence-parallel", "needs --tensor-model-parallel-size > 1; drop it or raise TP"
        )
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if ep > 1 and args.num_experts is None:
        raise ConfigError("--expert-model-parallel-size", f"{ep} needs an MoE model (--num-experts); use 1")
    if args.world_size % (etp * ep * pp):
        raise ConfigError(
            "--expert-model-parallel-size",
            f"trainer GPUs {args.world_size} are not divisible by expert TP × EP × PP = {etp} × {ep} × {pp}; "
            "use sizes whose product divides it",
        )
    if args.num_experts is not None and args.num_experts % ep:
        raise ConfigError(
            "--expert-model-parallel-size",
            f"{ep} does not divide --num-experts {args.num_experts}; use a divisor",
        )
    if args.recompute_granularity == "full" and (
        args.recompute_method is None or args.recompute_num_layers is None
    ):
        raise ConfigError(
            "--recompute-method",
            "--recompute-granularity full needs it; add --recompute-method uniform --recompute-num-layers 1",
        )
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ConfigError(
            "--overlap-param-gather", "needs --use-distributed-optimizer; add it or drop this flag"
        )
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ConfigError("--lr-warmup-fraction", "cannot be combined with --lr-warmup-iters; keep one")
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval", "given without --save; add --save DIR")


# Flags the parser knows (so scripts written for slime parse) whose implementation has not landed:
# refusing them beats silently training without them. Each entry: (flag, is it set?, what to do).
_NOT_YET_IMPLEMENTED = (
    (
        "--advantage-estimator",
        lambda a: a.advantage_estimator == "ppo",
        "ppo needs a critic; use grpo, dr_grpo, gspo, cispo, rloo or reinforce_plus_plus(_baseline)",
    ),
    ("--use-rollout-logprobs", lambda a: a.use_rollout_logprobs, "drop it"),
    (
        "--kl-coef",
        # Reward shaping is reinforce_plus_plus's; the reference log-probs come with --use-kl-loss.
        lambda a: a.kl_coef != 0.0 and not (a.advantage_estimator == "reinforce_plus_plus" and a.use_kl_loss),
        "only with --advantage-estimator reinforce_plus_plus --use-kl-loss (--kl-loss-coef 0 keeps the "
        "loss term off); otherwise use --use-kl-loss --kl-loss-coef",
    ),
    ("--ref-load", lambda a: a.ref_load is not None, "drop it (the reference is --hf-checkpoint)"),
    ("--colocate", lambda a: a.colocate, "run disaggregated: --rollout-num-gpus N"),
)


def check_implemented(args: argparse.Namespace) -> None:
    """Raises ConfigError for a flag whose feature has not landed yet (entry points call it)."""
    for flag, is_set, fix in _NOT_YET_IMPLEMENTED:
        if is_set(args):
            raise ConfigError(flag, f"is not implemented in this version yet; {fix}")


def _check_algorithm(args: argparse.Namespace) -> None:
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        raise ConfigError("--eps-clip-c", f"must be > 1 (dual-clip bound), got {args.eps_clip_c}; e.g. 3.0")
    if args.loss_type == "custom_loss" and args.custom_loss_function_path is None:
        raise ConfigError("--loss-type", "custom_loss needs --custom-loss-function-path module.function")
    if args.rm_type == "remote" and args.rm_url is None:
        raise ConfigError("--rm-url", "required with --rm-type remote; pass the reward model's URL")
    if args.group_rm and args.custom_rm_path is None:
        raise ConfigError("--group-rm", "needs --custom-rm-path (a function scoring a whole group)")
    if args.use_tis and args.tis_clip_low >= args.tis_clip:
        raise ConfigError(
            "--tis-clip-low", f"{args.tis_clip_low} is not below --tis-clip {args.tis_clip}; lower it"
        )


def _check_eval(args: argparse.Namespace) -> None:
    if args.eval_interval is not None and not args.eval_datasets:
        raise ConfigError("--eval-interval", "given without --eval-prompt-data; add NAME PATH pairs")
    # Unset eval sampling settings follow the rollout's.
    for key in ("max_response_len", "temperature", "top_p", "top_k"):
        if getattr(args, f"eval_{key}") is None:
            setattr(args, f"eval_{key}", getattr(args, f"rollout_{key}"))
    for key in ("input_key", "label_key"):
        if getattr(args, f"eval_{key}") is None:
            setattr(args, f"eval_{key}", getattr(args, key))


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _check_plugins(args: argparse.Namespace) -> None:
    # Only paths the user set are imported: the default rollout function is slime's own and
    # importing it would pull in torch here, before anything starts.
    defaults = {"--rollout-function-path": DEFAULT_ROLLOUT_FUNCTION_PATH}
    for flag in PLUGIN_FLAGS:
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is None or path == defaults.get(flag):
            continue
        module_name, _, attr = path.rpartition(".")
        if not module_name or not attr:
            raise ConfigError(
                flag, f"{path!r} is not a dotted path module.attr; use e.g. my_pkg.rewards.score"
            )
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(
                flag, f"cannot import module {module_name!r} ({_one_line(e)}); check the path and PYTHONPATH"
            ) from e
        try:
            target = getattr(module, attr)
        except AttributeError as e:
            raise ConfigError(flag, f"{_one_line(e)}; check the function name in {path}") from e
        if not callable(target):
            raise ConfigError(
                flag, f"{path} is a {type(target).__name__}, not a callable; point it at a function"
            )
