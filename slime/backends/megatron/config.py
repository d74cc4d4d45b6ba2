"""Megatron-LM flags (parsed by ``slime.config``) mapped into megatron-core's config objects.

The megatron-core wheel ships no ``megatron.training`` argument parser, so this module owns the
translation that Megatron-LM's ``core_transformer_config_from_args`` performs there.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from slime.utils.device import kernel_overrides


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """The dtype model parameters are held in (fp32 master weights live in the optimizer)."""
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def padded_vocab_size(args: argparse.Namespace) -> int:
    """Vocab rounded up as Megatron-LM does, so every TP rank holds an equal slice of the embedding."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(args.vocab_size / multiple) * multiple)


def grouped_experts(args: argparse.Namespace) -> bool:
    """Whether the experts run as one grouped GEMM: Transformer Engine's TEGroupedMLP only.

    The local implementation's grouped variant needs the separate ``grouped_gemm`` CUDA package, so
    there the experts run one after another (SequentialMLP), which computes the same result.
    """
    return bool(args.num_experts) and args.moe_grouped_gemm and args.transformer_impl == "transformer_engine"


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """Builds the TransformerConfig a GPTModel and its parallel layout are created from."""
    dtype = params_dtype(args)
    interleaved = args.num_layers_per_virtual_pipeline_stage is not None
    recompute_granularity = args.recompute_granularity
    if args.recompute_activations:
        recompute_granularity = "selective"
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        qk_layernorm=args.qk_layernorm,
        rotary_interleaved=args.rotary_interleaved,
        init_method_std=args.init_method_std,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        # Micro-batches differ in length; only pipeline p2p needs to be told (shapes are exchanged).
        # The interleaved schedule cannot exchange shapes: there micro-batches are padded to one shape.
        variable_seq_lengths=args.pipeline_model_parallel_size > 1 and not interleaved,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type if args.num_experts else "alltoall",
        recompute_granularity=recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        masked_softmax_fusion=args.masked_softmax_fusion,
        apply_rope_fusion=args.apply_rope_fusion,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        persist_layer_norm=args.persist_layer_norm,
        deallocate_pipeline_outputs=True,
        # Interleaved 1F1B posts its p2p ops one by one in megatron's even/odd rank order: batched,
        # a peer that is both the previous and the next stage (PP=2) gets an activation and a
        # gradient in one batch, and gloo pairs them with the receives in posting order.
        overlap_p2p_comm=interleaved and args.overlap_p2p_comm,
        batch_p2p_comm=not interleaved,
    )
    if args.num_experts:
        fields.update(
            num_moe_experts=args.num_experts,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
            moe_router_topk=args.moe_router_topk,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_router_score_function=args.moe_router_score_function,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            moe_grouped_gemm=grouped_experts(args),
            moe_layer_freq=args.moe_layer_freq,
            moe_shared_expert_gate=args.moe_shared_expert_gate,
            moe_router_dtype=args.moe_router_dtype,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_token_drop_policy=args.moe_token_drop_policy,
            moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
            moe_permute_fusion=args.moe_permute_fusion,
            moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_num_groups=args.moe_router_num_groups,
            moe_router_group_topk=args.moe_router_group_topk,
        )
    fields.update(kernel_overrides())
    if args.multi_latent_attention:
        return MLATransformerConfig(**fields, **_mla_fields(args))
    return TransformerConfig(**fields)


def _mla_fields(args: argparse.Namespace) -> dict:
    """Multi-latent attention's shape and RoPE. YaRN's settings left out keep megatron-core's
    defaults, which are DeepSeek-V3's."""
    fields = dict(
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rope_type=args.rope_type or "rope",
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
    )
    yarn = {
        "rotary_scaling_factor": args.rotary_scaling_factor,
        "mscale": args.mscale,
        "mscale_all_dim": args.mscale_all_dim,
        "original_max_position_embeddings": args.original_max_position_embeddings,
        "beta_fast": args.beta_fast,
        "beta_slow": args.beta_slow,
    }
    fields.update({key: value for key, value in yarn.items() if value is not None})
    return fields


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    """Optimizer settings; fp32 master weights are kept whenever the model runs in bf16/fp16."""
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
    )


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """Gradient buffers and reduction; grads accumulate in fp32 for bf16 training."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
