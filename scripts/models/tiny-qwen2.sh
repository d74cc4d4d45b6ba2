# Tiny Qwen2 made locally by tools/make_tiny_model.py with its default settings
# (python tools/make_tiny_model.py --out DIR): 2 layers, hidden 128, 4 heads / 2 KV groups, FFN 512,
# tied embeddings, character-level vocabulary of 99 tokens padded to 112 in config.json.
# Keep in sync with the maker's defaults; tests/unit/test_tiny_model.py checks it against config.json.
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
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 112
   --max-position-embeddings 512
)
