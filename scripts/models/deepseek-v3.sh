# deepseek-ai/DeepSeek-V3 (Hugging Face Hub, model_type deepseek_v3, 671B total / 37B active); values
# from its config.json: 61 layers, hidden 7168, 128 heads, multi-head latent attention (MLA):
# q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128 + qk_rope_head_dim 64 per query/key head,
# v_head_dim 128; RMSNorm on the q and kv latents (--qk-layernorm is Megatron's switch for them under
# MLA), rms_norm_eps 1e-6, vocab 129280, untied embeddings, no bias. RoPE: rope_theta 10000 with YaRN
# (rope_scaling type yarn: factor 40, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1,
# mscale 1.0, mscale_all_dim 1.0), max_position_embeddings 163840.
# MoE: layers 0-2 dense (first_k_dense_replace 3, FFN 18432), layers 3-60 sparse: 256 routed experts of
# moe_intermediate_size 2048, 8 per token, plus 1 shared expert of 2048; sigmoid scores with a
# per-expert correction bias (topk_method noaux_tc), grouped routing over n_group 8 keeping topk_group 4,
# top-k weights renormalised (norm_topk_prob true) and scaled by routed_scaling_factor 2.5.
# config.json also has 1 MTP layer (num_nextn_predict_layers 1), not part of the trained model here;
# the published weights are FP8 (quantization_config), convert them to BF16 first.
# On GPUs add e.g. --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion
# --moe-token-dispatcher-type alltoall, --expert-model-parallel-size 32 or 64 and pipeline parallelism
# (128+ H100/H200 GPUs).
MODEL_ARGS=(
   --swiglu
   --num-layers 61
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 128
   --kv-channels 128
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --untie-embeddings-and-output-weights
   --vocab-size 129280
   --max-position-embeddings 163840

   # multi-latent attention
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --use-rotary-position-embeddings
   --rotary-base 10000
   --rope-type yarn
   --rotary-scaling-factor 40
   --original-max-position-embeddings 4096
   --beta-fast 32
   --beta-slow 1
   --mscale 1.0
   --mscale-all-dim 1.0

   # moe
   --num-experts 256
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-layer-freq "([0]*3+[1]*58)"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-num-groups 8
   --moe-router-group-topk 4
   --moe-router-topk-scaling-factor 2.5
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
)
