# Qwen/Qwen3-30B-A3B (Hugging Face Hub); values from its config.json:
# 48 layers, hidden 2048, 32 heads / 4 KV heads, head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6,
# vocab 151936, untied embeddings, no attention bias, q/k RMSNorm, max_position_embeddings 40960;
# every layer sparse (decoder_sparse_step 1, mlp_only_layers []): 128 experts of moe_intermediate_size
# 768, 8 per token, norm_topk_prob true (Megatron's default softmax over the top-k logits), no shared
# expert. intermediate_size 6144 is unused by the MoE layers. On GPUs add e.g.
# --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion --moe-token-dispatcher-type
# alltoall and --expert-model-parallel-size 8.
MODEL_ARGS=(
   --swiglu
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 151936
   --max-position-embeddings 40960

   # moe
   --num-experts 128
   --moe-ffn-hidden-size 768
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-layer-freq 1
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
)
