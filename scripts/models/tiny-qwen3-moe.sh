# Tiny Qwen3-MoE made locally by tools/make_tiny_model.py
# (python tools/make_tiny_model.py --out DIR --arch qwen3_moe --untie-embeddings): 2 layers, hidden 128,
# 4 heads / 2 KV groups of dim 32, q/k RMSNorm, untied embeddings, vocabulary padded to 112;
# every layer an MoE layer: 4 experts of FFN 64, top-2 routing renormalised (norm_topk_prob true).
# Keep in sync with the maker's defaults; tests/e2e/test_moe.py checks it against config.json.
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
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 112
   --max-position-embeddings 512

   # moe
   --num-experts 4
   --moe-ffn-hidden-size 64
   --moe-router-topk 2
   --moe-router-score-function softmax
   --moe-layer-freq 1
   --moe-aux-loss-coeff 0
)
