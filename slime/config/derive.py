"""The values the user left to slime, filled into ``args`` so that every later reader sees one settled
configuration: the model shape from the HF config.json, the cluster and batch arithmetic, the parallel
layout, the weight transport, the algorithm's bounds, the eval sets and the plugins' absolute paths.

Each ``fill_*`` writes only values the user did not give. A value that cannot be derived (samples
that do not split into equal steps, a hidden size the heads do not divide) raises ``ConfigError``.
Each step may rely on the checks run before it: ``slime.config.parser.configure_steps`` interleaves
them with ``slime.config.validate``'s checks so that the first problem of a command line is the one
reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable, Collection
from typing import Any

from slime.config.errors import ConfigError
from slime.config.eval_config import eval_sets_from_args
from slime.config.hf_config import apply_hf_config, load_hf_config
from slime.config.megatron_args import add_megatron_arguments
from slime.config.slime_args import DEFAULT_ROLLOUT_FUNCTION_PATH, PLUGIN_FLAGS
from slime.utils.plugins import PluginError, resolve_path


def given_fn(args: argparse.Namespace, explicit: Collection[str] | None) -> Callable[[str], bool]:
    """Whether the user gave a dest: in ``explicit`` (the dests typed), or without it, a Megatron flag
    not at its Megatron default."""
    if explicit is not None:
        names = set(explicit)
        if "use_rotary_position_embeddings" in names:
            names.add("position_embedding_type")
        return names.__contains__
    defaults = _megatron_defaults()
    return lambda dest: getattr(args, dest, None) != defaults.get(dest)


@functools.cache
def _megatron_defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser(add_help=False)
    add_megatron_arguments(parser)
    return vars(parser.parse_args([]))


def fill_modes(args: argparse.Namespace) -> None:
    """Replaying saved rollouts trains only."""
    if not hasattr(args, "sglang_server_args"):
        args.sglang_server_args = {}
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True


def fill_model_from_hf(args: argparse.Namespace, given: Callable[[str], bool]) -> None:
    """Model flags left out are read from ``--hf-checkpoint``'s config.json; given ones must match it."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    config, path = load_hf_config(args.hf_checkpoint)
    apply_hf_config(args, config, path, given)


def fill_model(args: argparse.Namespace) -> None:
    """The sizes Megatron-LM derives from the model shape, derived here so that every reader agrees."""
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


def fill_cluster(args: argparse.Namespace) -> None:
    """The trainer's GPU count, and the engines' when left out: the trainer's under ``--colocate``,
    none for SFT and train-only debugging."""
    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.rollout_num_gpus is not None:
        return
    if args.colocate:
        args.rollout_num_gpus = args.world_size
        return
    if not args.debug_train_only and args.loss_type != "sft_loss":
        raise ConfigError(
            "--rollout-num-gpus",
            "required without --colocate; pass the engines' GPU count or add --colocate",
        )
    args.rollout_num_gpus = 0  # SFT and train-only debugging start no engines


def fill_batch(args: argparse.Namespace) -> None:
    """``--global-batch-size`` or ``--num-steps-per-rollout``, whichever is left out, from the samples of
    a rollout (one step when both are); the over-sampling batch defaults to the rollout batch."""
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
    args.global_batch_size, args.num_steps_per_rollout = gbs, steps
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = rbs


def fill_data_parallel_size(args: argparse.Namespace) -> None:
    """What TP × PP × CP leaves of the trainer GPUs."""
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
    args.data_parallel_size = args.world_size // model_parallel


def fill_weight_transport(args: argparse.Namespace) -> None:
    """In place when colocated, over NCCL otherwise."""
    if args.update_weight_transport is None:
        args.update_weight_transport = "tensor" if args.colocate else "distributed"


def fill_algorithm(args: argparse.Namespace) -> None:
    """Symmetric PPO clipping and MIS bounds unless given (a bad ``--mis-upper-bound`` is left to
    the check that names it)."""
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.mis_lower_bound is None and args.mis_upper_bound > 0:
        args.mis_lower_bound = 1.0 / args.mis_upper_bound


def fill_eval(args: argparse.Namespace) -> None:
    """The eval sets into ``args.eval_sets`` (``slime.config.eval_config``), their unset sampling and
    key settings following the rollout's; ``--eval-interval`` without a set turns evaluation off."""
    for key in ("max_response_len", "temperature", "top_p", "top_k"):
        if getattr(args, f"eval_{key}") is None:
            setattr(args, f"eval_{key}", getattr(args, f"rollout_{key}"))
    for key in ("input_key", "label_key"):
        if getattr(args, f"eval_{key}") is None:
            setattr(args, f"eval_{key}", getattr(args, key))
    args.eval_sets = eval_sets_from_args(args)
    if args.eval_interval is not None and not args.eval_sets:
        # The usage guide's workflow 1 passes --eval-interval with no eval data and upstream slime
        # runs it without evaluating, so this runs too: one warning, evaluation off.
        sys.stderr.write(
            "warning: --eval-interval: given without --eval-prompt-data or --eval-config; evaluation "
            "is off (add a set to evaluate)\n"
        )
        args.eval_interval = None


def fill_plugin_paths(args: argparse.Namespace) -> None:
    """Every plugin path the user set, in the form every process loads (``resolve_path``): Ray workers
    run elsewhere. The default rollout function is slime's own and stays as it is."""
    for i, eval_set in enumerate(args.eval_sets):
        if eval_set.custom_rm_path is not None:
            path = _resolved("--custom-rm-path", eval_set.custom_rm_path)
            args.eval_sets[i] = dataclasses.replace(eval_set, custom_rm_path=path)
    defaults = {"--rollout-function-path": DEFAULT_ROLLOUT_FUNCTION_PATH}
    for flag in PLUGIN_FLAGS:
        dest = flag[2:].replace("-", "_")
        path = getattr(args, dest)
        if path is not None and path != defaults.get(flag):
            setattr(args, dest, _resolved(flag, path))


def _resolved(flag: str, path: str) -> str:
    try:
        return resolve_path(flag, path)
    except PluginError as e:  # checked before: only a file changed since then gets here
        raise ConfigError(flag, str(e)) from e
