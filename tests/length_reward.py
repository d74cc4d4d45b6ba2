"""A reward that varies with every response (its length), for e2e tests whose tiny random policy never
earns an exact-match reward: the critic then has non-zero returns to learn."""

from __future__ import annotations

import argparse

from slime.rollout.sample import Sample


def response_length_reward(args: argparse.Namespace, sample: Sample) -> float:
    return len(sample.response) / 6.0
