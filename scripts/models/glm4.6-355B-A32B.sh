# zai-org/GLM-4.6 (Hugging Face Hub, model_type glm4_moe, 355B total / 32B active). Values from its
# config.json, which has GLM-4.5's architecture (glm4.5-355B-A32B.sh) with a longer context:
# 92 layers, hidden 5120, 96 heads / 8 KV heads, head_dim 128, rope_theta 1e6 with partial_rotary_factor
# 0.5 (non-interleaved), rms_norm_eps 1e-5, vocab 151552, untied embeddings, q/k/v bias, q/k RMSNorm,
# max_position_embeddings 202752 (GLM-4.5: 131072). MoE: 3 dense layers (FFN 12288), then 160 routed
# experts of 1536, 8 per token, 1 shared expert of 1536, sigmoid scores with a correction bias,
# n_group 1 / topk_group 1, norm_topk_prob true, routed_scaling_factor 2.5; 1 MTP layer (not trained here).
# Cross-checked against public converter fixtures that quote this config (92 layers, 160 experts,
# 202752 positions); upstream THUDM/slime trains GLM-4.6 with its glm4.5-355B-A32B.sh.
# On GPUs add e.g. --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion
# --moe-token-dispatcher-type alltoall, --expert-model-parallel-size 8 or 16 and pipeline parallelism.

source "$(dirname "${BASH_SOURCE[0]}")/glm4.5-355B-A32B.sh"
MODEL_ARGS+=(--max-position-embeddings 202752)  # GLM-4.5's shape, a longer context
