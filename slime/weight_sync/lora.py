"""LoRA weight sync: the adapter moves, the base never does.

The engines were started on ``--hf-checkpoint`` with LoRA enabled (``--enable-lora``, the rank and the
target modules derived from ``--lora-*``) and every ``/generate`` names the adapter
(``LoraSettings.adapter_name``). A push gathers the adapter on global rank 0 (megabytes: the HF PEFT
tensors of every pipeline stage) and replaces it on every engine: ``/unload_lora_adapter`` first (a
loaded name cannot be loaded again), then

- colocated (``--update-weight-transport tensor``): ``/load_lora_adapter_from_tensors``, the whole
  adapter in one call as SGLang requires, handed over in place (CUDA IPC on GPU, shared memory on
  CPU, ``slime.weight_sync.ipc``), with a sha256 per tensor (``expected_checksums``) that the engine
  checks;
- otherwise: an HF PEFT directory written under ``--update-weight-disk-dir`` (a temporary directory of
  the trainer's node without it) and ``/load_lora_adapter`` from it. SGLang 0.5.19–0.5.23 have no
  process-group path for adapters (``srt/lora``: loads from a path or from tensors only).

Then ``/update_weight_version`` gives every engine the trainer's version, which the samples record.
Under ``--lora-train-only`` a push is that version alone: the engines keep serving the base.
SGLang's endpoints and shapes are pinned in ``tests/unit/test_sglang_lora_contract.py``.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from slime.config.settings.lora import LoraSettings
from slime.config.settings.weight_sync import WeightSyncSettings
from slime.engine_client.calls import EngineCallError, wait_all
from slime.engine_client.weight_updates import (
    load_lora_adapter,
    load_lora_adapter_from_tensors,
    unload_lora_adapter,
    update_weight_version,
)
from slime.weight_sync import ipc

ADAPTER_DIR_PREFIX = "lora_v"


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's ``expected_checksums`` entry: sha256 of the tensor's raw bytes."""
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


class LoraWeightUpdater:
    """Pushes the trainer's adapter to every engine (``WeightUpdater``'s three calls)."""

    def __init__(self, settings: WeightSyncSettings, lora: LoraSettings, hf_checkpoint: str, trainer) -> None:
        self.settings, self.lora, self.trainer = settings, lora, trainer
        self.hf_checkpoint = hf_checkpoint
        self.engine_urls: list[str] = []
        self._temporary: Path | None = None

    def connect(self, engine_urls: list[str]) -> None:
        self.engine_urls = list(engine_urls)

    def update(self, weight_version: str) -> dict[str, float]:
        """The adapter to every engine, then the version; under ``--lora-train-only`` the version only
        (the engines keep serving the base, an evaluation baseline)."""
        start = time.perf_counter()
        num_bytes = 0
        if not self.lora.train_only:
            weights = self.trainer.lora_state_dict()  # a collective; the adapter lands on global rank 0
            if weights is None:
                return {}
            self._unload()
            if self.settings.transport == "tensor":
                self._load_from_tensors(weights)
            else:
                self._load_from_directory(weights, weight_version)
            num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        if dist.get_rank() != 0:
            return {}
        payload = {"new_version": weight_version, "abort_all_requests": False}
        wait_all(update_weight_version(self.engine_urls, payload, self.settings.timeout_s))
        return {"update_weights_bytes": float(num_bytes), "update_weights_time": time.perf_counter() - start}

    def _unload(self) -> None:
        """The adapter off every engine; an engine that has none (the first push, a restarted engine)
        answers that it does not exist, which is what the push wants."""
        payload = {"lora_name": self.lora.adapter_name}
        for future in unload_lora_adapter(self.engine_urls, payload, self.settings.timeout_s):
            try:
                future.result()
            except EngineCallError as exc:
                if "does not exist" not in exc.engine_message:
                    raise

    def _load_from_tensors(self, weights: dict[str, torch.Tensor]) -> None:
        from slime.backends.megatron.lora.peft_io import peft_config

        payload = {
            "lora_name": self.lora.adapter_name,
            "config_dict": peft_config(self.lora, self.hf_checkpoint),
            # One copy per engine tensor-parallel rank; each reads its own (the adapter is whole).
            "serialized_named_tensors": [ipc.serialize(weights)] * self.settings.ranks_per_engine,
            "expected_checksums": {name: tensor_checksum(t) for name, t in weights.items()},
        }
        wait_all(load_lora_adapter_from_tensors(self.engine_urls, payload, self.settings.timeout_s))

    def _load_from_directory(self, weights: dict[str, torch.Tensor], weight_version: str) -> None:
        """Writes the adapter as HF PEFT does, loads it on every engine, keeps only the newest."""
        from slime.backends.megatron.lora.peft_io import write_peft_adapter

        root = Path(self.settings.disk_dir) if self.settings.disk_dir else self._temporary_root()
        final = root / f"{ADAPTER_DIR_PREFIX}{weight_version}"
        partial = root / f".{final.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        write_peft_adapter(str(partial), weights, self.lora, self.hf_checkpoint)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        payload = {"lora_name": self.lora.adapter_name, "lora_path": str(final.resolve()), "pinned": False}
        wait_all(load_lora_adapter(self.engine_urls, payload, self.settings.timeout_s))
        for old in root.glob(f"{ADAPTER_DIR_PREFIX}*"):
            if old != final and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    def _temporary_root(self) -> Path:
        if self._temporary is None:
            self._temporary = Path(tempfile.mkdtemp(prefix="slime_lora_"))
        return self._temporary

    def disconnect(self, best_effort: bool = False) -> None:
        self.engine_urls = []
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
