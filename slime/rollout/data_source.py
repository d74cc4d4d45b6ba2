"""The resumable prompt source: which prompt groups a rollout gets next, in an order a resume repeats.

``PromptDataSource`` is the start of every rollout (docs/architecture.md, "Data flow of one step").
It hands out groups of ``n_samples_per_prompt`` copies of one prompt, walks the data epoch after
epoch (reshuffled per epoch with a seed derived from ``--rollout-seed``, so any run can be replayed),
takes back aborted groups for the next rollout, and saves its position next to the checkpoint so a
resumed run sees exactly the prompts the uninterrupted run would have seen (docs/architecture.md,
"Invariants": resume). The prompts themselves are read and checked by ``slime.rollout.prompt_files``;
the source only orders them.

Where the prompts live does not change what is served. In memory (the default) every record is read
at start-up (``lazy_prompts.read_all``); with ``--streaming-data`` a one-pass index of the file is kept
and the records are read when their turn comes, a batch of the served order at a time
(``lazy_prompts.LazyPrompts``), by ``--num-data-workers`` processes ahead of time when given
(``prompt_workers``). Either way the epoch's order is a permutation of every record of the file
(slice), and a record that cannot be served (over ``--rollout-max-prompt-len``, or malformed under
``--on-bad-prompt skip``) is skipped at its turn, so both sources serve the same prompts in the same
order for the same seed, and ``len`` counts records.

Saved position: ``<directory>/rollout/data_source_<rollout_id>.json``, a JSON object::

    {"format": 1, "num_prompts": 1000, "epoch": 2, "offset": 64,
     "next_group_index": 2064, "next_sample_index": 16512, "buffer": [[<Sample.to_dict()>, ...], ...]}

``num_prompts`` counts the records of the file (slice), those never served included; ``offset`` counts
the positions of epoch ``epoch``'s order already passed (served or skipped); ``buffer`` holds the groups
returned with ``add_samples`` and not served yet (empty in the common case, so the file stays small).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from slime.config import ConfigError
from slime.config.settings.data import DataSettings
from slime.rollout.lazy_prompts import LazyPrompts, Outcome, Rejected, read_all
from slime.rollout.prompt_files import DataError, PromptFormat
from slime.rollout.prompt_index import PromptIndex
from slime.rollout.prompt_workers import Lookahead, PromptWorkers
from slime.rollout.sample import Sample

logger = logging.getLogger(__name__)

STATE_FORMAT = 1


BufferFilter = Callable[[list[list[Sample]], int], list[list[Sample]]]
"""``--buffer-filter-path`` bound to the plugins' ``args``: ``(buffer, num_groups) -> the groups to
serve from it``."""


@runtime_checkable
class DataSource(Protocol):
    """What a rollout needs from its data: ``PromptDataSource``, or a ``--data-source-path`` class
    built as ``C(args)`` (the plugins' namespace)."""

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


def make_data_source(
    data: DataSettings, plugin_args: argparse.Namespace, index: PromptIndex | None = None
) -> DataSource:
    """``--data-source-path``'s class built with ``plugin_args``, else prompts from ``--prompt-data``
    (from ``index`` when the driver already built it: ``check_streaming_data``)."""
    if data.data_source_path is None:
        return PromptDataSource.from_settings(data, plugin_args, index)
    from slime.utils.plugins import load_function

    source: DataSource = load_function(data.data_source_path)(plugin_args)
    return source


def check_streaming_data(data: DataSettings) -> PromptIndex:
    """The driver's look at ``--prompt-data`` under ``--streaming-data``, before anything starts: the
    index pass (structure, slice, the record count ``--num-epoch`` needs) and, under
    ``--on-bad-prompt stop``, the fields of the first record (a wrong ``--input-key`` fails here, not
    at rollout 0). The other records are checked when served: a full parse would cost seconds per
    million records (docs/guides/large-prompt-sets.md)."""
    if data.prompt_data is None:
        raise DataError("--prompt-data is required to generate rollouts; pass a JSONL or Parquet file")
    index = PromptIndex.build(data.prompt_data)
    if data.stop_on_bad:
        fields_only = PromptFormat.from_settings(data, tokenizer=False)  # no tokenizer in the driver
        first = LazyPrompts(index, fields_only)[0]
        if isinstance(first, Rejected):
            raise DataError(first.message)
    return index


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
        prompts: Sequence[Outcome] | LazyPrompts,
        *,
        n_samples_per_prompt: int = 1,
        shuffle: bool = False,
        seed: int = 42,
        buffer_filter: BufferFilter = pick_first,
        stop_on_bad: bool = True,
        workers: PromptWorkers | None = None,
        prefetch: int = 0,
    ) -> None:
        """``prompts``: one epoch's records, read (a list of Samples, or ``Rejected`` for those never
        served) or to be read (``LazyPrompts``, ``--streaming-data``); ``buffer_filter`` picks which
        returned groups are served first (``--buffer-filter-path``); ``stop_on_bad``: a malformed
        record met while serving stops the run (``--on-bad-prompt stop``) instead of being skipped.
        ``workers`` read lazy prompts ``prefetch`` positions ahead of the served one; the source
        closes them in ``close``."""
        if not len(prompts):
            raise DataError("no prompts to serve")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.prompts = prompts if isinstance(prompts, LazyPrompts) else list(prompts)
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.stop_on_bad = stop_on_bad
        self.epoch = 0
        self.offset = 0
        self.next_group_index = 0
        self.next_sample_index = 0
        self.buffer: list[list[Sample]] = []
        self.buffer_filter = buffer_filter
        self.skipped = 0
        """Malformed records skipped so far (``--on-bad-prompt skip``)."""
        self.workers = workers
        self.prefetch = prefetch
        self._lookahead = Lookahead(workers) if workers is not None else None
        self._batch: dict[int, Outcome] = {}
        """Streamed without workers: the outcomes read with the current position's batch, by record."""
        self._orders: dict[int, np.ndarray] = {}
        self._ahead = (0, 0)  # the first (epoch, offset) not submitted to the lookahead yet
        self._order = self._epoch_order(0)
        self._fill_lookahead(prefetch)

    @classmethod
    def from_settings(
        cls, data: DataSettings, plugin_args: argparse.Namespace, index: PromptIndex | None = None
    ) -> PromptDataSource:
        """The run's prompts: --prompt-data, --*-key, --apply-chat-template, --rollout-* (the file's
        ``index`` when given: a second pass over a large file costs about as much as the first);
        ``plugin_args`` go to the ``--buffer-filter-path`` plugin."""
        if data.prompt_data is None:
            raise DataError("--prompt-data is required to generate rollouts; pass a JSONL or Parquet file")
        lazy = LazyPrompts(index or PromptIndex.build(data.prompt_data), PromptFormat.from_settings(data))
        stop_on_bad = data.stop_on_bad
        workers = PromptWorkers(lazy, data.num_data_workers) if data.num_data_workers else None
        prompts: Sequence[Outcome] | LazyPrompts = lazy
        if data.streaming_data:
            logger.info(
                "streaming %d prompts of %s, %d data workers",
                len(lazy),
                data.prompt_data,
                data.num_data_workers,
            )
        else:
            try:
                prompts = read_all(lazy, workers, stop_on_bad)
            finally:
                if workers is not None:
                    workers.close()
            workers = None
        buffer_filter: BufferFilter = pick_first
        if data.buffer_filter_path is not None:
            from slime.utils.plugins import bind_buffer_filter, load_function

            buffer_filter = bind_buffer_filter(load_function(data.buffer_filter_path), plugin_args)
        return cls(
            prompts,
            n_samples_per_prompt=data.n_samples_per_prompt,
            shuffle=data.shuffle,
            seed=data.seed,
            buffer_filter=buffer_filter,
            stop_on_bad=stop_on_bad,
            workers=workers,
            prefetch=data.prefetch,
        )

    def __len__(self) -> int:
        """Number of records in one epoch (what --num-epoch multiplies), those never served included."""
        return len(self.prompts)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Record positions in epoch ``epoch``'s order: ``random.Random(seed + epoch).shuffle`` of
        ``range(len)``, as before streaming existed, so saved positions keep their meaning."""
        if epoch not in self._orders:
            if self.shuffle:
                order = list(range(len(self.prompts)))
                random.Random(self.seed + epoch).shuffle(order)
                self._orders[epoch] = np.array(order, dtype=np.int64)
            else:
                self._orders[epoch] = np.arange(len(self.prompts), dtype=np.int64)
        return self._orders[epoch]

    def close(self) -> None:
        """Stops the ``--num-data-workers`` processes, if any; safe to call twice."""
        if self.workers is not None:
            self.workers.close()

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        """``num_prompts`` groups: buffered groups first (as the buffer filter picks them), then fresh
        copies of the next prompts.

        Each fresh group holds ``n_samples_per_prompt`` deep copies of one prompt's Sample, with a new
        ``group_index`` and one new ``index`` per sample; both keep increasing across calls and epochs.
        """
        groups = self._take_from_buffer(num_prompts) if self.buffer else []
        while len(groups) < num_prompts:
            prompt = self._next_prompt(num_prompts - len(groups))
            group = []
            for _ in range(self.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.next_group_index
                sample.index = self.next_sample_index
                self.next_sample_index += 1
                group.append(sample)
            self.next_group_index += 1
            groups.append(group)
        if self._lookahead is not None:  # the next rollout's prompts, read while this one generates
            self._fill_lookahead(max(num_prompts, self.prefetch) - self._lookahead.queued)
        return groups

    def _next_prompt(self, wanted: int) -> Sample:
        """The Sample at the next served position, skipping rejected records (``wanted``: how many the
        caller still needs, the least to submit when the lookahead runs dry)."""
        for _ in range(2 * len(self.prompts)):  # two passes in a row cover one whole epoch
            if self.offset == len(self.prompts):
                self.epoch += 1
                self.offset = 0
                self._orders.pop(self.epoch - 1, None)
                self._order = self._epoch_order(self.epoch)
            outcome = self._outcome(int(self._order[self.offset]), wanted)
            self.offset += 1
            if isinstance(outcome, Sample):
                return outcome
            if outcome.malformed:
                if self.stop_on_bad:
                    raise DataError(outcome.message)
                self.skipped += 1
                logger.warning(
                    "skipped %s (--on-bad-prompt skip; %d skipped so far)", outcome.message, self.skipped
                )
        raise DataError(
            f"none of the {len(self.prompts)} records of the prompt data can be served; see above"
        )

    def _outcome(self, record: int, wanted: int) -> Outcome:
        """The outcome of ``record``, at the current position: taken from the workers' lookahead or the
        list read at start-up, or read now together with the rest of the ``wanted`` positions from here
        (in this epoch), in one read: a Parquet row group is decoded once for all its rows in the batch."""
        if self._lookahead is not None:
            if not self._lookahead.queued:
                self._fill_lookahead(max(wanted, self.prefetch, 1))
            return self._lookahead.take(record)
        if not isinstance(self.prompts, LazyPrompts):
            return self.prompts[record]
        if record not in self._batch:
            records = self._order[self.offset : self.offset + wanted]
            self._batch = dict(zip(records.tolist(), self.prompts.outcomes(records), strict=True))
        return self._batch.pop(record)

    def _fill_lookahead(self, count: int) -> None:
        """Submits the ``count`` positions after those already submitted (crossing into later epochs)."""
        if self._lookahead is None or count <= 0:
            return
        epoch, offset = self._ahead
        records = []
        while count > 0:
            order = self._epoch_order(epoch)
            take = order[offset : offset + count]
            records.append(take)
            count -= len(take)
            offset += len(take)
            if offset == len(order):
                epoch, offset = epoch + 1, 0
        self._ahead = (epoch, offset)
        self._lookahead.submit(np.concatenate(records))

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
        self._orders.clear()
        self._order = self._epoch_order(self.epoch)
        self._batch.clear()
        if self._lookahead is not None:
            self._lookahead.clear()
            self._ahead = (self.epoch, self.offset)
            self._fill_lookahead(self.prefetch)

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
    """The data positions after the last ``count`` rollouts whose generation began, by rollout id, so
    that a run that stops (an engine died) can checkpoint the last rollout it trained (``--save``)
    with the prompts that follow it, however far generation had run ahead of the trainer.

    ``train_async.py`` trains rollout ``k + 1`` while up to ``--async-buffer-size`` (``B``) later
    rollouts are generated or generating (``k + 2`` to ``k + B + 1``): the last of them began by
    keeping the position after ``k + B``, while the trainer's last finished rollout is still ``k``.
    So ``B + 1`` positions cover every rollout a stopping run can have trained last (``train.py``,
    which never generates ahead, needs 1).

    ``keep(k)`` saves the source's position after rollout ``k`` into ``directory/<k>`` (whatever files
    its ``save`` writes) and drops the oldest beyond ``count``; ``save_after(k, target)`` copies rollout
    ``k``'s into the checkpoint, or saves the current position when ``k`` was the last rollout generated
    (``generated``) and no later one has begun. One lock covers both: the rollout manager runs them on
    different threads, and the current position must not move while it is saved.
    """

    def __init__(self, data_source: DataSource, directory: str | os.PathLike[str], count: int = 1) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.data_source, self.directory, self.count = data_source, Path(directory), count
        self.kept: list[int] = []  # rollout ids, oldest first
        self.generated: int | None = None
        self._lock = threading.Lock()

    def keep(self, rollout_id: int) -> None:
        with self._lock:
            path = self.directory / str(rollout_id)
            shutil.rmtree(path, ignore_errors=True)  # a previous run's, in a reused directory
            self.data_source.save(rollout_id, path)
            self.kept.append(rollout_id)
            for old in self.kept[: -self.count]:
                shutil.rmtree(self.directory / str(old), ignore_errors=True)
            del self.kept[: -self.count]

    def save_after(self, rollout_id: int, target: str | os.PathLike[str]) -> None:
        with self._lock:
            if rollout_id in self.kept:
                shutil.copytree(self.directory / str(rollout_id), target, dirs_exist_ok=True)
            elif self.generated == rollout_id:
                self.data_source.save(rollout_id, target)
            else:
                raise RuntimeError(
                    f"no data position after rollout {rollout_id} was kept (kept: {self.kept}, "
                    f"last generated: {self.generated})"
                )


class RolloutDataSource(PromptDataSource):
    """Upstream slime's data source (``slime.rollout.data_source.RolloutDataSource``), built as upstream
    builds it, ``C(args)``, so a ``--data-source-path`` class written for THUDM/slime can subclass it.
    It is our ``PromptDataSource`` read from the flags; ``save``/``load`` take our ``directory``
    argument as well (docs/guides/upstream-compat.md)."""

    def __init__(self, args: argparse.Namespace) -> None:
        # from_settings reads and checks the prompts; this adopts the source it built
        vars(self).update(vars(PromptDataSource.from_settings(DataSettings.from_args(args), args)))
        self.args = args

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Refused, as upstream: a read-only source; ``RolloutDataSourceWithBuffer`` takes groups back."""
        raise RuntimeError(f"Cannot add samples to {type(self).__name__}. This is a read-only data source.")


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """Upstream's data buffer: ``add_samples`` keeps returned groups in ``self.buffer`` and
    ``get_samples`` serves them first, as ``--buffer-filter-path``'s
    ``buffer_filter(args, buffer, num_samples)`` picks them (the guide's form; by default the earliest)."""

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Keeps ``groups`` in the buffer, served before new prompts."""
        PromptDataSource.add_samples(self, groups)

    def get_buffer_length(self) -> int:
        """Number of groups waiting in the buffer."""
        return len(self.buffer)
