"""HF checkpoints in and out of a (possibly sharded) Megatron model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slime.backends.megatron.conversion import ModelConverter
from slime.backends.megatron.sharding import (
    gathered_global_tensors,
    named_global_params,
    shard_for_this_rank,
)


class SafetensorsReader:
    """Reads single tensors lazily from a (possibly multi-file) safetensors checkpoint."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        root = Path(checkpoint_dir)
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: root / fname for name, fname in weight_map.items()}
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {root}")
            self._file_of = {}
            for path in files:
                with safe_open(path, framework="pt") as f:
                    self._file_of.update(dict.fromkeys(f.keys(), path))
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        try:
            path = self._file_of[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} not found in the HF checkpoint") from None
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_tensor(name)


@torch.no_grad()
def load_hf_weights(
    model_chunks: list[torch.nn.Module], checkpoint_dir: str | Path, converter: ModelConverter, gated: bool
) -> None:
    """Copies the HF checkpoint into this rank's shards of every model chunk (call before the optimizer)."""
    reader = SafetensorsReader(checkpoint_dir)
    for chunk in model_chunks:
        for name, param in named_global_params(chunk):
            full = converter.megatron_from_hf(name, reader.get)
            shard = shard_for_this_rank(name, full, param, gated)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{name}: HF checkpoint gives shape {tuple(shard.shape)}, "
                    f"model expects {tuple(param.shape)}"
                )
            param.data.copy_(shard.to(param.dtype))


@torch.no_grad()
def iter_hf_weights(
    model_chunks: list[torch.nn.Module], converter: ModelConverter, gated: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's parameters as full HF tensors, every expert included (a collective over the
    tensor- and expert-parallel groups)."""
    for chunk in model_chunks:
        for name, full in gathered_global_tensors(chunk, gated):
            yield from converter.hf_from_megatron(name, full)


class HFCheckpointWriter:
    """Writes an HF checkpoint one bucket of tensors at a time, so the writer never holds the model.

    Each ``add`` becomes one ``model-NNNNN.safetensors`` file; ``close`` writes
    ``model.safetensors.index.json`` (the weight map transformers, SGLang and the torch engine read)
    and copies the source checkpoint's config and tokenizer files, so the result loads like the
    original.
    """

    def __init__(self, source_dir: str | Path, target_dir: str | Path) -> None:
        self.source, self.target = Path(source_dir), Path(target_dir)
        self.target.mkdir(parents=True, exist_ok=True)
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self._files = 0

    def add(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not tensors:
            return
        self._files += 1
        name = f"model-{self._files:05d}.safetensors"
        contiguous = {key: tensor.contiguous() for key, tensor in tensors}
        save_file(contiguous, str(self.target / name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(contiguous, name))
        self.total_bytes += sum(t.numel() * t.element_size() for t in contiguous.values())

    def close(self) -> str:
        for path in self.source.iterdir():
            if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
                shutil.copy2(path, self.target / path.name)
        weight_map = dict(sorted(self.weight_map.items()))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return str(self.target)
