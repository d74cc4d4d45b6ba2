"""A ``--rollout-function-path`` in upstream slime's form: ``generate_rollout(args, rollout_id,
data_source, evaluation=False)`` returning ``RolloutFnTrainOutput``, built from upstream's default
``generate`` and ``batched_async_rm``, drawing one group more than it trains on and handing it back to
the data buffer (``add_samples``), which serves it first next time (``get_samples``)."""

import asyncio

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.rm_hub import batched_async_rm
from slime.rollout.sglang_rollout import GenerateState, generate
from slime.utils.async_utils import run
from slime.utils.types import Sample
from tests.support.plugins.compat import log_call


async def _generate_group(args, group: list[Sample]) -> list[Sample]:
    state = GenerateState(args)
    async with state.semaphore:
        group = list(await asyncio.gather(*(generate(args, s, state.sampling_params.copy()) for s in group)))
    for sample, reward in zip(group, await batched_async_rm(args, group), strict=True):
        sample.reward = reward
    return group


async def _generate_all(args, groups: list[list[Sample]]) -> list[list[Sample]]:
    return list(await asyncio.gather(*(_generate_group(args, g) for g in groups)))


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """Trains on ``--rollout-batch-size`` groups; the extra one goes back to the buffer untouched."""
    if evaluation:
        return RolloutFnEvalOutput(data={})
    groups = data_source.get_samples(args.rollout_batch_size + 1)
    spare = groups.pop()
    groups = run(_generate_all(args, groups))
    data_source.add_samples([spare])
    log_call(
        args,
        {
            "plugin": "rollout",
            "rollout_id": rollout_id,
            "first_group": groups[0][0].group_index,
            "spare": spare[0].group_index,
            "buffered": data_source.get_buffer_length(),
            "statuses": sorted({s.status.value for g in groups for s in g}),
        },
    )
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/compat_groups": len(groups)})
