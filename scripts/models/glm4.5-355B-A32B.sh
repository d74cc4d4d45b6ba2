# zai-org/GLM-4.5 (Hugging Face Hub, model_type glm4_moe); values from its config.json:
# 92 layers, hidden 5120, 96 heads / 8 KV heads, head_dim 128 (explicit: 96 x 128 != 5120),
# rope_theta 1e6 with partial_rotary_factor 0.5 (non-interleaved halves, as NeoX), rms_norm_eps 1e-5,
# vocab 151552, untied embeddings, q/k/v bias (attention_bias true), q/k RMSNorm (use_qk_norm true),
# max_position_embeddings 131072. MoE: layers 0-2 dense (first_k_dense_replace 3, FFN 12288), layers
# 3-91 sparse: 160 routed experts of moe_intermediate_size 1536, 8 per token, plus 1 shared expert of
# 1536; sigmoid scores with a per-expert correction bias (noaux_tc), n_group 1 / topk_group 1, top-k
# weights renormalised (norm_topk_prob true) and scaled by routed_scaling_factor 2.5.
# config.json also has 1 MTP layer (num_nextn_predict_layers 1), not part of the trained model here.
# On GPUs add e.g. --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion
# --moe-token-dispatcher-type alltoall, --expert-model-parallel-size 8 or 16 and pipeline parallelism.
MODEL_ARGS=(
   --swiglu
   --num-layers 92
   --hidden-size 5120
   --ffn-hidden-size 12288
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --rotary-percent 0.5
   --disable-bias-linear
   --add-qkv-bias
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --untie-embeddings-and-output-weights
   --vocab-size 151552
   --max-position-embeddings 131072

   # moe
   --num-experts 160
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 8
   --moe-layer-freq "([0]*3+[1]*89)"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --moe-router-topk-scaling-factor 2.5
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
)
