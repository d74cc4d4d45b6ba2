"""A rollout's samples cut into optimizer steps and data-parallel shards.

Loss weights are computed per global batch (one optimizer step) before the cut, so that a step's
loss and gradient do not depend on how many data-parallel ranks or micro-batches share it.
"""

from __future__ import annotations

from slime.algorithms.aggregation import loss_weights
from slime.backends.megatron.batching import SAMPLE_KEYS, TrainData, check_train_data


def step_shard(
    data: TrainData, step: int, num_steps: int, dp_rank: int, dp_size: int, aggregation: str = "token_mean"
) -> TrainData:
    """The samples data-parallel rank ``dp_rank`` trains on in optimizer step ``step`` of a rollout.

    Step ``s`` takes the ``s``-th contiguous global batch; within it rank ``r`` takes the ``r``-th
    contiguous slice.
    """
    total = check_train_data(data, SAMPLE_KEYS)
    if total % (num_steps * dp_size):
        raise ValueError(f"{total} samples do not split into {num_steps} steps × {dp_size} DP ranks")
    per_step = total // num_steps
    per_rank = per_step // dp_size
    step_slice = slice(step * per_step, (step + 1) * per_step)
    weights = loss_weights(data["loss_masks"][step_slice], aggregation)
    begin = step * per_step + dp_rank * per_rank
    shard = {key: values[begin : begin + per_rank] for key, values in data.items()}
    shard["loss_weights"] = weights[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return shard
