# meta-llama/Meta-Llama-3-8B (Hugging Face Hub); values from its config.json: 32 layers, hidden 4096,
# FFN 14336, 32 heads / 8 KV heads (head dim 128), rope_theta 500000 with no rope_scaling (Llama 3.1's
# llama3 scaling came later: llama3.1-8B.sh), rms_norm_eps 1e-5, vocab 128256, untied embeddings, no
# bias, max_position_embeddings 8192.
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
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 128256
   --untie-embeddings-and-output-weights
   --max-position-embeddings 8192
)
