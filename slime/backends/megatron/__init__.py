"""The trainer backend: a megatron-core model built from an HF checkpoint, its inputs, steps, checkpoints."""

from slime.utils.device import import_megatron_core

import_megatron_core()  # first: on the CPU, megatron-core's torch.compile'd helpers stay plain functions
