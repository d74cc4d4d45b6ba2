"""The trainer backend: a megatron-core model built from an HF checkpoint, its inputs, steps, checkpoints."""
