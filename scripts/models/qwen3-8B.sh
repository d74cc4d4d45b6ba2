# Qwen/Qwen3-8B (Hugging Face Hub); values from its config.json:
# 36 layers, hidden 4096, FFN 12288, 32 heads / 8 KV heads, head_dim 128, rope_theta 1e6,
# rms_norm_eps 1e-6, vocab 151936, untied embeddings (tie_word_embeddings false), no attention bias,
# q/k RMSNorm, max_position_embeddings 40960.
MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 4096
   --ffn-hidden-size 12288
   --num-attention-heads 32
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
   --untie-embeddings-and-output-weights
   --max-position-embeddings 40960
)
