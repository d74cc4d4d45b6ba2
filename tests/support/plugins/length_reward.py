"""A reward that varies with every response (its length), for e2e tests whose tiny random policy never
earns an exact-match reward: the critic then has non-zero returns to learn."""

from __future__ import annotations

import argparse

from slime.rollout.sample import Sample


def response_length_reward(args: argparse.Namespace, sample: Sample) -> float:
    return len(sample.response) / 6.0


def first_character_reward(args: argparse.Namespace, sample: Sample) -> float:
    """0, 0.25, ..., 1 by the response's first character: differs within almost every group, even when
    every response runs to the length limit."""
    return (ord(sample.response[0]) % 5) / 4 if sample.response else 0.0
