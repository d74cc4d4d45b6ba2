# Qwen/Qwen3-4B (Hugging Face Hub); values from its config.json:
# 36 layers, hidden 2560, FFN 9728, 32 heads / 8 KV heads, head_dim 128 (explicit: 32 x 128 != 2560),
# rope_theta 1e6, rms_norm_eps 1e-6, vocab 151936, tied embeddings, no attention bias, q/k RMSNorm,
# max_position_embeddings 40960. (Qwen3-4B-Instruct-2507 differs: rope_theta 5e6, 262144 positions.)
MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2560
   --ffn-hidden-size 9728
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
   --max-position-embeddings 40960
)
