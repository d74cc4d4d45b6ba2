# Tiny Qwen2.5-VL made locally by tools/make_tiny_model.py (python tools/make_tiny_model.py --out DIR
# --arch qwen2_5_vl): the language model of tiny-qwen2.sh (2 layers, hidden 128, 4 heads / 2 KV groups,
# FFN 512, tied embeddings) with multimodal RoPE (4/6/6 rotary pairs for time/height/width) over a
# vocabulary of 103 tokens (the vision tokens included) padded to 112. The vision tower (2 blocks of 64)
# and the image token id are read from the checkpoint. Keep in sync with the maker's defaults.
MODEL_ARGS=(
   --swiglu
   --num-layers 2
   --hidden-size 128
   --ffn-hidden-size 512
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --position-embedding-type mrope
   --mrope-section 4 6 6
   --rotary-base 10000
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --vocab-size 112
   --max-position-embeddings 512
)
