# Qwen/Qwen2.5-0.5B (Hugging Face Hub); values from its config.json:
# 24 layers, hidden 896, FFN 4864, 14 heads / 2 KV heads (head dim 896 / 14 = 64), rope_theta 1e6,
# rms_norm_eps 1e-6, vocab 151936, tied embeddings, q/k/v bias, max_position_embeddings 32768.
MODEL_ARGS=(
   --swiglu
   --num-layers 24
   --hidden-size 896
   --ffn-hidden-size 4864
   --num-attention-heads 14
   --group-query-attention
   --num-query-groups 2
   --kv-channels 64
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 151936
   --max-position-embeddings 32768
)
