# zai-org/GLM-Z1-9B-0414 (Hugging Face Hub, model_type glm4): the reasoning model trained from
# GLM-4-9B-0414, with the same config.json shape (glm4-9B.sh); upstream THUDM/slime's quick start trains
# it with its glm4-9B.sh. Values from its config.json: 40 layers, hidden 4096, FFN 13696, 32 heads / 2 KV
# heads, head_dim 128, rope_theta 10000 with partial_rotary_factor 0.5 (interleaved pairs), rms_norm_eps
# 1e-5, vocab 151552, untied embeddings, q/k/v bias, max_position_embeddings 32768, sandwich norms
# (post_self_attn_layernorm, post_mlp_layernorm).
# On GPUs add e.g. --transformer-impl transformer_engine and --tensor-model-parallel-size 2.

source "$(dirname "${BASH_SOURCE[0]}")/glm4-9B.sh"
