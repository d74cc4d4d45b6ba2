"""``--update-weight-transport``: which updater a trainer rank uses to bring its weights to the engines.

Every updater is built from ``WeightSyncSettings`` and the rank's trainer, and has the same three calls,
made on every trainer rank by ``TrainerActor``: ``connect(engine_urls)``,
``update(weight_version) -> metrics`` and ``disconnect()``.
"""

from __future__ import annotations

from typing import Protocol

from slime.config.settings.weight_sync import WeightSyncSettings


class WeightUpdater(Protocol):
    def connect(self, engine_urls: list[str]) -> None: ...

    def update(self, weight_version: str) -> dict[str, float]: ...

    def disconnect(self, best_effort: bool = False) -> None:
        """Closes what ``connect`` opened; ``best_effort``: an engine that is gone is only logged."""
        ...


def build_weight_updater(settings: WeightSyncSettings, trainer) -> WeightUpdater:
    """distributed: process-group broadcast; tensor: in place (colocated); disk: safetensors snapshots.
    With LoRA, the adapter alone whatever the transport, or nothing under ``--lora-train-only``
    (``LoraWeightUpdater``): the base the engines serve never changes."""
    if settings.lora.enabled:
        from slime.weight_sync.lora import LoraWeightUpdater

        assert settings.hf_checkpoint is not None  # the config checks require it
        return LoraWeightUpdater(settings, settings.lora, settings.hf_checkpoint, trainer)
    if settings.transport == "tensor":
        from slime.weight_sync.tensor import TensorWeightUpdater

        return TensorWeightUpdater(settings, trainer)
    if settings.transport == "disk":
        from slime.weight_sync.disk import DiskWeightUpdater

        return DiskWeightUpdater(settings, trainer)
    from slime.weight_sync.distributed import DistributedWeightUpdater

    return DistributedWeightUpdater(settings, trainer)
