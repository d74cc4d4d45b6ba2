"""How a run's weights reach its engines, read once from the parsed flags.

The updaters, the trainer actor and the session take this object instead of the whole ``args``
namespace, so what weight sync depends on is written in one place (and a bench or test builds it
by hand).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from slime.config.settings.lora import LoraSettings


@dataclass(frozen=True)
class WeightSyncSettings:
    transport: str
    """``--update-weight-transport``: ``distributed`` (process-group broadcast), ``tensor`` (in place,
    colocated) or ``disk`` (safetensors snapshots)."""
    bucket_bytes: int
    """``--update-weight-buffer-size``: full HF tensors are sent in buckets of at most this size."""
    timeout_s: float
    """``--update-weights-timeout``: one engine call of a push (and a broadcast) may take this long."""
    ranks_per_engine: int = 1
    """``--rollout-num-gpus-per-engine``: the engine's tensor-parallel ranks, each a receiver."""
    disk_dir: str | None = None
    """``--update-weight-disk-dir``: where the disk transport writes its snapshots (and LoRA pushes
    that are not colocated their adapter directories)."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """``--lora-*``: when the engines serve an adapter, a push sends the adapter alone."""
    hf_checkpoint: str | None = None
    """``--hf-checkpoint``: the base an exported adapter names."""
    check_equal: bool = False
    """``--check-weight-update-equal``: the first push must restore every engine's weights exactly."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WeightSyncSettings:
        return cls(
            transport=args.update_weight_transport,
            bucket_bytes=int(args.update_weight_buffer_size),
            timeout_s=float(args.update_weights_timeout),
            ranks_per_engine=int(args.rollout_num_gpus_per_engine),
            disk_dir=args.update_weight_disk_dir,
            lora=LoraSettings.from_args(args),
            hf_checkpoint=args.hf_checkpoint,
            check_equal=bool(args.check_weight_update_equal),
        )
