"""Building the megatron-core GPTModel chunks, their DDP wrappers, the optimizer and the LR schedule."""

from __future__ import annotations

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

from slime.backends.megatron.config import ddp_config, optimizer_config, padded_vocab_size
from slime.backends.megatron.packed_attention import PackedDotProductAttention, use_batched_thd_rope
from slime.backends.megatron.post_norm_layer import with_post_norms
from slime.backends.megatron.vision import VisionLanguageModel, freeze_vision_tower, load_vlm_config
from slime.config.settings.trainer import ModelSettings, TrainerSettings

if not moe_utils.HAVE_TE:
    # megatron-core 0.16's router GEMM tests ``te_general_gemm is not None`` but only binds the name
    # when Transformer Engine imports; without TE every MoE forward raises NameError.
    moe_utils.te_general_gemm = None
if not te_extension.HAVE_TE:
    # That module imports without Transformer Engine too (its TE classes then are mocks), so MLA
    # takes TE for present and ``isinstance(module, <mock>)`` raises while the layer is built.
    mla.HAVE_TE = False


def _layer_spec(model: ModelSettings, config: TransformerConfig, vp_stage: int | None):
    """One spec for every layer, or, in an MoE model, the block of this stage's layers (dense and MoE
    layers differ: ``--moe-layer-freq``, e.g. DeepSeek-V3's first three layers are dense)."""
    te = model.transformer_impl == "transformer_engine"
    if model.num_experts:
        block = get_gpt_decoder_block_spec(config, te, normalization=model.normalization, vp_stage=vp_stage)
        block.layer_specs = [_adapt(layer, model, te) for layer in block.layer_specs]
        return block
    if te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=model.qk_layernorm, multi_latent_attention=model.multi_latent_attention
        )
    else:
        spec = get_gpt_layer_local_spec(
            qk_layernorm=model.qk_layernorm,
            normalization=model.normalization,
            multi_latent_attention=model.multi_latent_attention,
        )
    return _adapt(spec, model, te)


def _adapt(spec, model: ModelSettings, te: bool):
    """Packed (THD) micro-batches: the local attention learns them as one right-padded batch (and
    RoPE is applied to them with one gather, ``use_batched_thd_rope``). GLM-4's
    norms of the attention and MLP outputs (``--post-self-attn-layernorm``, ``--post-mlp-layernorm``)."""
    if not te:
        spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
        use_batched_thd_rope()
    if model.post_self_attn_layernorm or model.post_mlp_layernorm:
        spec = with_post_norms(
            spec, te, model.normalization, model.post_self_attn_layernorm, model.post_mlp_layernorm
        )
    return spec


def build_model_chunks(
    settings: TrainerSettings, config: TransformerConfig, device: torch.device
) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage of this rank on ``device``, unwrapped (weights are loaded
    next). megatron-core puts its parallel layers there itself, but not the norms of the local spec."""
    num_vp = settings.virtual_stages
    config.virtual_pipeline_model_parallel_size = num_vp
    model_class, vision = _model_class(settings, config)
    chunks = []
    for vp_stage in range(num_vp or 1):
        stage = vp_stage if num_vp else None
        chunks.append(
            model_class(
                config=config,
                transformer_layer_spec=_layer_spec(settings.model, config, stage),
                vocab_size=padded_vocab_size(settings),
                max_sequence_length=settings.model.max_position_embeddings,
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                parallel_output=True,
                share_embeddings_and_output_weights=not settings.model.untie_embeddings_and_output_weights,
                position_embedding_type=settings.model.position_embedding_type,
                rotary_percent=settings.model.rotary_percent,
                rotary_base=settings.model.rotary_base,
                rope_scaling=settings.model.use_rope_scaling,
                rope_scaling_factor=settings.model.rope_scaling_factor,
                vp_stage=stage,
                **vision,
            ).to(device)
        )
    if vision and settings.model.freeze_vision_tower:
        freeze_vision_tower(chunks)
    return chunks


def _model_class(settings: TrainerSettings, config: TransformerConfig) -> tuple[type[GPTModel], dict]:
    """GPTModel, or for multimodal RoPE (Qwen2.5-VL) the vision-language model and the tower's config
    from ``--hf-checkpoint``. Its RoPE frequencies are per token, which the fused THD RoPE kernel
    (per position) cannot take."""
    if settings.model.position_embedding_type != "mrope":
        return GPTModel, {}
    hf_config = load_vlm_config(settings.checkpoint.hf_checkpoint)
    config.mrope_section = list(settings.model.mrope_section or [])
    config.apply_rope_fusion = False
    vision = {"vision_config": hf_config.vision_config, "image_token_id": hf_config.image_token_id}
    return VisionLanguageModel, vision


def wrap_for_training(
    settings: TrainerSettings, config: TransformerConfig, chunks: list[torch.nn.Module]
) -> list[DistributedDataParallel]:
    """bf16/fp16 wrapper first, then DDP with contiguous grad buffers, as Megatron-LM does."""
    if settings.model.bf16 or settings.model.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp = ddp_config(settings)
    wrapped = [
        DistributedDataParallel(config, ddp, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    # Without this the DP gradients are silently never reduced.
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(
    settings: TrainerSettings, model: list[DistributedDataParallel]
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Optimizer over the DDP chunks and Megatron's LR / weight-decay schedule in optimizer steps."""
    optimizer = get_megatron_optimizer(optimizer_config(settings), model)
    opt = settings.optimizer
    decay_steps = max(settings.lr_schedule_steps, 1)
    warmup_steps = opt.lr_warmup_iters
    if opt.lr_warmup_fraction is not None:
        warmup_steps = int(opt.lr_warmup_fraction * decay_steps)
    start_wd = opt.start_weight_decay if opt.start_weight_decay is not None else opt.weight_decay
    end_wd = opt.end_weight_decay if opt.end_weight_decay is not None else opt.weight_decay
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=opt.lr_warmup_init,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=opt.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=decay_steps,
        wd_incr_style=opt.weight_decay_incr_style,
    )
    return optimizer, scheduler
