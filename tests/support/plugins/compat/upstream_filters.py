"""A dynamic-sampling filter and a buffer filter as upstream slime's users write them."""

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from slime.utils.types import Sample
from tests.support.plugins.compat import log_call


def nonzero_std_logged(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """upstream's ``check_reward_nonzero_std``, each verdict logged (``log_call``)."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    log_call(args, {"plugin": "filter", "keep": bool(output.keep)})
    return output


def pop_last(args, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """The guide's buffer filter form: serve the most recently returned groups first, popping them."""
    num = min(len(buffer), num_samples)
    samples = buffer[len(buffer) - num :]
    del buffer[len(buffer) - num :]
    return samples


def pop_first_with_rollout_id(
    args, rollout_id, buffer: list[list[Sample]], num_samples: int
) -> list[list[Sample]]:
    """Upstream slime's current buffer filter form (its ``pop_first``): ``rollout_id`` comes first."""
    assert rollout_id is None  # upstream's data source passes None
    num = min(len(buffer), num_samples)
    samples = buffer[:num]
    del buffer[:num]
    return samples
