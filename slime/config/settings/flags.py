"""Settings read from the flags: most fields are named as their flag's dest."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def read_flags(cls: type[T], args: argparse.Namespace, **settled: Any) -> T:
    """``cls`` with each field read from the flag of the same dest; ``settled`` gives the fields that are
    named otherwise or derived, so a settings class lists only what differs from its flags."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in settled]  # type: ignore[arg-type]
    return cls(**{name: getattr(args, name) for name in names}, **settled)
