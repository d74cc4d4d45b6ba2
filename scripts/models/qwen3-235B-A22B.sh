# Qwen/Qwen3-235B-A22B (Hugging Face Hub); values from its config.json:
# 94 layers, hidden 4096, 64 heads / 4 KV heads, head_dim 128 (explicit: 64 x 128 != 4096),
# rope_theta 1e6, rms_norm_eps 1e-6, vocab 151936, untied embeddings, no attention bias, q/k RMSNorm,
# max_position_embeddings 40960; every layer sparse (decoder_sparse_step 1, mlp_only_layers []):
# 128 experts of moe_intermediate_size 1536, 8 per token, norm_topk_prob true (Megatron's default
# softmax over the top-k logits), no shared expert. intermediate_size 12288 is unused by the MoE layers.
# On GPUs add e.g. --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion
# --moe-token-dispatcher-type alltoall, --expert-model-parallel-size 8 or 16 and pipeline parallelism.
MODEL_ARGS=(
   --swiglu
   --num-layers 94
   --hidden-size 4096
   --ffn-hidden-size 12288
   --num-attention-heads 64
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
   --moe-ffn-hidden-size 1536
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-layer-freq 1
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
)
