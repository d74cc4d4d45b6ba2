"""The checks: everything that can be known wrong before anything starts. They read ``args`` only.

A wrong flag, a missing file, an unimportable plugin or inconsistent batch arithmetic must be one
clear line at start-up, not a Ray traceback ten minutes later (docs/architecture.md, "Validation
before anything starts"). Each check raises a ``ConfigError`` naming the flag to change and how.
The values slime derives are filled in by ``slime.config.derive``;
``slime.config.parser.configure_steps`` runs both in dependency order.

Checks run in that order: modes and required flags, value ranges, paths, the model shape (filled
from / checked against the HF config.json), cluster layout, batch arithmetic, parallel layout,
Megatron options, weight transport, algorithm, evaluation, and last the plugins (they import user
code). The file reads in that order too, each check's helpers after it. Counts and sizes that must
be positive are refused earlier, while parsing, by their argparse type (``arg_types``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
import tempfile
from pathlib import Path

from slime.backends.megatron.lora.targets import MLP_MODULES, partly_targeted
from slime.config.engine_backend import missing_server_requirements, resolve_backend
from slime.config.errors import ConfigError
from slime.config.hf_config import CONFIG_NAME
from slime.config.reward_types import BOXED_PREFIX, BUILTIN_REWARD_TYPES
from slime.config.settings.data import is_vision_checkpoint, parse_multimodal_keys
from slime.config.settings.distillation import DEFAULT_TEACHER, parse_teacher_urls
from slime.config.settings.lora import target_modules
from slime.config.settings.router import RouterSettings
from slime.config.sglang_args import check_sglang_server_args
from slime.config.slime_args import DEFAULT_ROLLOUT_FUNCTION_PATH, PLUGIN_FLAGS
from slime.utils.checkpoint_layout import TRACKER_FILE, iteration_dir, latest_rollout_id, saved_rollout_ids
from slime.utils.plugins import (
    PluginError,
    check_plugin,
    load_function,
    resolve_path,
    reward_model_needs_path,
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_modes(args: argparse.Namespace) -> None:
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
    if args.mask_offpolicy_in_partial_rollout and not args.partial_rollout:
        raise ConfigError(
            "--mask-offpolicy-in-partial-rollout",
            "needs --partial-rollout (nothing is resumed without it); add it",
        )


def check_required(args: argparse.Namespace) -> None:
    if args.hf_checkpoint is None:
        raise ConfigError(
            "--hf-checkpoint", "required; pass the HF model directory (config.json, weights, tokenizer)"
        )
    if args.rollout_batch_size is None:
        raise ConfigError("--rollout-batch-size", "required; pass the number of prompts per rollout, e.g. 32")
    if args.num_rollout is None and args.num_epoch is None:
        raise ConfigError("--num-rollout", "required; pass --num-rollout N (or --num-epoch N)")


def check_ranges(args: argparse.Namespace) -> None:
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


def check_sglang(args: argparse.Namespace) -> None:
    check_sglang_server_args(args.sglang_server_args)


def check_paths(args: argparse.Namespace) -> None:
    # --hf-checkpoint is read (and so checked) by derive.fill_model_from_hf; --load-debug-rollout-data is a
    # {rollout_id} pattern.
    check_checkpoint_to_load(args)
    if args.prompt_data is not None:
        _check_data_file("--prompt-data", args.prompt_data)
    if args.ref_load is not None and not os.path.exists(args.ref_load):
        raise ConfigError(
            "--ref-load", f"{args.ref_load} does not exist; pass the reference checkpoint directory"
        )
    _check_output_dirs(args)


def _check_output_dirs(args: argparse.Namespace) -> None:
    """Every directory the run writes to can be created and written, checked by making (and removing) a
    directory in its nearest existing parent: a checkpoint directory that cannot be written would
    otherwise fail in the trainer at the first save, after every process started (or at the end of
    the run, for --save-hf). ``os.access`` is not enough: root may "write" to /proc."""
    debug_dump = args.save_debug_rollout_data
    dirs = {
        "--save": args.save,
        "--critic-save": args.critic_save,
        "--save-hf": args.save_hf,
        "--eval-output-dir": args.eval_output_dir,
        "--tb-dir": args.tb_dir,
        "--update-weight-disk-dir": args.update_weight_disk_dir,
        "--save-debug-rollout-data": (os.path.dirname(debug_dump) or ".") if debug_dump else None,
    }
    for flag, directory in dirs.items():
        if directory is not None:
            _check_writable_dir(flag, directory)


def _check_writable_dir(flag: str, directory: str) -> None:
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):  # also False where a parent cannot be searched
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(flag, f"cannot create {directory}: {existing} is a file; pass a directory path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".slime-write-check-", dir=existing))
    except OSError as e:
        raise ConfigError(
            flag, f"cannot write {directory} ({e.strerror} in {existing}); pass a directory you can write"
        ) from e


def check_data_loading(args: argparse.Namespace) -> None:
    """The "large prompt sets" flags read --prompt-data; a --data-source-path class reads its own.
    --multimodal-keys is a JSON object naming known modalities, for a vision-language checkpoint."""
    if (
        parse_multimodal_keys(args.multimodal_keys)
        and args.hf_checkpoint
        and not is_vision_checkpoint(args.hf_checkpoint)
    ):
        raise ConfigError(
            "--multimodal-keys",
            f"needs a vision-language --hf-checkpoint; {args.hf_checkpoint}/config.json has no vision_config "
            "(supported: Qwen2.5-VL; docs/guides/vision-language.md)",
        )
    chosen = [
        flag
        for flag, is_set in (
            ("--streaming-data", args.streaming_data),
            ("--num-data-workers", args.num_data_workers > 0),
            ("--on-bad-prompt", args.on_bad_prompt != "stop"),
        )
        if is_set
    ]
    if chosen and args.data_source_path is not None:
        raise ConfigError(
            chosen[0], "applies to --prompt-data, not to a --data-source-path class (it reads its own data)"
        )
    if args.streaming_data and args.prompt_data is None:
        raise ConfigError("--streaming-data", "reads --prompt-data; pass the prompt file or drop the flag")


def check_checkpoint_to_load(args: argparse.Namespace, required: bool = False) -> int | None:
    """The rollout id ``--load`` (and ``--ckpt-step``) will restore, or None for a fresh start.

    A missing ``--load`` directory or tracker is a fresh start, as in Megatron-LM, unless ``required``.
    """
    if args.load is None:
        if required:
            raise ConfigError("--load", "required; pass a torch_dist checkpoint dir (train.py's --save)")
        if args.ckpt_step is not None:
            raise ConfigError("--ckpt-step", "given without --load; add --load DIR")
        return None
    try:
        latest = latest_rollout_id(args.load)
    except ValueError as e:
        raise ConfigError("--load", str(e)) from e
    rollout_id = latest if args.ckpt_step is None else args.ckpt_step
    if rollout_id is None:
        if required:
            raise ConfigError(
                "--load", f"{args.load} holds no checkpoint ({TRACKER_FILE} is missing); check the path"
            )
        return None
    target = iteration_dir(args.load, rollout_id)
    if not target.is_dir():
        raise ConfigError(
            "--load" if args.ckpt_step is None else "--ckpt-step",
            f"{args.load} has no checkpoint of rollout {rollout_id} ({target.name} is missing); "
            f"saved rollouts: {saved_rollout_ids(args.load)}",
        )
    return rollout_id


def _check_data_file(flag: str, spec: str) -> None:
    try:
        path, _ = split_data_path(spec)
    except ValueError as e:
        raise ConfigError(flag, str(e)) from e
    if not os.path.exists(path):
        raise ConfigError(flag, f"{path} does not exist; pass an existing JSONL or Parquet file")


_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


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


def check_model_shape(args: argparse.Namespace) -> None:
    """The shape config.json had to give where the command line did not."""
    path = os.path.join(args.hf_checkpoint, CONFIG_NAME)
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


def _check_router(args: argparse.Namespace) -> None:
    try:
        settings = RouterSettings.from_args(args)
    except ValueError as exc:  # shlex: an unbalanced quote
        raise ConfigError("--router-extra-args", f"cannot be split into flags: {exc}") from None
    if settings.extra_args and (problem := settings.check()) is not None:
        raise ConfigError("--router-extra-args", f"sglang-router refuses them: {problem}")


def check_cluster(args: argparse.Namespace) -> None:
    if args.colocate and args.rollout_num_gpus != args.world_size:
        trainer = (
            f"{args.world_size} (--actor-num-nodes {args.actor_num_nodes} × "
            f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node})"
        )
        raise ConfigError(
            "--rollout-num-gpus",
            f"{args.rollout_num_gpus} differs from the trainer's GPUs {trainer} under --colocate; "
            "drop --rollout-num-gpus or make them equal",
        )
    _check_router(args)
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


def check_batch(args: argparse.Namespace) -> None:
    rbs, n = args.rollout_batch_size, args.n_samples_per_prompt
    gbs, steps = args.global_batch_size, args.num_steps_per_rollout
    samples = rbs * n
    if gbs * steps != samples:  # both given (``derive.fill_batch`` fills one from the other)
        if samples % steps == 0:
            fix = f"use --global-batch-size {samples // steps}"
        elif samples % gbs == 0:
            fix = f"use --num-steps-per-rollout {samples // gbs}"
        else:
            fix = f"make their product {samples}"
        rollout = f"--rollout-batch-size × --n-samples-per-prompt = {rbs} × {n} = {samples}"
        raise ConfigError(
            "--global-batch-size",
            f"{rollout} but --global-batch-size × --num-steps-per-rollout = {gbs} × {steps} = {gbs * steps}; "
            + fix,
        )
    if args.over_sampling_batch_size < rbs:
        raise ConfigError(
            "--over-sampling-batch-size",
            f"{args.over_sampling_batch_size} is below --rollout-batch-size {rbs}; use at least {rbs}",
        )


def check_parallelism(args: argparse.Namespace) -> None:
    """The trainer's parallel layout against its batches and the model's shape (``derive`` checked
    TP × PP × CP against the GPUs when it took the data-parallel size from them)."""
    _check_micro_batches(args)
    _check_model_split(args)
    _check_context_parallel(args)
    _check_shared_prompts(args)
    _check_sequence_parallel(args)
    _check_expert_parallel(args)
    _check_vision_language(args)
    _check_lora(args)


def _check_micro_batches(args: argparse.Namespace) -> None:
    if args.use_dynamic_batch_size != (args.max_tokens_per_gpu is not None):
        if args.use_dynamic_batch_size:
            raise ConfigError("--use-dynamic-batch-size", "needs --max-tokens-per-gpu N; add it")
        raise ConfigError("--max-tokens-per-gpu", "has no effect without --use-dynamic-batch-size; add it")
    dp = args.data_parallel_size
    # Dynamic micro-batches are cut from each rank's samples by tokens, not by --micro-batch-size.
    mbs = 1 if args.use_dynamic_batch_size else args.micro_batch_size
    gbs = args.global_batch_size
    if gbs % (mbs * dp):
        raise ConfigError(
            "--global-batch-size",
            f"{gbs} is not divisible by --micro-batch-size × data-parallel size = {mbs} × {dp}; "
            f"make the global batch (rollout batch × samples / steps) a multiple of {mbs * dp}",
        )


def _check_model_split(args: argparse.Namespace) -> None:
    """The layers must split evenly over pipeline stages, the heads and KV groups over TP ranks."""
    layers, heads, groups = args.num_layers, args.num_attention_heads, args.num_query_groups
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
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


def _check_context_parallel(args: argparse.Namespace) -> None:
    cp = args.context_parallel_size
    if cp > 1:
        # Megatron expects each context-parallel rank to get its load-balanced chunks of every sequence
        # (and the log-probs and loss gathered back); slime's micro-batches are not split that way.
        raise ConfigError(
            "--context-parallel-size",
            f"{cp} is not supported yet: slime does not split micro-batches across context-parallel "
            "ranks, so each would train on whole sequences; use 1 (for long sequences: "
            "--use-dynamic-batch-size --max-tokens-per-gpu N, --recompute-activations)",
        )


def _check_shared_prompts(args: argparse.Namespace) -> None:
    """A shared prompt's segment needs its own mask and positions, which only slime's packed local
    attention takes (Transformer Engine's THD attention is causal within each segment)."""
    if not args.share_prompts_in_train:
        return
    if args.qkv_format != "thd":
        raise ConfigError("--share-prompts-in-train", "shares prompts in packed rows; drop --qkv-format bshd")
    if args.transformer_impl != "local":
        raise ConfigError(
            "--share-prompts-in-train",
            "needs --transformer-impl local (Transformer Engine's packed attention has no mask for a "
            "shared prompt); drop the flag or use the local layers",
        )


def _check_sequence_parallel(args: argparse.Namespace) -> None:
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise ConfigError(
            "--sequence-parallel", "needs --tensor-model-parallel-size > 1; drop it or raise TP"
        )
    if args.sequence_parallel and args.transformer_impl != "transformer_engine":
        raise ConfigError(
            "--sequence-parallel",
            "needs Transformer Engine's norms (megatron-core's local torch norms refuse sequence "
            "parallelism), which the CPU path lacks; add --transformer-impl transformer_engine on GPUs",
        )
    if args.multi_latent_attention and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        # Measured: without it the down projection's gradient misses the other ranks' heads' share of
        # the RoPE key they all use (a one-layer model's update 59 % off the one-rank one).
        raise ConfigError(
            "--tensor-model-parallel-size",
            "> 1 with --multi-latent-attention needs --sequence-parallel (megatron-core's MLA gradients "
            "are wrong without it; Transformer Engine, GPU only); add it, or split the model with "
            "--pipeline-model-parallel-size / --expert-model-parallel-size instead",
        )


def _check_vision_language(args: argparse.Namespace) -> None:
    """A vision-language model (multimodal RoPE) on the layouts its megatron-core policy supports."""
    if args.position_embedding_type != "mrope":
        if args.freeze_vision_tower:
            raise ConfigError(
                "--freeze-vision-tower", "has no effect: the model has no vision tower; drop the flag"
            )
        return
    if not args.mrope_section:
        raise ConfigError(
            "--mrope-section", "needed with --position-embedding-type mrope (config.json gives it)"
        )
    if args.pipeline_model_parallel_size > 1:
        raise ConfigError(
            "--pipeline-model-parallel-size",
            f"{args.pipeline_model_parallel_size} is not supported for a vision-language model yet; use 1",
        )


def _check_lora(args: argparse.Namespace) -> None:
    """LoRA (``--lora-rank``) on the layers the trainer's adapters wrap: the local spec's dense
    attention and MLP linears, a fused layer's HF modules all or none."""
    if not args.lora_rank:
        if args.lora_train_only or args.lora_adapter_path:
            flag = "--lora-train-only" if args.lora_train_only else "--lora-adapter-path"
            raise ConfigError(flag, "applies to LoRA runs only; add --lora-rank R")
        return
    targets = target_modules(args.target_modules, args.exclude_modules)
    adapter = args.lora_adapter_path
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise ConfigError(
            "--lora-adapter-path", f"{adapter} has no adapter_config.json; pass an HF PEFT adapter dir"
        )
    if args.multimodal_keys is not None:
        raise ConfigError(
            "--lora-rank", "LoRA on a vision-language model is not supported yet; drop one of the two"
        )
    if args.colocate and args.actor_num_nodes > 1:
        raise ConfigError(
            "--colocate",
            "with LoRA, the adapter is handed over from one node's rank 0; use one node or drop it",
        )
    if args.multi_latent_attention:
        raise ConfigError("--lora-rank", "LoRA on multi-latent attention is not supported; drop --lora-rank")
    if args.transformer_impl != "local":
        raise ConfigError("--transformer-impl", "LoRA adapts the local spec's linears; use local")
    if args.num_experts and set(targets) & set(MLP_MODULES):
        raise ConfigError(
            "--target-modules", "MoE experts get no LoRA; add --exclude-modules gate_proj up_proj down_proj"
        )
    if (fused := partly_targeted(targets)) is not None:
        raise ConfigError(
            "--target-modules", f"Megatron fuses {' '.join(fused)} into one layer: name all or none"
        )


def _check_expert_parallel(args: argparse.Namespace) -> None:
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    pp = args.pipeline_model_parallel_size
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
    if args.num_experts is not None:
        _check_moe(args)


def _check_moe(args: argparse.Namespace) -> None:
    freq, layers = args.moe_layer_freq, args.num_layers
    if isinstance(freq, list) and len(freq) != layers:
        raise ConfigError(
            "--moe-layer-freq",
            f"lists {len(freq)} layers but --num-layers is {layers}; give one 0/1 per layer",
        )
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(layers)]
    if any(pattern) and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        # megatron-core's MoELayer raises in training mode when attention TP > 1 runs without it.
        raise ConfigError(
            "--tensor-model-parallel-size",
            "> 1 with MoE layers needs --sequence-parallel in megatron-core (Transformer Engine, GPU "
            "only); add it on GPUs or use --expert-model-parallel-size instead of TP",
        )
    if args.expert_model_parallel_size > 1 and args.moe_token_dispatcher_type == "allgather":
        # Megatron's allgather dispatcher gathers equal-sized token buffers over the expert-parallel
        # ranks, which span data-parallel ranks; their micro-batches differ in length here.
        raise ConfigError(
            "--moe-token-dispatcher-type",
            "allgather needs the same token count on every expert-parallel rank, but micro-batches "
            "differ in length across data-parallel ranks; use alltoall with --expert-model-parallel-size > 1",
        )
    if args.moe_shared_expert_gate and not args.moe_shared_expert_intermediate_size:
        raise ConfigError(
            "--moe-shared-expert-gate", "needs --moe-shared-expert-intermediate-size N (the shared expert)"
        )
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ConfigError(
            "--moe-pad-expert-input-to-capacity",
            "needs --moe-expert-capacity-factor; add it or drop this flag",
        )


def check_training_options(args: argparse.Namespace) -> None:
    """Megatron options that need another one: recomputation, the distributed optimizer, warm-up, saving
    (and resuming from what is saved)."""
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
    steps = _lr_schedule_steps(args)
    if args.lr_warmup_iters and steps and args.lr_warmup_iters >= steps:
        # megatron-core's scheduler asserts warm-up < decay steps, which the run's steps are by default.
        where = "--lr-decay-iters" if args.lr_decay_iters else "--num-rollout × --num-steps-per-rollout"
        raise ConfigError(
            "--lr-warmup-iters",
            f"{args.lr_warmup_iters} is not below the schedule's {steps} optimizer steps ({where}); "
            "lower it or train for more steps",
        )
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval", "given without --save; add --save DIR")
    if args.auto_resume and (args.save is None or args.save_interval is None):
        missing = "--save DIR --save-interval N" if args.save is None else "--save-interval N"
        raise ConfigError(
            "--auto-resume", f"resumes from the checkpoints in --save and needs them; add {missing}"
        )
    _check_routing_replay(args)


def _check_routing_replay(args: argparse.Namespace) -> None:
    """MoE routing replay: routers that pick a top-k; for R3 engines that return routes, for R2 an
    old-log-prob forward to record in (``slime.backends.megatron.routing_replay``)."""
    flag = next(
        (name for name, on in (("--use-rollout-routing-replay", args.use_rollout_routing_replay),
                               ("--use-routing-replay", args.use_routing_replay)) if on),
        None,
    )  # fmt: skip
    if flag is None:
        return
    if args.num_experts is None:
        raise ConfigError(flag, "replays MoE routes but the model has no experts (--num-experts); drop it")
    if args.moe_router_load_balancing_type == "sinkhorn":
        raise ConfigError(
            flag,
            "replays a top-k choice, which sinkhorn routing does not make; use "
            "--moe-router-load-balancing-type aux_loss, seq_aux_loss or none",
        )
    if args.use_rollout_routing_replay:
        if args.rollout_external_engine_addrs:
            sys.stderr.write(
                "warning: --use-rollout-routing-replay: the --rollout-external-engine-addrs engines must "
                "have been started with --enable-return-routed-experts, or their replies carry no routes\n"
            )
        return
    if args.loss_type not in ("policy_loss", "custom_loss"):
        raise ConfigError(
            flag,
            f"records routes in the old-log-prob forward, which --loss-type {args.loss_type} does not run; "
            "use --use-rollout-routing-replay (the engine's routes) or drop it",
        )
    if args.use_rollout_logprobs:
        raise ConfigError(
            flag,
            "records routes in the old-log-prob forward, which --use-rollout-logprobs skips; use "
            "--use-rollout-routing-replay to replay the engine's routes instead",
        )


def check_weight_sync(args: argparse.Namespace) -> None:
    """The weight transport against the placement: in place only when colocated, never NCCL on one GPU."""
    transport = args.update_weight_transport
    if args.colocate and args.update_weights_interval != 1:
        raise ConfigError(
            "--update-weights-interval",
            "must be 1 with --colocate (the engines give their memory to the trainer every rollout and "
            "need the weights back before generating); drop it",
        )
    if transport == "tensor" and not args.colocate:
        raise ConfigError(
            "--update-weight-transport",
            "tensor hands the weights over in place and needs --colocate; use distributed or disk",
        )
    if transport == "distributed" and args.colocate:
        raise ConfigError(
            "--update-weight-transport",
            "distributed cannot run with --colocate (NCCL needs a GPU per rank); use tensor or disk",
        )
    if transport == "tensor":
        if args.pipeline_model_parallel_size > 1:
            raise ConfigError(
                "--colocate",
                "the tensor transport needs --pipeline-model-parallel-size 1 (each GPU hands its engine "
                "every weight); add --update-weight-transport disk or drop pipeline parallelism",
            )
        if args.rollout_num_gpus_per_engine > args.num_gpus_per_node:
            raise ConfigError(
                "--rollout-num-gpus-per-engine",
                "an engine spanning nodes cannot take weights through CUDA IPC; "
                "add --update-weight-transport disk",
            )
    if transport == "disk" and args.update_weight_disk_dir is None:
        raise ConfigError(
            "--update-weight-disk-dir",
            "required with --update-weight-transport disk; pass a directory every engine can read",
        )
    if transport != "disk" and args.update_weight_disk_dir is not None:
        raise ConfigError(
            "--update-weight-disk-dir",
            "given without --update-weight-transport disk; add it or drop this flag",
        )
    for addr in args.rollout_external_engine_addrs or []:
        host, _, port = addr.removeprefix("http://").rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                "--rollout-external-engine-addrs", f"{addr!r} is not HOST:PORT; e.g. 10.0.0.5:30000"
            )
    if args.rollout_external_engine_addrs:
        if transport == "tensor":
            raise ConfigError(
                "--rollout-external-engine-addrs",
                "engines outside the run cannot map the trainer's memory; add --update-weight-transport disk",
            )
        if not args.rollout_num_gpus:
            raise ConfigError(
                "--rollout-external-engine-addrs",
                "needs at least one engine of this run's own in this version (--rollout-num-gpus >= 1)",
            )


def check_engine_backend(args: argparse.Namespace) -> None:
    """What the SGLang servers need for the flags slime sets on them, installed here: the driver runs
    the engine nodes' image (the Docker image has them all)."""
    if args.rollout_num_gpus == 0 or not uses_engines(args):
        return
    if resolve_backend(args.rollout_backend) != "sglang":
        return
    from slime.utils.hardware import has_gpu

    for flag, server_flag, module in missing_server_requirements(bool(args.colocate)):
        # torch_memory_saver pauses CUDA allocations: without a GPU no install makes --colocate work.
        if module == "torch_memory_saver" and not has_gpu():
            raise ConfigError(
                flag,
                f"needs GPUs with SGLang engines (they take turns on them through {server_flag}, which "
                "pauses CUDA memory) and no GPU is visible here; run on GPU nodes, or use "
                "--rollout-backend torch, which colocates on CPU",
            )
        raise ConfigError(
            flag,
            f"starts SGLang with {server_flag}, which needs the Python package {module}, not installed "
            f"here; pip install {module} (the Docker image has it) or drop {flag}",
        )


def _lr_schedule_steps(args: argparse.Namespace) -> int:
    """``TrainerSettings.lr_schedule_steps`` before the settings exist: ``--lr-decay-iters``, else the
    run's own (``--num-rollout`` × ``--num-steps-per-rollout``; 0 while the run length is unknown)."""
    return int(args.lr_decay_iters or (args.num_rollout or 0) * args.num_steps_per_rollout)


def uses_engines(args: argparse.Namespace) -> bool:
    """SFT and train-only debugging need no rollout engines."""
    return not args.debug_train_only and args.loss_type != "sft_loss"


def check_algorithm(args: argparse.Namespace) -> None:
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        raise ConfigError("--eps-clip-c", f"must be > 1 (dual-clip bound), got {args.eps_clip_c}; e.g. 3.0")
    if args.loss_type == "custom_loss" and args.custom_loss_function_path is None:
        raise ConfigError("--loss-type", "custom_loss needs --custom-loss-function-path module.function")
    if args.rm_type is not None and args.rm_type.removeprefix(BOXED_PREFIX) not in BUILTIN_REWARD_TYPES:
        raise ConfigError(
            "--rm-type",
            f"unknown {args.rm_type!r}; choose one of {', '.join(BUILTIN_REWARD_TYPES)} "
            f"(or {BOXED_PREFIX}<type>), or pass --custom-rm-path",
        )
    if args.rm_type in ("remote", "remote_rm") and args.rm_url is None:
        raise ConfigError("--rm-url", f"required with --rm-type {args.rm_type}; pass the reward model's URL")
    if args.group_rm and args.custom_rm_path is None:
        raise ConfigError("--group-rm", "needs --custom-rm-path (a function scoring a whole group)")
    if args.tis_clip_low >= args.tis_clip:  # also the bounds of the logged mismatch clip fraction
        raise ConfigError(
            "--tis-clip-low", f"{args.tis_clip_low} is not below --tis-clip {args.tis_clip}; lower it"
        )
    _check_off_policy_corrections(args)
    if args.advantage_estimator == "ppo":
        _check_critic(args)
    _check_distillation(args)


OPD_SERVED_TEACHER = (
    "serve the teacher with --opd-teacher-hf-checkpoint PATH or --opd-teacher-urls default=URL"
)


def _check_distillation(args: argparse.Namespace) -> None:
    """``--use-opd``: a ``default`` teacher that speaks the student's tokens, and no trainer-side teacher."""
    if args.opd_type == "megatron" or args.opd_teacher_load is not None:
        flag = "--opd-teacher-load" if args.opd_teacher_load is not None else "--opd-type"
        raise ConfigError(
            flag,
            "a teacher forwarded by the trainer (--opd-type megatron) is not supported; "
            + OPD_SERVED_TEACHER,
        )
    teachers = parse_teacher_urls(args.opd_teacher_urls or [])
    if not args.use_opd:
        given = [
            flag
            for flag, value in (
                ("--opd-teacher-urls", teachers),
                ("--opd-teacher-hf-checkpoint", args.opd_teacher_hf_checkpoint),
                ("--opd-only", args.opd_only),
                ("--opd-type", args.opd_type),
            )
            if value
        ]
        if given:
            raise ConfigError(given[0], "has no effect without --use-opd; add --use-opd")
        return
    checkpoint = args.opd_teacher_hf_checkpoint
    if checkpoint is not None and DEFAULT_TEACHER in teachers:
        raise ConfigError(
            "--opd-teacher-urls",
            f"names a {DEFAULT_TEACHER!r} teacher and --opd-teacher-hf-checkpoint starts one; "
            "keep one of the two",
        )
    if teachers and checkpoint is None and DEFAULT_TEACHER not in teachers:
        raise ConfigError(
            "--opd-teacher-urls",
            f"needs a {DEFAULT_TEACHER}=URL teacher for samples whose "
            f"metadata[{args.opd_teacher_key!r}] names none",
        )
    upstream_form = args.custom_reward_post_process_path is not None
    if not teachers and checkpoint is None and not upstream_form:
        raise ConfigError("--use-opd", f"needs a teacher: {OPD_SERVED_TEACHER}")
    if checkpoint is not None:
        if not (Path(checkpoint) / CONFIG_NAME).is_file():
            raise ConfigError(
                "--opd-teacher-hf-checkpoint",
                f"{checkpoint} has no {CONFIG_NAME}; pass an HF model directory",
            )
        _check_same_tokenizer(args.hf_checkpoint, checkpoint)


def _check_same_tokenizer(student: str, teacher: str) -> None:
    """The teacher scores the student's token ids: both must map ids to the same strings."""
    from transformers import AutoTokenizer

    ours, theirs = (AutoTokenizer.from_pretrained(path, local_files_only=True) for path in (student, teacher))
    if ours.get_vocab() != theirs.get_vocab():
        raise ConfigError(
            "--opd-teacher-hf-checkpoint",
            f"{teacher}'s tokenizer differs from --hf-checkpoint {student}'s "
            f"({len(theirs)} vs {len(ours)} tokens); "
            "the teacher must score the student's token ids: pick a teacher of the same tokenizer",
        )


def _check_off_policy_corrections(args: argparse.Namespace) -> None:
    if args.use_mis and args.use_tis:
        raise ConfigError("--use-mis", "cannot be combined with --use-tis (one IS correction); keep one")
    for flag, on in (("--use-tis", args.use_tis), ("--use-mis", args.use_mis)):
        if on and args.use_rollout_logprobs:
            raise ConfigError(
                flag,
                "corrects the trainer's old log-probs towards the engines'; with --use-rollout-logprobs "
                "they are the engines' (every weight would be 1); drop one of the two",
            )
    if args.mis_upper_bound <= 0:
        raise ConfigError("--mis-upper-bound", f"must be positive, got {args.mis_upper_bound}; e.g. 2.0")
    if not 0 <= args.mis_lower_bound < args.mis_upper_bound:
        raise ConfigError(
            "--mis-lower-bound",
            f"{args.mis_lower_bound} must be >= 0 and below --mis-upper-bound {args.mis_upper_bound}",
        )
    if args.kl_coef and args.custom_advantage_function_path is not None:
        raise ConfigError(
            "--kl-coef",
            "shapes the rewards of the built-in estimators; a custom advantage function ignores it; drop one",
        )


def _check_critic(args: argparse.Namespace) -> None:
    if args.loss_type != "policy_loss" or args.custom_advantage_function_path is not None:
        flag = "--loss-type" if args.loss_type != "policy_loss" else "--custom-advantage-function-path"
        raise ConfigError(
            flag,
            "--advantage-estimator ppo trains the policy on the critic's GAE; use --loss-type "
            "policy_loss without a custom advantage function",
        )
    if args.sequence_parallel:
        raise ConfigError(
            "--sequence-parallel",
            "is not supported with --advantage-estimator ppo yet: the critic's value head would get "
            "sequence-sharded hidden states; drop it (dense models run tensor parallelism without it)",
        )
    if args.value_clip <= 0:
        raise ConfigError("--value-clip", f"must be positive, got {args.value_clip}; e.g. 0.2")
    if args.num_critic_only_steps < 0:
        raise ConfigError("--num-critic-only-steps", f"must be >= 0, got {args.num_critic_only_steps}")
    world = args.critic_num_nodes * args.critic_num_gpus_per_node
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    model_parallel *= args.context_parallel_size
    if world % model_parallel:
        raise ConfigError(
            "--critic-num-gpus-per-node",
            f"critic GPUs {world} are not divisible by TP × PP × CP = {model_parallel} (the critic has the "
            "actor's layout); use a multiple of it",
        )
    dp = world // model_parallel
    if not args.use_dynamic_batch_size and args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(
            "--critic-num-gpus-per-node",
            f"the global batch {args.global_batch_size} is not divisible by --micro-batch-size × the "
            f"critic's data-parallel size = {args.micro_batch_size} × {dp}; change the critic's GPUs",
        )


def check_eval(args: argparse.Namespace) -> None:
    """The eval sets settled into ``args.eval_sets`` (``derive.fill_eval``): their files and reward
    plugins."""
    flag = "--eval-config" if args.eval_config is not None else "--eval-prompt-data"
    if args.eval_pass_threshold != 1.0 and not args.log_passrate:
        raise ConfigError("--eval-pass-threshold", "counts only with --log-passrate; add it or drop this")
    for eval_set in args.eval_sets:
        _check_data_file(flag, eval_set.path)
        if eval_set.rm_type == "remote" and args.rm_url is None:
            raise ConfigError("--rm-url", f"required by eval set {eval_set.name!r} (rm_type remote)")
    _check_eval_reward_plugins(args)


def _check_eval_reward_plugins(args: argparse.Namespace) -> None:
    """A set's own ``custom_rm_path`` is loaded and checked like ``--custom-rm-path`` (the flag's own,
    which sets inherit, is checked with the other plugins); every one must resolve to the absolute
    form ``derive.fill_plugin_paths`` gives it."""
    for eval_set in args.eval_sets:
        path = eval_set.custom_rm_path
        if path is None:
            continue
        flag = "--custom-rm-path" if path == args.custom_rm_path else "--eval-config"
        try:
            if path != args.custom_rm_path:
                target = check_plugin("--custom-rm-path", path)
                _check_reward_model_path(args, target, args.custom_rm_path)
            resolve_path("--custom-rm-path", path)
        except PluginError as e:
            where = "" if flag == "--custom-rm-path" else f"{args.eval_config}: set {eval_set.name!r}: "
            raise ConfigError(flag, f"{where}{e}") from e


def check_plugins(args: argparse.Namespace) -> None:
    # Only paths the user set are imported: the default rollout function is slime's own and
    # importing it would pull in torch here, before anything starts.
    defaults = {"--rollout-function-path": DEFAULT_ROLLOUT_FUNCTION_PATH}
    for flag in PLUGIN_FLAGS:
        dest = flag[2:].replace("-", "_")
        path = getattr(args, dest)
        if path is None or path == defaults.get(flag):
            continue
        try:
            target = check_plugin(flag, path)
        except PluginError as e:
            raise ConfigError(flag, str(e)) from e
        if flag == "--custom-rm-path":
            _check_reward_model_path(args, target, resolve_path(flag, path))


def check_reward_model_flags(args: argparse.Namespace) -> None:
    """``--custom-rm-model-path`` and ``--rm-batch-size`` reach only a reward-model class (the flag's or
    an eval set's); without one they would be ignored in silence. Reads the resolved plugin paths."""
    paths = {args.custom_rm_path, *(eval_set.custom_rm_path for eval_set in args.eval_sets)} - {None}
    if any(inspect.isclass(load_function(path)) for path in paths):
        return
    for flag in ("--custom-rm-model-path", "--rm-batch-size"):
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise ConfigError(
                flag,
                "counts only with a reward-model class in --custom-rm-path (C(model_path) with "
                "compute_reward(prompts, responses)); drop it",
            )


def _check_reward_model_path(args: argparse.Namespace, target: object, shown: str) -> None:
    """A reward-model class whose constructor needs ``model_path`` gets it from ``--custom-rm-model-path``;
    without the flag it would fail in every rollout process, so it is refused here (``shown`` names it)."""
    if inspect.isclass(target) and args.custom_rm_model_path is None and reward_model_needs_path(target):
        raise ConfigError(
            "--custom-rm-model-path",
            f"required by the reward-model class {shown} (its constructor takes model_path)",
        )
