# meta-llama/Llama-3.1-70B-Instruct (Hugging Face Hub); values from its config.json:
# 80 layers, hidden 8192, FFN 28672, 64 heads / 8 KV heads (head dim 8192 / 64 = 128),
# rope_theta 500000, rms_norm_eps 1e-5, vocab 128256, untied embeddings, no bias,
# max_position_embeddings 131072. RoPE scaling: rope_scaling {rope_type: llama3, factor 8.0,
# low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192}, which is
# Megatron-LM's --use-rope-scaling (with --rope-scaling-factor 8). Llama-3.3-70B-Instruct has the same
# shape and RoPE settings.
# On GPUs add e.g. --transformer-impl transformer_engine, --tensor-model-parallel-size 8 with
# --sequence-parallel, and pipeline parallelism across nodes.
MODEL_ARGS=(
   --swiglu
   --num-layers 80
   --hidden-size 8192
   --ffn-hidden-size 28672
   --num-attention-heads 64
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-base 500000
   --use-rope-scaling
   --rope-scaling-factor 8.0
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 128256
   --untie-embeddings-and-output-weights
   --max-position-embeddings 131072
)
