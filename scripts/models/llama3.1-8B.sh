# meta-llama/Llama-3.1-8B (Hugging Face Hub); values from its config.json:
# 32 layers, hidden 4096, FFN 14336, 32 heads / 8 KV heads (head dim 4096 / 32 = 128),
# rope_theta 500000, rms_norm_eps 1e-5, vocab 128256, untied embeddings, no bias,
# max_position_embeddings 131072.
# RoPE scaling: config.json has rope_scaling {rope_type: llama3, factor 8.0, low_freq_factor 1.0,
# high_freq_factor 4.0, original_max_position_embeddings 8192}. --use-rope-scaling is Megatron-LM's
# flag name for exactly that scheme (megatron-core RotaryEmbedding(rope_scaling=True), whose defaults
# are factor 8, 1, 4, 8192); the RoPE base stays --rotary-base 500000.
MODEL_ARGS=(
   --swiglu
   --num-layers 32
   --hidden-size 4096
   --ffn-hidden-size 14336
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-base 500000
   --use-rope-scaling
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 128256
   --untie-embeddings-and-output-weights
   --max-position-embeddings 131072
)
