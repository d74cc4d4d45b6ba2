"""argparse ``type=`` callables shared by the flag families.

A count, size or interval that must be positive (or at least 0) says so where the flag is declared:
argparse then refuses a bad value while parsing, in the one-line ``error: <flag>: ...`` form, before
validation and before anything starts.
"""

from __future__ import annotations

import argparse
from typing import TypeVar

_N = TypeVar("_N", int, float)


def positive_int(text: str) -> int:
    """A count or size: an integer >= 1."""
    value = _number(int, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}; pass a value >= 1")
    return value


def positive_float(text: str) -> float:
    """A duration or other quantity that must be above zero."""
    value = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}; pass a value > 0")
    return value


def non_negative_int(text: str) -> int:
    """A count where 0 means none (or a limit where 0 means no limit)."""
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}; pass a value >= 0")
    return value


def non_negative_float(text: str) -> float:
    """A duration where 0 means no limit."""
    value = _number(float, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}; pass a value >= 0")
    return value


def _number(kind: type[_N], text: str) -> _N:
    # argparse's own words for a plain ``type=int`` / ``type=float`` that does not parse.
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
