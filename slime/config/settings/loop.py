"""The order of a run's steps: how many rollouts, and when to evaluate, save, push and dump."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime.config.settings.flags import read_flags


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    num_rollout: int | None
    """``--num-rollout``; with ``--num-epoch`` None until the session counts it from the data."""
    eval_interval: int | None
    skip_eval_before_train: bool
    save: str | None
    """``--save``: the checkpoint directory (None: the run saves nothing)."""
    save_interval: int | None
    save_hf: str | None
    """``--save-hf``: where the HF export goes after the last rollout."""
    update_weights_interval: int
    async_buffer_size: int
    """``train_async.py``: how many rollouts generation may run ahead of the one being trained."""
    save_debug_rollout_data: str | None
    load_debug_rollout_data: str | None
    """Patterns with ``{rollout_id}``: each rollout's train data dumped, or read instead of generated."""
    load: str | None
    """``--load``: the checkpoint directory the run resumes from."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoopSettings:
        return read_flags(cls, args)
