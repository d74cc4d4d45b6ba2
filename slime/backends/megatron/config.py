"""The trainer's settings (Megatron-LM's flags, ``TrainerSettings``) mapped into megatron-core's configs.

The megatron-core wheel ships no ``megatron.training`` argument parser, so this module owns the
translation that Megatron-LM's ``core_transformer_config_from_args`` performs there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.enums import AttnBackend

from slime.config.settings.trainer import ModelSettings, TrainerSettings
from slime.utils.device import kernel_overrides


def params_dtype(model: ModelSettings) -> torch.dtype:
    """The dtype model parameters are held in (fp32 master weights live in the optimizer)."""
    if model.bf16:
        return torch.bfloat16
    if model.fp16:
        return torch.float16
    return torch.float32


def padded_vocab_size(settings: TrainerSettings) -> int:
    """Vocab rounded up as Megatron-LM does, so every TP rank holds an equal slice of the embedding."""
    multiple = settings.model.make_vocab_size_divisible_by * settings.parallel.tensor_model_parallel_size
    return int(math.ceil(settings.model.vocab_size / multiple) * multiple)


def grouped_experts(model: ModelSettings) -> bool:
    """Whether the experts run as one grouped GEMM: Transformer Engine's TEGroupedMLP only.

    The local implementation's grouped variant needs the separate ``grouped_gemm`` CUDA package, so
    there the experts run one after another (SequentialMLP), which computes the same result.
    """
    return (
        bool(model.num_experts) and model.moe_grouped_gemm and model.transformer_impl == "transformer_engine"
    )


def transformer_config(settings: TrainerSettings) -> TransformerConfig:
    """Builds the TransformerConfig a GPTModel and its parallel layout are created from."""
    model, parallel = settings.model, settings.parallel
    dtype = params_dtype(model)
    interleaved = parallel.num_layers_per_virtual_pipeline_stage is not None
    fields = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        layernorm_epsilon=model.norm_epsilon,
        normalization=model.normalization,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        qk_layernorm=model.qk_layernorm,
        rotary_interleaved=model.rotary_interleaved,
        init_method_std=model.init_method_std,
        apply_residual_connection_post_layernorm=model.apply_residual_connection_post_layernorm,
        attention_softmax_in_fp32=model.attention_softmax_in_fp32,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=model.bf16,
        fp16=model.fp16,
        # Micro-batches differ in length; only pipeline p2p needs to be told (shapes are exchanged).
        # The interleaved schedule cannot exchange shapes: there micro-batches are padded to one shape.
        variable_seq_lengths=parallel.pipeline_model_parallel_size > 1 and not interleaved,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type if model.num_experts else "alltoall",
        attention_backend=AttnBackend[model.attention_backend],
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
        masked_softmax_fusion=model.masked_softmax_fusion,
        apply_rope_fusion=model.apply_rope_fusion,
        bias_activation_fusion=model.bias_swiglu_fusion if model.swiglu else model.bias_gelu_fusion,
        bias_dropout_fusion=model.bias_dropout_fusion,
        gradient_accumulation_fusion=model.gradient_accumulation_fusion,
        persist_layer_norm=model.persist_layer_norm,
        deallocate_pipeline_outputs=True,
        # Interleaved 1F1B posts its p2p ops one by one in megatron's even/odd rank order: batched,
        # a peer that is both the previous and the next stage (PP=2) gets an activation and a
        # gradient in one batch, and gloo pairs them with the receives in posting order.
        overlap_p2p_comm=interleaved and parallel.overlap_p2p_comm,
        batch_p2p_comm=not interleaved,
    )
    if model.num_experts:
        fields.update(
            num_moe_experts=model.num_experts,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
            moe_router_topk=model.moe_router_topk,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            moe_router_load_balancing_type=model.moe_router_load_balancing_type,
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_router_score_function=model.moe_router_score_function,
            moe_router_pre_softmax=model.moe_router_pre_softmax,
            moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
            moe_grouped_gemm=grouped_experts(model),
            moe_layer_freq=model.moe_layer_freq,
            moe_shared_expert_gate=model.moe_shared_expert_gate,
            moe_router_dtype=model.moe_router_dtype,
            moe_expert_capacity_factor=model.moe_expert_capacity_factor,
            moe_token_drop_policy=model.moe_token_drop_policy,
            moe_pad_expert_input_to_capacity=model.moe_pad_expert_input_to_capacity,
            moe_permute_fusion=model.moe_permute_fusion,
            moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=model.moe_router_bias_update_rate,
            moe_router_num_groups=model.moe_router_num_groups,
            moe_router_group_topk=model.moe_router_group_topk,
        )
    fields.update(kernel_overrides())
    if model.multi_latent_attention:
        return MLATransformerConfig(**fields, **_mla_fields(model))
    return TransformerConfig(**fields)


def _mla_fields(model: ModelSettings) -> dict:
    """Multi-latent attention's shape and RoPE. YaRN's settings left out keep megatron-core's
    defaults, which are DeepSeek-V3's."""
    fields = dict(
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type=model.rope_type or "rope",
        rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent,
    )
    yarn = {
        "rotary_scaling_factor": model.rotary_scaling_factor,
        "mscale": model.mscale,
        "mscale_all_dim": model.mscale_all_dim,
        "original_max_position_embeddings": model.original_max_position_embeddings,
        "beta_fast": model.beta_fast,
        "beta_slow": model.beta_slow,
    }
    fields.update({key: value for key, value in yarn.items() if value is not None})
    return fields


def optimizer_config(settings: TrainerSettings) -> OptimizerConfig:
    """Optimizer settings; fp32 master weights are kept whenever the model runs in bf16/fp16."""
    return OptimizerConfig(
        optimizer=settings.optimizer.optimizer,
        lr=settings.optimizer.lr,
        min_lr=settings.optimizer.min_lr,
        weight_decay=settings.optimizer.weight_decay,
        adam_beta1=settings.optimizer.adam_beta1,
        adam_beta2=settings.optimizer.adam_beta2,
        adam_eps=settings.optimizer.adam_eps,
        sgd_momentum=settings.optimizer.sgd_momentum,
        clip_grad=settings.optimizer.clip_grad,
        bf16=settings.model.bf16,
        fp16=settings.model.fp16,
        params_dtype=params_dtype(settings.model),
        use_distributed_optimizer=settings.parallel.use_distributed_optimizer,
        overlap_param_gather=settings.parallel.overlap_param_gather,
    )


def ddp_config(settings: TrainerSettings) -> DistributedDataParallelConfig:
    """Gradient buffers and reduction; grads accumulate in fp32 for bf16 training."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.parallel.accumulate_allreduce_grads_in_fp32 or settings.model.bf16,
        overlap_grad_reduce=settings.parallel.overlap_grad_reduce,
        overlap_param_gather=settings.parallel.overlap_param_gather,
        use_distributed_optimizer=settings.parallel.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
