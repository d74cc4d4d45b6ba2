# Tiny GLM-4 made locally by tools/make_tiny_model.py
# (python tools/make_tiny_model.py --out DIR --arch glm4): 2 layers, hidden 128, 4 heads / 2 KV groups
# of dim 32, q/k/v bias, RoPE on half of each head (partial_rotary_factor 0.5) in interleaved pairs,
# norms of the attention and MLP outputs, tied embeddings, vocabulary padded to 112.
# Keep in sync with the maker's defaults; tests/e2e/test_glm4.py checks it against config.json.
MODEL_ARGS=(
   --swiglu
   --num-layers 2
   --hidden-size 128
   --ffn-hidden-size 512
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --use-rotary-position-embeddings
   --rotary-base 10000
   --rotary-percent 0.5
   --rotary-interleaved
   --disable-bias-linear
   --add-qkv-bias
   --post-self-attn-layernorm
   --post-mlp-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 112
   --max-position-embeddings 512
)
