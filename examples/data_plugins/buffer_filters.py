"""A ``--buffer-filter-path`` plugin: which returned groups a rollout serves first.

Groups come back to the data source when a rollout does not finish them (over-sampling, aborts);
under ``--partial-rollout`` their samples keep what they generated. ``most_progress_first`` serves the
groups that generated the most tokens first: they need the fewest tokens to finish and hold the most
tokens sampled by older weights, so finishing them early wastes least and keeps staleness low.

    python train.py ... --partial-rollout --over-sampling-batch-size 24 \\
        --dynamic-sampling-filter-path slime.rollout.filters.keep_varied_rewards \\
        --buffer-filter-path examples/data_plugins/buffer_filters.py:most_progress_first

The contract: ``fn(args, buffer, num_groups) -> groups``, at most ``num_groups`` groups taken from
``buffer`` (a copy: the data source removes what is returned).
"""

from __future__ import annotations

import argparse

from slime.rollout.sample import Sample


def most_progress_first(
    args: argparse.Namespace, buffer: list[list[Sample]], num_groups: int
) -> list[list[Sample]]:
    """The ``num_groups`` groups with the most generated tokens; among equals, the oldest first."""
    ranked = sorted(buffer, key=lambda group: -sum(sample.response_length for sample in group))  # stable
    return ranked[:num_groups]
