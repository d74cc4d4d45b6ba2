# zai-org/GLM-4.5-Air (Hugging Face Hub, model_type glm4_moe); values from its config.json:
# 46 layers, hidden 4096, 96 heads / 8 KV heads, head_dim 128 (explicit: 96 x 128 != 4096),
# rope_theta 1e6 with partial_rotary_factor 0.5 (non-interleaved halves, as NeoX), rms_norm_eps 1e-5,
# vocab 151552, untied embeddings, q/k/v bias (attention_bias true), no q/k norm (use_qk_norm false),
# max_position_embeddings 131072. MoE: layer 0 dense (first_k_dense_replace 1, FFN 10944), layers 1-45
# sparse: 128 routed experts of moe_intermediate_size 1408, 8 per token, plus 1 shared expert of 1408;
# sigmoid scores with a per-expert correction bias (e_score_correction_bias, noaux_tc), n_group 1 /
# topk_group 1, top-k weights renormalised (norm_topk_prob true), routed_scaling_factor 1.0.
# config.json also has 1 MTP layer (num_nextn_predict_layers 1), not part of the trained model here.
# On GPUs add e.g. --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion
# --moe-token-dispatcher-type alltoall and --expert-model-parallel-size 8.
MODEL_ARGS=(
   --swiglu
   --num-layers 46
   --hidden-size 4096
   --ffn-hidden-size 10944
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --rotary-percent 0.5
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --untie-embeddings-and-output-weights
   --vocab-size 151552
   --max-position-embeddings 131072

   # moe
   --num-experts 128
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 1408
   --moe-router-topk 8
   --moe-layer-freq "([0]*1+[1]*45)"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --moe-router-topk-scaling-factor 1.0
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
)
