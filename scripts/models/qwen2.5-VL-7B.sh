# Qwen/Qwen2.5-VL-7B-Instruct (Hugging Face Hub); values from its config.json (as first published, flat,
# with transformers 4's rope_scaling {"type": "mrope", "mrope_section": [16, 24, 24]}):
# the language model is Qwen2.5-7B's shape: 28 layers, hidden 3584, FFN 18944, 28 heads / 4 KV heads
# (head dim 128), rope_theta 1e6 as multimodal RoPE over (time, height, width) sections of 16/24/24
# rotary pairs, rms_norm_eps 1e-6, vocab 152064, untied embeddings, q/k/v bias, no other bias,
# max_position_embeddings 128000. The vision tower (vision_config: 32 blocks of 1280, windowed attention
# but in blocks 7/15/23/31, 2x2 patch merger into 3584) and image_token_id 151655 are read from
# --hf-checkpoint by the trainer; add --freeze-vision-tower to train the language model only.
# Pipeline parallelism is not supported for it yet; on GPUs add e.g. --transformer-impl
# transformer_engine and --tensor-model-parallel-size 2.
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 3584
   --ffn-hidden-size 18944
   --num-attention-heads 28
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --position-embedding-type mrope
   --mrope-section 16 24 24
   --rotary-base 1000000
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 152064
   --max-position-embeddings 128000
)
