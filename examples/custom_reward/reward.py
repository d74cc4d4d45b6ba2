"""A custom reward for the CPU quickstart's task (sort 4-6 digits; the label is the sorted digits).

``--rm-type exact`` gives 1.0 or 0.0. This reward also gives partial credit: the share of positions
where the response has the label's digit. Why: GRPO learns from the differences between the rewards
of one prompt's samples, and a group whose samples all miss the exact answer scores 0.0 everywhere
under exact match, so it teaches nothing; with partial credit ``1358`` beats ``9999`` and the group
still has a direction. Dividing by the longer of the two strings keeps a padded or cut answer from
scoring as well as the right one.

Use it with ``--custom-rm-path examples/custom_reward/reward.py:partial_sort_reward`` instead of
``--rm-type`` (``examples/custom_reward/run.sh`` does).
"""

from __future__ import annotations

import argparse

from slime.rollout.sample import Sample


def partial_sort_reward(args: argparse.Namespace, sample: Sample) -> float:
    """1.0 for the exact sorted digits, else the fraction of positions that match the label.

    ``args`` is the run's namespace (unused here); ``sample.response`` is the decoded response and
    ``sample.label`` the data's ``--label-key`` field. A sample without a label raises: slime then
    marks that sample failed and scores it 0.0 (see docs/guides/rewards.md).
    """
    if sample.label is None:
        raise ValueError("no label; pass --label-key label")
    answer, label = sample.response.strip(), sample.label.strip()
    if answer == label:
        return 1.0
    matches = sum(a == b for a, b in zip(answer, label, strict=False))
    return matches / max(len(answer), len(label))
