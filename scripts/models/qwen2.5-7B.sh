# Qwen/Qwen2.5-7B-Instruct (Hugging Face Hub); values from its config.json:
# 28 layers, hidden 3584, FFN 18944, 28 heads / 4 KV heads (head dim 3584 / 28 = 128), rope_theta 1e6,
# rms_norm_eps 1e-6, vocab 152064, untied embeddings, q/k/v bias (Qwen2 always has it), no other bias,
# max_position_embeddings 32768 (sliding window off: use_sliding_window false).
# On GPUs add e.g. --transformer-impl transformer_engine and --tensor-model-parallel-size 2.
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 3584
   --ffn-hidden-size 18944
   --num-attention-heads 28
   --group-query-attention
   --num-query-groups 4
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
