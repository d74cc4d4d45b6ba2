# moonshotai/Moonlight-16B-A3B (Hugging Face Hub, model_type deepseek_v3, 16B total / 3B active); values
# from its config.json: 27 layers, hidden 2048, 16 heads, multi-head latent attention (MLA) without a
# query LoRA (q_lora_rank null: queries are projected directly), kv_lora_rank 512, qk_nope_head_dim 128 +
# qk_rope_head_dim 64, v_head_dim 128; RMSNorm on the kv latent (--qk-layernorm under MLA),
# rms_norm_eps 1e-5, vocab 163840, untied embeddings, no bias. RoPE: rope_theta 50000, no rope_scaling
# (plain RoPE), max_position_embeddings 8192.
# MoE: layer 0 dense (first_k_dense_replace 1, FFN 11264), layers 1-26 sparse: 64 routed experts of
# moe_intermediate_size 1408, 6 per token, plus 2 shared experts (n_shared_experts 2: one MLP of
# 2 x 1408 = 2816); sigmoid scores with a per-expert correction bias (noaux_tc), n_group 1 / topk_group
# 1, top-k weights renormalised (norm_topk_prob true) and scaled by routed_scaling_factor 2.446.
# On GPUs add e.g. --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion
# --moe-token-dispatcher-type alltoall and --expert-model-parallel-size 8.
MODEL_ARGS=(
   --swiglu
   --num-layers 27
   --hidden-size 2048
   --ffn-hidden-size 11264
   --num-attention-heads 16
   --kv-channels 128
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --untie-embeddings-and-output-weights
   --vocab-size 163840
   --max-position-embeddings 8192

   # multi-latent attention (no --q-lora-rank: q_lora_rank is null)
   --multi-latent-attention
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --use-rotary-position-embeddings
   --rotary-base 50000
   --rope-type rope

   # moe
   --num-experts 64
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 2816
   --moe-router-topk 6
   --moe-layer-freq "([0]*1+[1]*26)"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --moe-router-topk-scaling-factor 2.446
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
)
