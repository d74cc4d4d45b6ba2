"""A dynamic-sampling filter and a buffer filter as upstream slime's users write them."""

import json
import os

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from slime.utils.types import Sample


def nonzero_std_logged(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """upstream's ``check_reward_nonzero_std``, each verdict logged to ``$COMPAT_LOG``."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    if log := os.environ.get("COMPAT_LOG"):
        with open(log, "a") as f:
            f.write(json.dumps({"plugin": "filter", "keep": bool(output.keep)}) + "\n")
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
