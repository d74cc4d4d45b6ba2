"""slime: RL post-training of LLMs, a Megatron-core trainer and SGLang-protocol engines under Ray."""
