"""Which trainer ranks take part when weights leave the trainer (pushes to engines, HF exports).

A pipeline stage's full HF tensors are gathered over its tensor-parallel ranks (and, for experts,
over the expert-parallel group), then one rank per stage sends or writes them.
"""

from __future__ import annotations

from megatron.core import parallel_state as mpu


def walks_hf_weights() -> bool:
    """Whether this rank takes part when its pipeline stage walks its full HF weights: the first
    data- and context-parallel replica (its tensor-parallel ranks gather the shards), or every rank
    under expert parallelism (the expert gathers span data-parallel ranks)."""
    return mpu.get_expert_model_parallel_world_size() > 1 or _first_replica()


def is_stage_leader() -> bool:
    """The one rank per pipeline stage that sends or writes the stage's weights: data-, context- and
    tensor-parallel rank 0 (also under expert parallelism, where every replica walks the weights)."""
    return _first_replica() and mpu.get_tensor_model_parallel_rank() == 0


def _first_replica() -> bool:
    return mpu.get_data_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
