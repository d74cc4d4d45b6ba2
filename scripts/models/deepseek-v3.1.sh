# deepseek-ai/DeepSeek-V3.1 (Hugging Face Hub, model_type deepseek_v3, 671B total / 37B active): a
# post-trained DeepSeek-V3 (hybrid thinking); its config.json has DeepSeek-V3's shape (deepseek-v3.sh).
# Values from that config.json: 61 layers, hidden 7168, 128 heads, MLA with q_lora_rank 1536,
# kv_lora_rank 512, qk_nope_head_dim 128 + qk_rope_head_dim 64, v_head_dim 128, rms_norm_eps 1e-6, vocab
# 129280, untied embeddings, no bias; rope_theta 10000 with YaRN (factor 40, original 4096, beta_fast 32,
# beta_slow 1, mscale 1.0, mscale_all_dim 1.0), max_position_embeddings 163840. MoE: 3 dense layers (FFN
# 18432), then 256 routed experts of 2048, 8 per token, 1 shared expert of 2048, sigmoid scores with a
# correction bias (noaux_tc), n_group 8 / topk_group 4, norm_topk_prob true, routed_scaling_factor 2.5;
# 1 MTP layer (not trained here). The published weights are FP8: convert them to BF16 first.
# On GPUs add e.g. --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion
# --moe-token-dispatcher-type alltoall, --expert-model-parallel-size 32 or 64 and pipeline parallelism.

source "$(dirname "${BASH_SOURCE[0]}")/deepseek-v3.sh"
