# moonshotai/Kimi-K2-Instruct (Hugging Face Hub, model_type kimi_k2: the DeepSeek-V3 architecture,
# 1T total / 32B active); values from its config.json: 61 layers, hidden 7168, 64 heads, multi-head
# latent attention (MLA): q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128 + qk_rope_head_dim
# 64, v_head_dim 128; RMSNorm on the q and kv latents (--qk-layernorm under MLA), rms_norm_eps 1e-6,
# vocab 163840, untied embeddings, no bias. RoPE: rope_theta 50000 with YaRN (factor 32,
# original_max_position_embeddings 4096, beta_fast 1, beta_slow 1, mscale 1.0, mscale_all_dim 1.0),
# max_position_embeddings 131072. (Kimi-K2-Instruct-0905 differs: factor 64, 262144 positions.)
# MoE: layer 0 dense (first_k_dense_replace 1, FFN 18432), layers 1-60 sparse: 384 routed experts of
# moe_intermediate_size 2048, 8 per token, plus 1 shared expert of 2048; sigmoid scores with a
# per-expert correction bias (noaux_tc), n_group 1 / topk_group 1, top-k weights renormalised
# (norm_topk_prob true) and scaled by routed_scaling_factor 2.827. No MTP layer. The published weights
# are FP8 (quantization_config), convert them to BF16 first.
# On GPUs add e.g. --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion
# --moe-token-dispatcher-type alltoall, --expert-model-parallel-size 32 or more and pipeline parallelism.
MODEL_ARGS=(
   --swiglu
   --num-layers 61
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 64
   --kv-channels 128
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 163840
   --max-position-embeddings 131072

   # multi-latent attention
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --use-rotary-position-embeddings
   --rotary-base 50000
   --rope-type yarn
   --rotary-scaling-factor 32
   --original-max-position-embeddings 4096
   --beta-fast 1
   --beta-slow 1
   --mscale 1.0
   --mscale-all-dim 1.0

   # moe
   --num-experts 384
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-layer-freq "([0]*1+[1]*60)"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --moe-router-topk-scaling-factor 2.827
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
)
