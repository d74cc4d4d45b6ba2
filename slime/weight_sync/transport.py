"""``--update-weight-transport``: which updater a trainer rank uses to bring its weights to the engines.

Every updater has the same three calls, made on every trainer rank by ``TrainerActor``:
``connect(engine_urls, ranks_per_engine)``, ``update(weight_version) -> metrics`` and ``disconnect()``.
"""

from __future__ import annotations

import argparse
from typing import Protocol


class WeightUpdater(Protocol):
    def connect(self, engine_urls: list[str], ranks_per_engine: int) -> None: ...

    def update(self, weight_version: str) -> dict[str, float]: ...

    def disconnect(self) -> None: ...


def build_weight_updater(args: argparse.Namespace, trainer) -> WeightUpdater:
    """distributed: process-group broadcast; tensor: in place (colocated); disk: safetensors snapshots."""
    if args.update_weight_transport == "tensor":
        from slime.weight_sync.tensor import TensorWeightUpdater

        return TensorWeightUpdater(args, trainer)
    if args.update_weight_transport == "disk":
        from slime.weight_sync.disk import DiskWeightUpdater

        return DiskWeightUpdater(args, trainer)
    from slime.weight_sync.distributed import DistributedWeightUpdater

    return DistributedWeightUpdater(args, trainer)
