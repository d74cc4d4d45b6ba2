"""The resumable prompt source: which prompt groups a rollout gets next, in an order a resume repeats.

``PromptDataSource`` is the start of every rollout (DESIGN.md §2). It hands out groups of
``n_samples_per_prompt`` copies of one prompt, walks the data epoch after epoch (reshuffled per epoch
with a seed derived from ``--rollout-seed``, so any run can be replayed), takes back aborted groups for
the next rollout, and saves its position next to the checkpoint so a resumed run sees exactly the
prompts the uninterrupted run would have seen (DESIGN.md §7, last invariant). The prompts themselves
are read and checked by ``slime.rollout.prompt_files``; the source only orders them.

Saved position: ``<directory>/rollout/data_source_<rollout_id>.json``, a JSON object::

    {"format": 1, "num_prompts": 1000, "epoch": 2, "offset": 64,
     "next_group_index": 2064, "next_sample_index": 16512, "buffer": [[<Sample.to_dict()>, ...], ...]}

``offset`` counts prompts already served from epoch ``epoch``'s order; ``buffer`` holds the groups
returned with ``add_samples`` and not served yet (empty in the common case, so the file stays small).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from slime.config import ConfigError
from slime.rollout.prompt_files import DataError, PromptFormat, load_prompts
from slime.rollout.sample import Sample

logger = logging.getLogger(__name__)

STATE_FORMAT = 1


BufferFilter = Callable[[list[list[Sample]], int], list[list[Sample]]]
"""``--buffer-filter-path`` bound to ``args``: ``(buffer, num_groups) -> the groups to serve from it``."""


@runtime_checkable
class DataSource(Protocol):
    """What a rollout needs from its data: ``PromptDataSource``, or a ``--data-source-path`` class
    built as ``C(args)``."""

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """The next ``num_groups`` prompt groups (``--n-samples-per-prompt`` Samples each, fresh indices)."""
        ...

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Takes back groups the rollout did not finish (aborted, over-sampled); serve them again later."""
        ...

    def save(self, rollout_id: int, directory: str | os.PathLike[str]) -> Any:
        """Persists the position after rollout ``rollout_id`` next to the checkpoint in ``directory``."""
        ...

    def load(self, rollout_id: int, directory: str | os.PathLike[str]) -> bool:
        """Continues from the position saved after ``rollout_id``; False when nothing was saved there."""
        ...


def rollouts_for_epochs(data_source: object, num_epoch: int, rollout_batch_size: int) -> int:
    """``--num-rollout`` for ``--num-epoch`` passes over the prompts: whole rollouts of
    ``rollout_batch_size`` prompts (the data source wraps into the next epoch, so a last partial
    batch is not lost, it starts the next pass). Raises ``ConfigError`` naming the flag to pass
    when the source has no length or the passes do not fill one rollout."""
    if not hasattr(data_source, "__len__"):
        raise ConfigError(
            "--num-epoch",
            f"{type(data_source).__name__} has no length to count epochs by; pass --num-rollout N",
        )
    num_prompts = len(data_source)
    rollouts = num_prompts * num_epoch // rollout_batch_size
    if rollouts < 1:
        raise ConfigError(
            "--num-epoch",
            f"{num_epoch} pass(es) over {num_prompts} prompts do not fill one rollout of "
            f"--rollout-batch-size {rollout_batch_size}; pass --num-rollout N or more epochs",
        )
    return rollouts


def make_data_source(args: argparse.Namespace) -> DataSource:
    """``--data-source-path``'s class built with ``args``, else prompts from ``--prompt-data``."""
    if args.data_source_path is None:
        return PromptDataSource.from_args(args)
    from slime.utils.plugins import load_function

    return load_function(args.data_source_path)(args)


def pick_first(buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """The default buffer selection: the groups returned earliest."""
    return buffer[:num_groups]


class PromptDataSource:
    """Serves prompt groups in a deterministic, resumable order, with a buffer of returned groups.

    Position = (``epoch``, ``offset`` into that epoch's order) plus the two index counters; the order of
    an epoch is a pure function of ``seed + epoch``, so saving the position is saving the whole state.
    """

    def __init__(
        self,
        prompts: Sequence[Sample],
        *,
        n_samples_per_prompt: int = 1,
        shuffle: bool = False,
        seed: int = 42,
        buffer_filter: BufferFilter = pick_first,
    ) -> None:
        """``prompts``: the Samples of one epoch, however they were read (``prompt_files.load_prompts``
        for ``--prompt-data``); ``buffer_filter`` picks which returned groups are served first
        (``--buffer-filter-path``)."""
        if not prompts:
            raise DataError("no prompts to serve")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.prompts = list(prompts)
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self.next_group_index = 0
        self.next_sample_index = 0
        self.buffer: list[list[Sample]] = []
        self.buffer_filter = buffer_filter
        self._order = self._epoch_order(0)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PromptDataSource:
        """Build from parsed flags: --prompt-data, --*-key, --apply-chat-template, --rollout-* ."""
        if args.prompt_data is None:
            raise DataError("--prompt-data is required to generate rollouts; pass a JSONL or Parquet file")
        prompts = load_prompts(args.prompt_data, PromptFormat.from_args(args))
        buffer_filter = pick_first
        if args.buffer_filter_path is not None:
            from slime.utils.plugins import load_function

            buffer_filter = functools.partial(load_function(args.buffer_filter_path), args)
        return cls(
            prompts,
            n_samples_per_prompt=args.n_samples_per_prompt,
            shuffle=args.rollout_shuffle,
            seed=args.rollout_seed,
            buffer_filter=buffer_filter,
        )

    def __len__(self) -> int:
        """Number of prompts in one epoch (what --num-epoch multiplies)."""
        return len(self.prompts)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        """``num_prompts`` groups: buffered groups first (as the buffer filter picks them), then fresh
        copies of the next prompts.

        Each fresh group holds ``n_samples_per_prompt`` deep copies of one prompt's Sample, with a new
        ``group_index`` and one new ``index`` per sample; both keep increasing across calls and epochs.
        """
        groups = self._take_from_buffer(num_prompts) if self.buffer else []
        while len(groups) < num_prompts:
            if self.offset == len(self.prompts):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            prompt = self.prompts[self._order[self.offset]]
            self.offset += 1
            group = []
            for _ in range(self.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.next_group_index
                sample.index = self.next_sample_index
                self.next_sample_index += 1
                group.append(sample)
            self.next_group_index += 1
            groups.append(group)
        return groups

    def _take_from_buffer(self, num_prompts: int) -> list[list[Sample]]:
        picked = list(self.buffer_filter(list(self.buffer), num_prompts))
        ids = {id(group) for group in picked}
        if len(picked) > num_prompts or len(ids) != len(picked) or not ids <= {id(g) for g in self.buffer}:
            raise ValueError(
                f"the buffer filter returned {len(picked)} groups for {num_prompts} requested; it must "
                "return at most that many distinct groups taken from the buffer it was given"
            )
        self.buffer = [group for group in self.buffer if id(group) not in ids]
        return picked

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Return groups (aborted, partial, over-sampled) to be served before new prompts, in order.

        They keep their indices; the caller decides what to reset (e.g. status) before returning them.
        """
        for group in groups:
            if not group:
                raise ValueError("add_samples got an empty group")
            self.buffer.append(list(group))

    def state_dict(self) -> dict[str, Any]:
        """The position and the buffer, JSON-ready (see the module docstring)."""
        return {
            "format": STATE_FORMAT,
            "num_prompts": len(self.prompts),
            "epoch": self.epoch,
            "offset": self.offset,
            "next_group_index": self.next_group_index,
            "next_sample_index": self.next_sample_index,
            "buffer": [[sample.to_dict() for sample in group] for group in self.buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the data must have as many prompts as when it was saved."""
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"data source state has format {state.get('format')!r}, expected {STATE_FORMAT}")
        if state["num_prompts"] != len(self.prompts):
            raise DataError(
                f"saved data source position is for {state['num_prompts']} prompts, the data now has "
                f"{len(self.prompts)}; resume with the same --prompt-data (and slice)"
            )
        self.epoch = state["epoch"]
        self.offset = state["offset"]
        self.next_group_index = state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
        self.buffer = [[Sample.from_dict(s) for s in group] for group in state["buffer"]]
        self._order = self._epoch_order(self.epoch)

    @staticmethod
    def state_path(rollout_id: int, directory: str | os.PathLike[str]) -> Path:
        """Where ``save`` writes: ``<directory>/rollout/data_source_<rollout_id>.json``."""
        return Path(directory) / "rollout" / f"data_source_{rollout_id}.json"

    def save(self, rollout_id: int, directory: str | os.PathLike[str]) -> Path:
        """Write the position after rollout ``rollout_id`` (atomically: a crash never leaves half a file)."""
        path = self.state_path(rollout_id, directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state_dict()))
        os.replace(tmp, path)
        return path

    def load(self, rollout_id: int, directory: str | os.PathLike[str]) -> bool:
        """Continue from the position saved after rollout ``rollout_id``.

        Returns False (and changes nothing) when no file was saved there, e.g. ``--load`` points at a
        checkpoint made before RL: that is a fresh start, not an error.
        """
        path = self.state_path(rollout_id, directory)
        if not path.is_file():
            logger.info("no data source position at %s; starting from the first prompt", path)
            return False
        try:
            state = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg}); delete it to restart the data order") from e
        self.load_state_dict(state)
        return True


class KeptPositions:
    """The data position after the previous rollout, kept aside while the next one draws its prompts,
    so a run that stops in a rollout (an engine died) can checkpoint the one before (``--save``).

    ``keep(k)`` saves the source's position after rollout ``k`` into ``directory`` (whatever files its
    ``save`` writes); ``save_after(k, target)`` copies them into the checkpoint, or saves the current
    position when ``k`` was the last rollout generated (``generated``).
    """

    def __init__(self, data_source: DataSource, directory: str | os.PathLike[str]) -> None:
        self.data_source, self.directory = data_source, Path(directory)
        self.kept: int | None = None
        self.generated: int | None = None

    def keep(self, rollout_id: int) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self.data_source.save(rollout_id, self.directory)
        self.kept = rollout_id

    def save_after(self, rollout_id: int, target: str | os.PathLike[str]) -> None:
        if self.kept == rollout_id:
            shutil.copytree(self.directory, target, dirs_exist_ok=True)
        elif self.generated == rollout_id:
            self.data_source.save(rollout_id, target)
        else:
            raise RuntimeError(f"no data position after rollout {rollout_id} was kept")
