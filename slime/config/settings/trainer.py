"""What a trainer rank builds and trains: the model, its parallel layout, the optimizer, the loss and the
batches, read once from the parsed flags.

Field names are the flags' dests (``--moe-router-topk`` is ``model.moe_router_topk``), so a field's
meaning is its flag's help. PPO's critic is a second trainer with the ``--critic-*`` overrides
(``critic_settings``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from slime.config.settings.flags import read_flags
from slime.config.settings.lora import LoraSettings


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """The architecture as Megatron-core builds it, filled from ``--hf-checkpoint``'s config.json."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads: ``--num-query-groups`` with ``--group-query-attention``, else the heads."""
    kv_channels: int
    vocab_size: int
    make_vocab_size_divisible_by: int
    max_position_embeddings: int
    hidden_dropout: float
    attention_dropout: float
    norm_epsilon: float
    normalization: str
    add_bias_linear: bool
    add_qkv_bias: bool
    swiglu: bool
    qk_layernorm: bool
    init_method_std: float
    apply_residual_connection_post_layernorm: bool
    attention_softmax_in_fp32: bool
    untie_embeddings_and_output_weights: bool
    post_self_attn_layernorm: bool
    """GLM-4's norm of the attention output."""
    post_mlp_layernorm: bool
    # Position embedding.
    position_embedding_type: str
    rotary_interleaved: bool
    rotary_percent: float
    rotary_base: int
    use_rope_scaling: bool
    rope_scaling_factor: float
    mrope_section: list[int] | None
    """Multimodal RoPE's (``mrope``) rotary pairs per time / height / width position."""
    # Vision-language models (``mrope``: the vision tower is built from --hf-checkpoint's vision_config).
    freeze_vision_tower: bool
    # Multi-latent attention (DeepSeek); YaRN's fields left None keep megatron-core's defaults.
    multi_latent_attention: bool
    q_lora_rank: int | None
    kv_lora_rank: int | None
    qk_head_dim: int | None
    qk_pos_emb_head_dim: int | None
    v_head_dim: int | None
    rope_type: str | None
    rotary_scaling_factor: float | None
    mscale: float | None
    mscale_all_dim: float | None
    original_max_position_embeddings: int | None
    beta_fast: float | None
    beta_slow: float | None
    # Mixture of experts (``num_experts`` None: a dense model).
    num_experts: int | None
    moe_ffn_hidden_size: int | None
    moe_router_topk: int
    moe_shared_expert_intermediate_size: int | None
    moe_router_load_balancing_type: str
    moe_aux_loss_coeff: float
    moe_router_score_function: str
    moe_router_pre_softmax: bool
    moe_router_topk_scaling_factor: float | None
    moe_grouped_gemm: bool
    moe_layer_freq: Any
    """Every n-th layer is MoE (an int), or one 0/1 per layer (a list: DeepSeek-V3's first are dense)."""
    moe_shared_expert_gate: bool
    moe_router_dtype: str | None
    moe_expert_capacity_factor: float | None
    moe_token_drop_policy: str
    moe_pad_expert_input_to_capacity: bool
    moe_permute_fusion: bool
    moe_router_enable_expert_bias: bool
    moe_router_bias_update_rate: float
    moe_router_num_groups: int | None
    moe_router_group_topk: int | None
    moe_token_dispatcher_type: str
    # Precision, implementation, recomputation and fused kernels.
    bf16: bool
    fp16: bool
    transformer_impl: str
    """``local`` (PyTorch modules) or ``transformer_engine``."""
    attention_backend: str
    """``--attention-backend``: which attention kernel Transformer Engine's layers pick (``auto``)."""
    recompute_granularity: str | None
    """``--recompute-granularity``; ``selective`` with ``--recompute-activations``."""
    recompute_method: str | None
    recompute_num_layers: int | None
    masked_softmax_fusion: bool
    apply_rope_fusion: bool
    bias_swiglu_fusion: bool
    bias_gelu_fusion: bool
    bias_dropout_fusion: bool
    gradient_accumulation_fusion: bool
    persist_layer_norm: bool
    """The negation of ``--no-persist-layer-norm``."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSettings:
        return read_flags(
            cls,
            args,
            recompute_granularity="selective" if args.recompute_activations else args.recompute_granularity,
            persist_layer_norm=not args.no_persist_layer_norm,
        )


@dataclass(frozen=True, kw_only=True)
class ParallelSettings:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    num_layers_per_virtual_pipeline_stage: int | None
    """Interleaved 1F1B's layers per model chunk; None: one chunk per pipeline rank."""
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    """``--expert-tensor-parallel-size``, the tensor-parallel size when left out."""
    sequence_parallel: bool
    world_size: int
    """The trainer's ranks: ``--actor-num-nodes`` × ``--actor-num-gpus-per-node`` (the critic's own)."""
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    overlap_p2p_comm: bool
    accumulate_allreduce_grads_in_fp32: bool
    distributed_timeout_minutes: int

    @property
    def data_parallel_size(self) -> int:
        """What TP × PP × CP leaves of the world (the flags were checked to divide it)."""
        model_parallel = (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )
        return self.world_size // model_parallel

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelSettings:
        etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
        return read_flags(cls, args, expert_tensor_parallel_size=etp, world_size=world_size)


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int | None
    """Optimizer steps of the schedule; None: the run's (``TrainerSettings.lr_schedule_steps``)."""
    lr_warmup_iters: int
    lr_warmup_fraction: float | None
    lr_warmup_init: float
    weight_decay: float
    start_weight_decay: float | None
    end_weight_decay: float | None
    weight_decay_incr_style: str
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OptimizerSettings:
        return read_flags(cls, args)


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The loss (``--loss-type``) and the algorithm that prepares its inputs (``--advantage-estimator``)."""

    loss_type: str
    """``policy_loss``, ``sft_loss``, ``custom_loss``; ``value_loss`` for PPO's critic only."""
    advantage_estimator: str
    eps_clip: float
    eps_clip_high: float
    """``--eps-clip-high``; ``--eps-clip`` when left out."""
    eps_clip_c: float | None
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    kl_coef: float
    """KL-to-reference reward shaping (0: none)."""
    entropy_coef: float
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    use_mis: bool
    mis_level: str
    mis_lower_bound: float | None
    mis_upper_bound: float
    value_clip: float
    gamma: float
    lambd: float
    loss_agg_mode: str
    disable_grpo_std_normalization: bool
    custom_loss_function_path: str | None
    custom_advantage_function_path: str | None
    use_rollout_logprobs: bool
    force_old_logprob_pass: bool
    use_rollout_routing_replay: bool
    """R3: MoE layers replay the engine's routes (``slime.backends.megatron.routing_replay``)."""
    use_routing_replay: bool
    """R2: the old-log-prob forward records the routes the training forwards replay."""
    ref_update_interval: int | None
    num_critic_only_steps: int
    use_opd: bool = False
    """``--use-opd``: each token's advantage loses ``opd_kl_coef`` × its reverse KL to the teacher."""
    opd_kl_coef: float = 1.0
    rewards_post_processed: bool = False
    """``--custom-reward-post-process-path``: the rewards are final (upstream's form), no group
    normalisation; each response token gets its sample's."""

    @property
    def needs_reference(self) -> bool:
        """A frozen reference policy is kept whenever KL is used: as a loss or as reward shaping."""
        return self.loss_type != "value_loss" and (self.use_kl_loss or self.kl_coef != 0.0)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LossSettings:
        eps_clip_high = args.eps_clip if args.eps_clip_high is None else args.eps_clip_high
        return read_flags(
            cls,
            args,
            eps_clip_high=eps_clip_high,
            rewards_post_processed=args.custom_reward_post_process_path is not None,
        )


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    """How a rollout is cut: into optimizer steps (global batches), data-parallel shards, micro-batches."""

    global_batch_size: int
    """Samples per optimizer step: the rollout's samples / ``num_steps_per_rollout``."""
    num_steps_per_rollout: int
    n_samples_per_prompt: int
    micro_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int | None
    """``--max-tokens-per-gpu``: the token budget of a dynamic micro-batch."""
    qkv_format: str
    """``thd`` (packed) or ``bshd`` (padded)."""
    share_prompts_in_train: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchSettings:
        return read_flags(cls, args)


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    hf_checkpoint: str
    """The model's HF directory: its architecture, tokenizer and initial weights."""
    load: str | None
    save: str | None
    ckpt_step: int | None
    """``--ckpt-step``: the rollout id to resume (default: the latest in ``load``)."""
    no_load_optim: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckpointSettings:
        return read_flags(cls, args)


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    model: ModelSettings
    parallel: ParallelSettings
    optimizer: OptimizerSettings
    loss: LossSettings
    batch: BatchSettings
    checkpoint: CheckpointSettings
    seed: int
    colocate: bool
    """``--colocate``: the ranks share their GPUs with the engines and offload between trainings."""
    num_rollout: int | None
    """The run's rollouts; None until known (``--num-epoch`` counts them from the data, then
    ``with_num_rollout``)."""
    temperature: float
    """The temperature log-probs and entropy are taken at: the engines' (``--rollout-temperature``), so
    old, reference and current log-probs are those of the distribution the rollout came from (SGLang
    reports ``log_softmax(logits / T)``); greedy sampling (0) trains at 1, as SGLang samples it as
    top-k 1 at temperature 1. SFT fits the data's own distribution: 1."""
    lora: LoraSettings
    """``--lora-rank`` > 0: the base is frozen and low-rank adapters train instead."""

    @property
    def is_critic(self) -> bool:
        return self.loss.loss_type == "value_loss"

    @property
    def lr_schedule_steps(self) -> int:
        """The optimizer steps the learning-rate schedule spans: ``--lr-decay-iters``, else the run's
        own (rollouts × steps per rollout; 0 while the run length is unknown)."""
        return self.optimizer.lr_decay_iters or (self.num_rollout or 0) * self.batch.num_steps_per_rollout

    @property
    def virtual_stages(self) -> int | None:
        """Model chunks per pipeline rank (interleaved 1F1B), or None without virtual stages."""
        per_chunk = self.parallel.num_layers_per_virtual_pipeline_stage
        if per_chunk is None:
            return None
        return self.model.num_layers // self.parallel.pipeline_model_parallel_size // per_chunk

    def with_num_rollout(self, num_rollout: int) -> TrainerSettings:
        """The settings once the run's length is known (the LR schedule follows it)."""
        return dataclasses.replace(self, num_rollout=num_rollout)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainerSettings:
        sft = args.loss_type == "sft_loss"
        return cls(
            model=ModelSettings.from_args(args),
            parallel=ParallelSettings.from_args(args),
            optimizer=OptimizerSettings.from_args(args),
            loss=LossSettings.from_args(args),
            batch=BatchSettings.from_args(args),
            checkpoint=CheckpointSettings.from_args(args),
            seed=args.seed,
            colocate=bool(args.colocate),
            num_rollout=args.num_rollout,
            temperature=1.0 if sft else training_temperature(args.rollout_temperature),
            lora=LoraSettings.from_args(args),
        )


def training_temperature(rollout_temperature: float) -> float:
    """An RL trainer's temperature for the engines' sampling one (``TrainerSettings.temperature``)."""
    return rollout_temperature if rollout_temperature > 0 else 1.0


def critic_settings(args: argparse.Namespace) -> TrainerSettings:
    """PPO's critic: the actor's architecture and parallel layout with a scalar value head and the value
    loss, on GPUs of its own (the last bundles, never offloaded for the engines).

    ``--critic-num-nodes`` × ``--critic-num-gpus-per-node`` ranks, ``--critic-lr`` (default ``--lr``);
    checkpoints in ``--critic-save`` (default ``<--save>/critic``) and ``--critic-load`` (default
    ``<--load>/critic``), so that saving and resuming the actor saves and resumes the critic with it.
    No reference model, no plugins: the critic only regresses values on returns.
    """
    actor = TrainerSettings.from_args(args)
    checkpoint = actor.checkpoint
    return dataclasses.replace(
        actor,
        colocate=False,
        parallel=dataclasses.replace(
            actor.parallel, world_size=args.critic_num_nodes * args.critic_num_gpus_per_node
        ),
        optimizer=dataclasses.replace(
            actor.optimizer, lr=args.critic_lr if args.critic_lr is not None else args.lr
        ),
        loss=dataclasses.replace(
            actor.loss,
            loss_type="value_loss",
            use_kl_loss=False,
            kl_coef=0.0,
            ref_update_interval=None,
            custom_loss_function_path=None,
            custom_advantage_function_path=None,
            entropy_coef=0.0,
        ),
        checkpoint=dataclasses.replace(
            checkpoint,
            save=args.critic_save or (os.path.join(checkpoint.save, "critic") if checkpoint.save else None),
            load=args.critic_load or (os.path.join(checkpoint.load, "critic") if checkpoint.load else None),
        ),
    )
