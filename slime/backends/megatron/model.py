"""Building the megatron-core GPTModel chunks, their DDP wrappers, the optimizer and the LR schedule."""

from __future__ import annotations

import argparse

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.extensions import transformer_engine as te_extension
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer import multi_latent_attention as mla
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe import moe_utils

from slime.backends.megatron.config import (
    ddp_config_from_args,
    optimizer_config_from_args,
    padded_vocab_size,
)
from slime.backends.megatron.packed_attention import PackedDotProductAttention, use_batched_thd_rope
from slime.backends.megatron.post_norm_layer import with_post_norms
from slime.config.validate import lr_schedule_steps

if not moe_utils.HAVE_TE:
    # megatron-core 0.16's router GEMM tests ``te_general_gemm is not None`` but only binds the name
    # when Transformer Engine imports; without TE every MoE forward raises NameError.
    moe_utils.te_general_gemm = None
if not te_extension.HAVE_TE:
    # That module imports without Transformer Engine too (its TE classes then are mocks), so MLA
    # takes TE for present and ``isinstance(module, <mock>)`` raises while the layer is built.
    mla.HAVE_TE = False


def _layer_spec(args: argparse.Namespace, config: TransformerConfig, vp_stage: int | None):
    """One spec for every layer, or, in an MoE model, the block of this stage's layers (dense and MoE
    layers differ: ``--moe-layer-freq``, e.g. DeepSeek-V3's first three layers are dense)."""
    te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        block = get_gpt_decoder_block_spec(config, te, normalization=args.normalization, vp_stage=vp_stage)
        block.layer_specs = [_adapt(layer, args, te) for layer in block.layer_specs]
        return block
    if te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention
        )
    else:
        spec = get_gpt_layer_local_spec(
            qk_layernorm=args.qk_layernorm,
            normalization=args.normalization,
            multi_latent_attention=args.multi_latent_attention,
        )
    return _adapt(spec, args, te)


def _adapt(spec, args: argparse.Namespace, te: bool):
    """Packed (THD) micro-batches: the local attention learns them as one right-padded batch (and
    RoPE is applied to them with one gather, ``use_batched_thd_rope``). GLM-4's
    norms of the attention and MLP outputs (``--post-self-attn-layernorm``, ``--post-mlp-layernorm``)."""
    if not te:
        spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
        use_batched_thd_rope()
    if args.post_self_attn_layernorm or args.post_mlp_layernorm:
        spec = with_post_norms(
            spec, te, args.normalization, args.post_self_attn_layernorm, args.post_mlp_layernorm
        )
    return spec


def virtual_stages(args: argparse.Namespace) -> int | None:
    """Model chunks per pipeline rank (interleaved 1F1B), or None without virtual stages."""
    if args.num_layers_per_virtual_pipeline_stage is None:
        return None
    layers_per_stage = args.num_layers // args.pipeline_model_parallel_size
    return layers_per_stage // args.num_layers_per_virtual_pipeline_stage


def build_model_chunks(args: argparse.Namespace, config: TransformerConfig) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage of this rank, unwrapped (weights are loaded next)."""
    num_vp = virtual_stages(args)
    config.virtual_pipeline_model_parallel_size = num_vp
    chunks = []
    for vp_stage in range(num_vp or 1):
        stage = vp_stage if num_vp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=_layer_spec(args, config, stage),
                vocab_size=padded_vocab_size(args),
                max_sequence_length=args.max_position_embeddings,
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                parallel_output=True,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type,
                rotary_percent=args.rotary_percent,
                rotary_base=args.rotary_base,
                rope_scaling=args.use_rope_scaling,
                rope_scaling_factor=args.rope_scaling_factor,
                vp_stage=stage,
            )
        )
    return chunks


def wrap_for_training(
    args: argparse.Namespace, config: TransformerConfig, chunks: list[torch.nn.Module]
) -> list[DistributedDataParallel]:
    """bf16/fp16 wrapper first, then DDP with contiguous grad buffers, as Megatron-LM does."""
    if args.bf16 or args.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = ddp_config_from_args(args)
    wrapped = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    # Without this the DP gradients are silently never reduced.
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(
    args: argparse.Namespace, model: list[DistributedDataParallel]
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Optimizer over the DDP chunks and Megatron's LR / weight-decay schedule in optimizer steps."""
    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), model)
    decay_steps = max(lr_schedule_steps(args), 1)
    warmup_steps = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup_steps = int(args.lr_warmup_fraction * decay_steps)
    start_wd = args.start_weight_decay if args.start_weight_decay is not None else args.weight_decay
    end_wd = args.end_weight_decay if args.end_weight_decay is not None else args.weight_decay
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=decay_steps,
        wd_incr_style=args.weight_decay_incr_style,
    )
    return optimizer, scheduler
