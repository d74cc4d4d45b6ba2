"""Family 1: Megatron-LM's own flags, with Megatron-LM's names, dests and defaults.

The megatron-core wheel ships no ``megatron.training`` argument parser, so this project owns the
flags that ``scripts/models/*.sh`` and Megatron-LM launch scripts pass. Names, ``dest`` and
defaults follow ``megatron/training/arguments.py``; the few deliberate differences are said in
the help text (dropout 0.0, ``--transformer-impl local``, ``--num-query-groups`` derived), and the
parallel sizes, ``--micro-batch-size`` and ``--save-interval`` refuse values below 1 while parsing.
Model-shape flags left out are filled from the HF ``config.json`` (see ``hf_config.py``).
"""

from __future__ import annotations

import argparse
import ast

from slime.config.arg_types import positive_int

_FROM_HF = "taken from config.json when omitted"


def moe_layer_freq(text: str) -> int | list[int]:
    """``--moe-layer-freq``: N (an MoE layer every N layers) or a 0/1 list per layer, e.g. ``[0]*1+[1]*47``.

    Megatron-LM evaluates the list with ``eval``; here only list literals, ``+`` and ``*`` of integers
    are read. Shell-level quotes that a script passed through verbatim (``"'([1]*48)'"``) are dropped.
    """
    text = text.strip().strip("'\"")
    if text.isdigit() and int(text) > 0:
        return int(text)

    def value(node: ast.AST) -> int | list[int]:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(item) for item in node.elts]
            ints = [item for item in items if type(item) is int]
            if len(ints) == len(items):
                return ints
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                if isinstance(left, int) and isinstance(right, int):
                    return left + right
                if isinstance(left, list) and isinstance(right, list):
                    return left + right
            else:
                if isinstance(left, int) and isinstance(right, int):
                    return left * right
                if isinstance(left, list) and isinstance(right, int):
                    return left * right
                if isinstance(left, int) and isinstance(right, list):
                    return left * right
            raise TypeError  # int + list, list * list: what Python itself rejects
        raise ValueError

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or any(item not in (0, 1) for item in pattern):
        raise argparse.ArgumentTypeError(f"{text!r} is neither N nor a 0/1 list such as [0]*1+[1]*47")
    return pattern


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every Megatron-LM flag slime understands, one argument group per topic."""
    _add_model(parser)
    _add_moe(parser)
    _add_multi_latent_attention(parser)
    _add_parallelism(parser)
    _add_training(parser)
    _add_lr_schedule(parser)
    _add_checkpointing(parser)
    _add_kernels(parser)
    return parser


def _add_model(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron: model")
    g.add_argument("--num-layers", type=int, default=None, help=f"Number of transformer layers ({_FROM_HF}).")
    g.add_argument("--hidden-size", type=int, default=None, help=f"Transformer hidden size ({_FROM_HF}).")
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help=f"MLP hidden size ({_FROM_HF}, else 4 × hidden size).",
    )
    g.add_argument(
        "--num-attention-heads", type=int, default=None, help=f"Number of attention heads ({_FROM_HF})."
    )
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help=f"Use grouped-query attention ({_FROM_HF}: set when KV heads < heads).",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help=f"Number of KV head groups ({_FROM_HF}; equals the head count without GQA).",
    )
    g.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help=f"Per-head dimension (head_dim {_FROM_HF}, else hidden size / heads).",
    )
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help=f"Maximum sequence length of position embeddings ({_FROM_HF}).",
    )
    g.add_argument("--seq-length", type=int, default=None, help="Maximum sequence length to process.")
    g.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope", "mrope", "none"],
        default="learned_absolute",
        help=f"Position embedding type (rope {_FROM_HF} when it has rope_theta, mrope when it has "
        "an mrope_section).",
    )
    g.add_argument(
        "--mrope-section",
        type=int,
        nargs="+",
        default=None,
        help=f"Multimodal RoPE: the rotary pairs of the time, height and width positions ({_FROM_HF}).",
    )
    g.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Use rotary position embeddings (same as --position-embedding-type rope).",
    )
    g.add_argument("--rotary-base", type=int, default=10000, help=f"RoPE base (rope_theta {_FROM_HF}).")
    g.add_argument(
        "--rotary-percent", type=float, default=1.0, help="Fraction of the head dimension that RoPE rotates."
    )
    g.add_argument(
        "--rotary-interleaved",
        action="store_true",
        help="Rotate interleaved pairs (x0, x1), (x2, x3), ... instead of the two halves (GLM-4 does).",
    )
    g.add_argument("--use-rope-scaling", action="store_true", help="Apply Llama-3.x RoPE scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="RoPE scaling factor.")
    g.add_argument(
        "--normalization",
        choices=["LayerNorm", "RMSNorm"],
        default="LayerNorm",
        help=f"Normalization layer type (RMSNorm {_FROM_HF} when it has rms_norm_eps).",
    )
    g.add_argument(
        "--norm-epsilon", type=float, default=1e-5, help=f"Epsilon of the norm layers ({_FROM_HF})."
    )
    g.add_argument("--swiglu", action="store_true", help=f"Use a SwiGLU MLP ({_FROM_HF}: hidden_act silu).")
    g.add_argument(
        "--post-self-attn-layernorm",
        action="store_true",
        help=f"Norm the attention output before its residual add, as GLM-4 does ({_FROM_HF}).",
    )
    g.add_argument(
        "--post-mlp-layernorm",
        action="store_true",
        help=f"Norm the MLP output before its residual add, as GLM-4 does ({_FROM_HF}).",
    )
    g.add_argument("--squared-relu", action="store_true", help="Use squared ReLU as the MLP activation.")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help=f"Keep separate input-embedding and output weights ({_FROM_HF}: tie_word_embeddings).",
    )
    g.add_argument(
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help=f"Remove the bias of all linear layers (dest add_bias_linear; {_FROM_HF}).",
    )
    g.add_argument(
        "--add-qkv-bias", action="store_true", help=f"Add a bias to the QKV projection ({_FROM_HF})."
    )
    g.add_argument("--qk-layernorm", action="store_true", help=f"Normalize queries and keys ({_FROM_HF}).")
    g.add_argument("--vocab-size", type=int, default=None, help=f"Vocabulary size ({_FROM_HF}).")
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this (times TP) for efficiency.",
    )
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=0.0,
        help="Attention dropout; 0.0 here (Megatron-LM: 0.1) so trainer log-probs match the engine's.",
    )
    g.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.0,
        help="Hidden dropout; 0.0 here (Megatron-LM: 0.1) so trainer log-probs match the engine's.",
    )
    g.add_argument(
        "--init-method-std", type=float, default=0.02, help="Standard deviation of the weight initialization."
    )
    g.add_argument(
        "--attention-softmax-in-fp32", action="store_true", help="Compute the attention softmax in fp32."
    )
    g.add_argument(
        "--apply-residual-connection-post-layernorm",
        action="store_true",
        help="Take the residual after the layer norm (original BERT style).",
    )


def _add_moe(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron: mixture of experts")
    g.add_argument(
        "--num-experts", type=int, default=None, help=f"Number of experts per MoE layer ({_FROM_HF})."
    )
    g.add_argument(
        "--moe-ffn-hidden-size",
        type=int,
        default=None,
        help=f"Hidden size of each expert MLP (moe_intermediate_size {_FROM_HF}).",
    )
    g.add_argument(
        "--moe-router-topk",
        type=int,
        default=2,
        help=f"Experts each token is routed to (num_experts_per_tok {_FROM_HF}).",
    )
    g.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help=f"Total hidden size of the shared experts ({_FROM_HF}).",
    )
    g.add_argument(
        "--moe-router-load-balancing-type",
        choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
        default="aux_loss",
        help="Load-balancing strategy of the router.",
    )
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="Scale of the auxiliary loss.")
    g.add_argument(
        "--moe-router-score-function",
        choices=["softmax", "sigmoid"],
        default="softmax",
        help="Score function of the router.",
    )
    g.add_argument(
        "--moe-router-pre-softmax",
        action="store_true",
        help=f"Apply the softmax before the top-k selection (norm_topk_prob=false; {_FROM_HF}).",
    )
    g.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="Run the experts as one grouped GEMM (with --transformer-impl transformer_engine; the local "
        "implementation runs them one after another, with the same result).",
    )
    g.add_argument(
        "--moe-token-dispatcher-type",
        choices=["allgather", "alltoall"],
        default="allgather",
        help="How tokens are sent to the experts (alltoall with --expert-model-parallel-size > 1: "
        "micro-batches differ in length across ranks, which allgather cannot take).",
    )
    g.add_argument(
        "--moe-layer-freq",
        type=moe_layer_freq,
        default=1,
        help=f"MoE layer every N layers, or a 0/1 list per layer like [0]*1+[1]*47 ({_FROM_HF}).",
    )
    g.add_argument(
        "--moe-shared-expert-gate",
        action="store_true",
        help=f"Scale the shared expert by a sigmoid gate, as Qwen2-MoE does ({_FROM_HF}).",
    )
    g.add_argument(
        "--moe-router-dtype",
        choices=["fp32", "fp64"],
        default=None,
        help="Compute the router in this precision (default: the model's).",
    )
    g.add_argument(
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="Tokens an expert takes, as a multiple of the even share; default: dropless (as HF computes).",
    )
    g.add_argument(
        "--moe-token-drop-policy",
        choices=["probs", "position"],
        default="probs",
        help="Which tokens an expert over capacity drops.",
    )
    g.add_argument(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="Pad every expert's input to its capacity (needs --moe-expert-capacity-factor).",
    )
    g.add_argument(
        "--moe-router-topk-scaling-factor",
        type=float,
        default=None,
        help=f"Scale applied to the top-k routing weights (routed_scaling_factor {_FROM_HF}).",
    )
    g.add_argument(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="A per-expert bias added to the scores for the top-k choice only (DeepSeek-V3's "
        f"e_score_correction_bias; {_FROM_HF}).",
    )
    g.add_argument(
        "--moe-router-bias-update-rate",
        type=float,
        default=0.0,
        help="How fast the expert bias follows the experts' load (aux-loss-free balancing); "
        "0 keeps the checkpoint's bias, as the engines use it.",
    )
    g.add_argument(
        "--moe-router-num-groups",
        type=positive_int,
        default=None,
        help=f"Expert groups for group-limited routing (n_group {_FROM_HF}).",
    )
    g.add_argument(
        "--moe-router-group-topk",
        type=positive_int,
        default=None,
        help=f"Groups each token may use (topk_group {_FROM_HF}).",
    )


def _add_multi_latent_attention(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron: multi-latent attention (DeepSeek-V3, Kimi-K2, Moonlight)")
    g.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help=f"Multi-latent attention: queries and keys/values through low-rank projections ({_FROM_HF}).",
    )
    g.add_argument(
        "--q-lora-rank",
        type=positive_int,
        default=None,
        help=f"Rank of the query projection; none: a full query projection ({_FROM_HF}).",
    )
    g.add_argument(
        "--kv-lora-rank",
        type=positive_int,
        default=None,
        help=f"Rank of the key/value projection ({_FROM_HF}).",
    )
    g.add_argument(
        "--qk-head-dim",
        type=positive_int,
        default=None,
        help=f"Per-head query/key dimension without RoPE ({_FROM_HF}).",
    )
    g.add_argument(
        "--qk-pos-emb-head-dim",
        type=positive_int,
        default=None,
        help=f"Per-head query/key dimension that RoPE rotates ({_FROM_HF}).",
    )
    g.add_argument(
        "--v-head-dim", type=positive_int, default=None, help=f"Per-head value dimension ({_FROM_HF})."
    )
    g.add_argument(
        "--rope-type",
        choices=["rope", "yarn"],
        default=None,
        help=f"RoPE of multi-latent attention: plain, or YaRN-scaled ({_FROM_HF}: rope_scaling).",
    )
    g.add_argument("--rotary-scaling-factor", type=float, default=None, help=f"YaRN factor ({_FROM_HF}).")
    g.add_argument("--mscale", type=float, default=None, help=f"YaRN mscale ({_FROM_HF}).")
    g.add_argument("--mscale-all-dim", type=float, default=None, help=f"YaRN mscale_all_dim ({_FROM_HF}).")
    g.add_argument(
        "--original-max-position-embeddings",
        type=positive_int,
        default=None,
        help=f"Context length YaRN scales from ({_FROM_HF}).",
    )
    g.add_argument("--beta-fast", type=float, default=None, help=f"YaRN beta_fast ({_FROM_HF}).")
    g.add_argument("--beta-slow", type=float, default=None, help=f"YaRN beta_slow ({_FROM_HF}).")


def _add_parallelism(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron: parallelism")
    g.add_argument(
        "--tensor-model-parallel-size", type=positive_int, default=1, help="Tensor-parallel size (TP)."
    )
    g.add_argument(
        "--pipeline-model-parallel-size", type=positive_int, default=1, help="Pipeline-parallel size (PP)."
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=positive_int,
        default=None,
        help="Layers per virtual pipeline stage (interleaved 1F1B).",
    )
    g.add_argument(
        "--no-overlap-p2p-communication",
        action="store_false",
        dest="overlap_p2p_comm",
        help="Interleaved 1F1B: wait for each pipeline send/receive instead of overlapping them.",
    )
    g.add_argument(
        "--context-parallel-size", type=positive_int, default=1, help="Context-parallel size (CP)."
    )
    g.add_argument(
        "--expert-model-parallel-size", type=positive_int, default=1, help="Expert-parallel size (EP)."
    )
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=positive_int,
        default=None,
        help="Tensor-parallel size inside the experts (defaults to TP).",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Shard activations along the sequence (needs TP > 1).",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard the optimizer state across data-parallel ranks.",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Overlap the gradient reduce-scatter with backward.",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="Overlap the parameter all-gather with forward (needs --use-distributed-optimizer).",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=int,
        default=10,
        help="Timeout of torch.distributed collectives, in minutes.",
    )


def _add_training(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron: training & optimizer")
    g.add_argument(
        "--micro-batch-size", type=positive_int, default=1, help="Samples per micro-batch per DP rank."
    )
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam", help="Optimizer.")
    g.add_argument(
        "--lr",
        type=float,
        default=1e-6,
        help="Peak learning rate (default 1e-6, upstream slime's RL default).",
    )
    g.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay coefficient.")
    g.add_argument(
        "--start-weight-decay", type=float, default=None, help="Weight decay at the start of the schedule."
    )
    g.add_argument(
        "--end-weight-decay", type=float, default=None, help="Weight decay at the end of the schedule."
    )
    g.add_argument(
        "--weight-decay-incr-style",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="How the weight decay moves from start to end.",
    )
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global gradient-norm clipping threshold.")
    g.add_argument("--bf16", action="store_true", help="Train in bfloat16 mixed precision.")
    g.add_argument("--fp16", action="store_true", help="Train in float16 mixed precision.")
    g.add_argument("--seed", type=int, default=1234, help="Random seed of the trainer.")
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Average the loss over tokens instead of over samples.",
    )
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Accumulate and all-reduce gradients in fp32.",
    )
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Recompute activations in backward (same as --recompute-granularity selective).",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="Activation recomputation granularity.",
    )
    g.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="How layers are chosen for full recomputation.",
    )
    g.add_argument(
        "--recompute-num-layers", type=int, default=None, help="Layers recomputed per stage or chunk."
    )
    g.add_argument(
        "--train-iters", type=int, default=None, help="Accepted for compatibility; slime counts rollouts."
    )


def _add_lr_schedule(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron: learning-rate schedule")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor of the decay.")
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        default="linear",
        help="Learning-rate decay function.",
    )
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Optimizer steps over which to decay.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Optimizer steps of linear warm-up.")
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters).",
    )
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warm-up.")


def _add_checkpointing(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron: checkpointing")
    g.add_argument(
        "--load",
        type=str,
        default=None,
        help="Megatron checkpoint directory to resume from; a missing directory means a fresh start.",
    )
    g.add_argument("--save", type=str, default=None, help="Directory to save Megatron checkpoints to.")
    g.add_argument(
        "--save-interval", type=positive_int, default=None, help="Save a checkpoint every this many rollouts."
    )
    g.add_argument(
        "--no-load-optim", action="store_true", default=None, help="Do not load the optimizer state."
    )
    g.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load the RNG state.")
    g.add_argument(
        "--no-save-optim", action="store_true", default=None, help="Do not save the optimizer state."
    )
    g.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save the RNG state.")
    g.add_argument(
        "--finetune",
        action="store_true",
        help="Load weights only and restart counters, optimizer and RNG from scratch.",
    )
    g.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist", help="Checkpoint format.")
    g.add_argument(
        "--ckpt-step", type=int, default=None, help="Load this iteration instead of the latest one."
    )


def _add_kernels(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "Megatron: kernels & fusions (accepted for script compatibility)",
        "Honoured on GPU; no-ops on the CPU path.",
    )
    g.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="Transformer layer implementation (Megatron-LM's default is transformer_engine).",
    )
    g.add_argument(
        "--attention-backend",
        choices=["auto", "flash", "fused", "unfused", "local"],
        default="auto",
        help="Attention kernel backend.",
    )
    g.add_argument("--use-flash-attn", action="store_true", help="Use FlashAttention.")
    g.add_argument(
        "--no-masked-softmax-fusion",
        action="store_false",
        dest="masked_softmax_fusion",
        help="Disable the fused scale-mask-softmax kernel.",
    )
    g.add_argument(
        "--no-bias-gelu-fusion",
        action="store_false",
        dest="bias_gelu_fusion",
        help="Disable the fused bias+GeLU kernel.",
    )
    g.add_argument(
        "--no-bias-swiglu-fusion",
        action="store_false",
        dest="bias_swiglu_fusion",
        help="Disable the fused bias+SwiGLU kernel.",
    )
    g.add_argument(
        "--no-bias-dropout-fusion",
        action="store_false",
        dest="bias_dropout_fusion",
        help="Disable the fused bias+dropout kernel.",
    )
    g.add_argument(
        "--no-rope-fusion",
        action="store_false",
        dest="apply_rope_fusion",
        help="Disable the fused RoPE kernel.",
    )
    g.add_argument(
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        help="Disable fusing gradient accumulation into the weight-gradient GEMM.",
    )
    g.add_argument(
        "--no-persist-layer-norm",
        action="store_true",
        help="Disable the persistent fused layer-norm kernel.",
    )
    g.add_argument(
        "--moe-permute-fusion",
        action="store_true",
        help="Fuse the MoE token permutation (Transformer Engine).",
    )
