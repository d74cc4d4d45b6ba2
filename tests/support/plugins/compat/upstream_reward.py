"""Reward functions in upstream slime's form: ``async def reward_func(args, sample, **kwargs)`` and the
batched form ``batched_reward(args, samples, **kwargs) -> list``."""

from slime.utils.types import Sample


async def reward_func(args, sample: Sample, **kwargs) -> float:
    """Alternates by sample index, so every group of two has rewards that vary (the filter keeps it)."""
    return float(sample.index % 2)


async def batched_reward(args, samples: list[Sample], **kwargs) -> list[float]:
    """The batched form ``batched_async_rm`` calls once with the whole list."""
    return [float(sample.index % 2) for sample in samples]
