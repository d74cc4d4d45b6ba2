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


def write_hf_checkpoint(
    state: dict[str, torch.Tensor], source_dir: str | Path, target_dir: str | Path
) -> str:
    """``state`` as ``model.safetensors`` next to the source checkpoint's config and tokenizer files,
    so transformers and the engines load the result like the original."""
    target = Path(target_dir)
    target.mkdir(parents=True, exist_ok=True)
    for path in Path(source_dir).iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy2(path, target / path.name)
    tensors = {name: tensor.contiguous() for name, tensor in state.items()}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)
