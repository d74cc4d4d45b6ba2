"""HF checkpoints in and out of a (possibly sharded) Megatron model: loading, walking the weights as
full HF tensors, streaming them to global rank 0 bucket by bucket, and writing them."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors import safe_open
from safetensors.torch import save_file

from slime.backends.megatron.conversion import ModelConverter
from slime.backends.megatron.lora.targets import is_adapter_param
from slime.backends.megatron.sharding import (
    gathered_global_tensors,
    named_global_params,
    shard_for_this_rank,
    unwrap,
)
from slime.weight_sync.bucketing import iter_buckets
from slime.weight_sync.senders import is_stage_leader, walks_hf_weights

logger = logging.getLogger(__name__)


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
        self._handles: dict[Path, safe_open] = {}

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


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def unbuilt_layers(names: list[str], num_layers: int) -> list[int]:
    """HF layer numbers in ``names`` past the model's ``num_layers``: DeepSeek-V3 and GLM-4.5 keep
    their multi-token-prediction layers there (``model.layers.<num_hidden_layers>...``)."""
    found = {int(match.group(1)) for name in names if (match := _HF_LAYER.match(name))}
    return sorted(layer for layer in found if layer >= num_layers)


@torch.no_grad()
def load_hf_weights(
    model_chunks: list[torch.nn.Module], checkpoint_dir: str | Path, converter: ModelConverter, gated: bool
) -> None:
    """Copies the HF checkpoint into this rank's shards of every model chunk (call before the optimizer)."""
    reader = SafetensorsReader(checkpoint_dir)
    num_layers = unwrap(model_chunks[0]).config.num_layers
    if (extra := unbuilt_layers(reader.names(), num_layers)) and dist.get_rank() == 0:
        logger.info(
            "HF layers %s are past the model's %d (multi-token prediction): not loaded", extra, num_layers
        )
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
            if not is_adapter_param(name):  # LoRA's adapters go out as a PEFT adapter (lora.peft_io)
                yield from converter.hf_from_megatron(name, full)


def stream_hf_weights(
    model_chunks: list[torch.nn.Module],
    converter: ModelConverter,
    gated: bool,
    bucket_bytes: int,
    device: torch.device,
    consume: Callable[[list[tuple[str, torch.Tensor]]], None],
) -> None:
    """Every HF tensor of every pipeline stage, in buckets of ``bucket_bytes``, handed to ``consume`` on
    global rank 0 (a collective: every rank calls it, after the parameters are gathered).

    Stage by stage, the ranks that gather a stage's shards walk its weights and only the stage's
    leader keeps them: rank 0 consumes its own stage's buckets, the other leaders send theirs to
    rank 0 one at a time, each after rank 0 has taken the previous one. No rank holds more than
    a bucket or two beyond its model (before, every rank copied its whole model and rank 0
    received all of them at once). On rank 0 a tensor may be a view of a live parameter:
    ``consume`` copies what it keeps.
    """
    rank, stage = dist.get_rank(), mpu.get_pipeline_model_parallel_rank()
    leaders = dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group()) if rank == 0 else []
    ack = torch.zeros(1, device=device)  # rank 0 took a bucket: the next may come
    for current in range(mpu.get_pipeline_model_parallel_world_size()):
        if stage == current and walks_hf_weights():
            weights = iter_hf_weights(model_chunks, converter, gated=gated)
            if not is_stage_leader():
                for _ in weights:  # the stage's other ranks only take part in the gathers
                    pass
                continue
            for bucket in iter_buckets(weights, bucket_bytes):
                if rank == 0:
                    consume([(name, tensor.cpu()) for name, tensor in bucket])
                    continue
                # A copy of each tensor: pickling a view of a parameter would carry its whole storage.
                dist.send_object_list([[(name, t.to("cpu", copy=True)) for name, t in bucket]], dst=0)
                dist.recv(ack, src=0)
            if rank != 0:
                dist.send_object_list([None], dst=0)
        if rank == 0 and leaders[current] != 0:
            while True:
                box = [None]
                dist.recv_object_list(box, src=leaders[current])
                if box[0] is None:
                    break
                consume(box[0])
                dist.send(ack, dst=leaders[current])


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
