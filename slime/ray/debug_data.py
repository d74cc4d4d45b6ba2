"""A rollout's train data on disk: ``--save-debug-rollout-data`` writes it, ``--load-debug-rollout-data``
trains on it again.

The file holds one dict: the train data's per-sample lists and, under ``"metrics"`` (``METRICS_KEY``),
the rollout's metrics.

The reader uses ``torch.load(weights_only=True)``, which rebuilds tensors and plain Python values only
and never calls what a pickle names: a dump handed over from another machine cannot run code on the
driver. So the writer stores nothing else. The train data is per-sample lists of numbers and strings,
but two parts come from plugins: ``raw_rewards`` (a reward function may return a dict of anything) and
the metrics (a rollout function's own). Numpy numbers and arrays there, the usual case, are written as
the Python numbers and lists they hold; any other object is refused when the dump is written, naming
where it sits, instead of when someone tries to read it back.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from slime.rollout.errors import RolloutError
from slime.rollout.train_data import RolloutBatch

METRICS_KEY = "metrics"

# Values the safe reader rebuilds as they are (``type`` exactly: a numpy float64 is a float subclass).
_PLAIN = (type(None), bool, int, float, str, bytes)


class _NotPlain(Exception):
    """An object the safe reader cannot rebuild; ``path`` is filled with its keys on the way out."""

    def __init__(self, value: object) -> None:
        super().__init__(type(value).__name__)
        self.value = value
        self.path: list[object] = []


def save_rollout_data(batch: RolloutBatch, path: str) -> None:
    """Writes ``batch`` to ``path`` (its directory is created) as ``load_rollout_data`` reads it back."""
    import torch  # here, not at the top: the driver imports torch only for these dumps

    try:
        plain = _plain({**batch.data, METRICS_KEY: batch.metrics})
    except _NotPlain as e:
        where = "".join(f"[{key!r}]" for key in e.path)
        raise RolloutError(
            f"--save-debug-rollout-data: the rollout's data{where} is a {type(e.value).__name__}, which "
            "is not saved (only tensors, numbers, strings, lists and dicts load back safely); have the "
            "reward or rollout function return plain values there"
        ) from None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(plain, path)


def load_rollout_data(path: str) -> RolloutBatch:
    """The rollout ``save_rollout_data`` wrote to ``path``; a file holding anything else is refused
    in one line (it could only be read by running code it names)."""
    import torch

    try:
        plain = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise RolloutError(f"--load-debug-rollout-data: {path} does not exist") from None
    except pickle.UnpicklingError:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        if not unsafe:  # not a refusal of what it names: a damaged file, say
            raise
        raise RolloutError(
            f"--load-debug-rollout-data: {path} names {', '.join(unsafe)}; only tensors and plain values "
            "are loaded (anything else would run code from the file); write it with "
            "--save-debug-rollout-data"
        ) from None
    metrics = plain.pop(METRICS_KEY, {})
    return RolloutBatch(data=plain, metrics=metrics)


def _plain(value: Any) -> Any:
    """``value`` with numpy numbers and arrays as Python ones; raises ``_NotPlain`` for anything else."""
    import torch  # already imported by the caller

    if type(value) in _PLAIN or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {_plain(key): _within(key, item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        if all(type(item) in _PLAIN for item in value):  # token ids, masks: nothing to convert
            return value
        items = [_within(index, item) for index, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise _NotPlain(value)


def _within(key: object, item: Any) -> Any:
    """``_plain(item)``, with ``key`` added to the path of what it refuses."""
    try:
        return _plain(item)
    except _NotPlain as e:
        e.path.insert(0, key)
        raise
