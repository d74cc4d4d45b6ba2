# Qwen/Qwen3-0.6B (Hugging Face Hub); values from its config.json:
# 28 layers, hidden 1024, FFN 3072, 16 heads / 8 KV heads, head_dim 128 (explicit: 16 x 128 != 1024),
# rope_theta 1e6, rms_norm_eps 1e-6, vocab 151936, tied embeddings, no attention bias, q/k RMSNorm,
# max_position_embeddings 40960.
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 1024
   --ffn-hidden-size 3072
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 151936
   --max-position-embeddings 40960
)
