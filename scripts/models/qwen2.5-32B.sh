# Qwen/Qwen2.5-32B-Instruct (Hugging Face Hub); values from its config.json:
# 64 layers, hidden 5120, FFN 27648, 40 heads / 8 KV heads (head dim 5120 / 40 = 128), rope_theta 1e6,
# rms_norm_eps 1e-6, vocab 152064, untied embeddings, q/k/v bias (Qwen2 always has it), no other bias,
# max_position_embeddings 32768 (sliding window off: use_sliding_window false). The base checkpoint
# Qwen/Qwen2.5-32B differs: rms_norm_eps 1e-5 and 131072 positions.
# On GPUs add e.g. --transformer-impl transformer_engine and --tensor-model-parallel-size 8.
MODEL_ARGS=(
   --swiglu
   --num-layers 64
   --hidden-size 5120
   --ffn-hidden-size 27648
   --num-attention-heads 40
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-base 1000000
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 152064
   --max-position-embeddings 32768
)
