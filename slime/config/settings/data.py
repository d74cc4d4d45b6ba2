"""Where a run's prompts come from and in which order they are served (``slime.rollout.data_source``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime.config.settings.flags import read_flags


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    prompt_data: str | None
    """``--prompt-data``: a JSONL or Parquet file, optionally ``PATH@[start:end]``."""
    input_key: str
    label_key: str | None
    metadata_key: str | None
    tool_key: str | None
    apply_chat_template: bool
    max_prompt_len: int | None
    """``--rollout-max-prompt-len``: longer prompts (in tokens, rendered) are never served."""
    tokenizer_path: str | None
    """``--hf-checkpoint``: its tokenizer renders the chat template and measures prompt lengths."""
    data_source_path: str | None
    """``--data-source-path``: a user class built as ``C(args)`` that replaces the prompt source."""
    streaming_data: bool
    """``--streaming-data``: index the file once and read records when their turn comes."""
    num_data_workers: int
    on_bad_prompt: str
    """``--on-bad-prompt``: ``stop`` at a malformed record, or ``skip`` it."""
    shuffle: bool
    """``--rollout-shuffle``: each epoch in its own order, from ``seed``."""
    seed: int
    """``--rollout-seed``."""
    buffer_filter_path: str | None
    """``--buffer-filter-path``: picks which returned groups are served first."""
    n_samples_per_prompt: int
    rollout_batch_size: int
    over_sampling_batch_size: int | None
    num_epoch: int | None
    save: str | None
    """``--save``: the data position is saved next to the checkpoint."""
    load: str | None
    """``--load``: the data position is read back from there."""

    @property
    def stop_on_bad(self) -> bool:
        return self.on_bad_prompt == "stop"

    @property
    def prefetch(self) -> int:
        """Prompts the data workers read ahead: one draw of the rollout."""
        return self.over_sampling_batch_size or self.rollout_batch_size or 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataSettings:
        return read_flags(
            cls,
            args,
            max_prompt_len=args.rollout_max_prompt_len,
            tokenizer_path=args.hf_checkpoint,
            num_data_workers=args.num_data_workers or 0,
            shuffle=args.rollout_shuffle,
            seed=args.rollout_seed,
        )
