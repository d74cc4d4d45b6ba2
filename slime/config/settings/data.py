"""Where a run's prompts come from and in which order they are served (``slime.rollout.data_source``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime.config.errors import ConfigError
from slime.config.settings.flags import read_flags

MULTIMODAL_MODALITIES = ("image",)
"""The modalities ``--multimodal-keys`` may name (upstream slime also has video and audio)."""


def is_vision_checkpoint(path: str | Path) -> bool:
    """Whether ``config.json`` of ``path`` describes a vision-language model (it has a vision tower)."""
    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def parse_multimodal_keys(value: str | dict[str, Any] | None) -> dict[str, str] | None:
    """``--multimodal-keys``: a JSON object mapping a modality to the column holding its items, e.g.
    ``{"image": "images"}`` (upstream slime's shape); None when not given. A dict (a plugin's namespace
    as upstream parses it) is checked the same way. Raises a one-line ``ConfigError``."""
    flag = "--multimodal-keys"
    example = """e.g. '{"image": "images"}'"""
    if value is None:
        return None
    parsed: Any = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(
                flag, f"{value!r} is not valid JSON ({e.msg}); pass a JSON object, {example}"
            ) from e
    if not isinstance(parsed, dict) or not parsed:
        raise ConfigError(
            flag,
            f"must be a non-empty JSON object mapping a modality to a column, got {value!r}; {example}",
        )
    for modality, column in parsed.items():
        if modality not in MULTIMODAL_MODALITIES:
            raise ConfigError(
                flag,
                f"unknown modality {modality!r}; supported: {', '.join(MULTIMODAL_MODALITIES)} ({example})",
            )
        if not isinstance(column, str) or not column:
            raise ConfigError(
                flag, f"the column of {modality!r} must be a non-empty string, got {column!r}; {example}"
            )
    return dict(parsed)


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    prompt_data: str | None
    """``--prompt-data``: a JSONL or Parquet file, optionally ``PATH@[start:end]``."""
    input_key: str
    label_key: str | None
    metadata_key: str | None
    tool_key: str | None
    multimodal_keys: dict[str, str] | None = None
    """``--multimodal-keys``: modality -> column of its items (``{"image": "images"}``), parsed."""
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
            multimodal_keys=parse_multimodal_keys(args.multimodal_keys),
        )
