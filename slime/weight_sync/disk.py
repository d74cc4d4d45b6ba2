"""Weight sync through the filesystem: an HF safetensors snapshot per version, loaded by every engine.

The slowest transport, and the one that reaches any engine that can read the directory: engines
outside the Ray cluster (``--rollout-external-engine-addrs``), engines on other networks, engines
restarted between versions. Global rank 0 writes ``<dir>/weights_v<version>`` (the trainer's
``save_hf``: safetensors plus the source checkpoint's config and tokenizer files) under a temporary
name and renames it when complete, so an engine never reads half a snapshot; then every engine gets
``/update_weights_from_disk``. Older snapshots are deleted once all engines have the new one.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from slime.config.settings.weight_sync import WeightSyncSettings
from slime.engine_client.weight_updates import update_from_disk

SNAPSHOT_PREFIX = "weights_v"


class DiskWeightUpdater:
    def __init__(self, settings: WeightSyncSettings, trainer) -> None:
        self.trainer = trainer
        assert settings.disk_dir is not None  # the config checks require it with the disk transport
        self.root = Path(settings.disk_dir)
        self.timeout = settings.timeout_s
        self.bucket_bytes = settings.bucket_bytes
        self.engine_urls: list[str] = []

    def connect(self, engine_urls: list[str]) -> None:
        self.engine_urls = list(engine_urls)

    def update(self, weight_version: str) -> dict[str, float]:
        """Writes the snapshot (collective: every rank gathers its shards to rank 0) and has it loaded."""
        start = time.perf_counter()
        final = self.root / f"{SNAPSHOT_PREFIX}{weight_version}"
        partial = self.root / f".{final.name}.partial"
        written = self.trainer.save_hf(str(partial), self.bucket_bytes)
        if written is None:  # not global rank 0
            return {}
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        num_bytes = sum(f.stat().st_size for f in final.glob("*.safetensors"))
        payload = {
            "model_path": str(final.resolve()),
            "weight_version": weight_version,
            "flush_cache": True,
            "abort_all_requests": False,
        }
        for reply in update_from_disk(self.engine_urls, payload, self.timeout):
            reply.result()
        for old in self.root.glob(f"{SNAPSHOT_PREFIX}*"):
            if old != final and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        return {"update_weights_bytes": float(num_bytes), "update_weights_time": time.perf_counter() - start}

    def disconnect(self, best_effort: bool = False) -> None:
        self.engine_urls = []
