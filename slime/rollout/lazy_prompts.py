"""Prompts read on demand: the records of a ``PromptIndex`` turned into Samples when asked for.

``LazyPrompts`` behaves like the list of an epoch's prompts (``len``, ``prompts[i]``), but parses a
record, applies the chat template and the length cap (``PromptFormat``) only when it is read. Each
position yields either a ``Sample`` or a ``Rejected`` (a prompt over ``--rollout-max-prompt-len``, or a
malformed record whose message names ``file:line``); the data source skips rejected positions when it
serves, in the same place of the order whether the prompts were read lazily (``--streaming-data``) or
all at start-up (``read_all``), so both serve the same prompts in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from slime.rollout.prompt_files import DataError, PromptFormat
from slime.rollout.prompt_index import PromptIndex, RecordReader
from slime.rollout.sample import Sample

logger = logging.getLogger(__name__)

READ_ALL_CHUNK = 4096
"""Records per worker task when all prompts are read at start-up."""


@dataclass(frozen=True)
class Rejected:
    """A record that is never served."""

    message: str
    """What is wrong and where (``path:line`` or ``path:row N``)."""
    malformed: bool
    """True for bad data (``--on-bad-prompt`` decides), False for a prompt over the length cap."""


Outcome = Sample | Rejected


class OutcomeWorkers(Protocol):
    """Reads positions elsewhere (``prompt_workers.PromptWorkers``): what ``read_all`` hands them."""

    def submit(self, records: np.ndarray) -> Future[list[Outcome]]: ...


class LazyPrompts:
    """The prompts of one (sliced) file by position, each parsed and rendered when read.

    Picklable (the index, the format and its tokenizer), so worker processes read with a copy.
    """

    def __init__(self, index: PromptIndex, prompt_format: PromptFormat) -> None:
        self.index = index
        self.prompt_format = prompt_format
        self.reader = RecordReader(index, prompt_format.columns)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, record: int) -> Outcome:
        return self.outcomes([record])[0]

    def outcomes(self, records: Sequence[int] | np.ndarray) -> list[Outcome]:
        """The Sample (or why not) of each record position, in order; read together, so ask for a batch
        (a Parquet row group is decoded once for all the batch's rows in it)."""
        out: list[Outcome] = []
        for raw in self.reader.read(records):
            if isinstance(raw, DataError):
                out.append(Rejected(str(raw), malformed=True))
                continue
            try:
                sample = self.prompt_format.sample(raw)
            except DataError as e:
                out.append(Rejected(str(e), malformed=True))
                continue
            if sample is None:
                cap = self.prompt_format.max_prompt_len
                out.append(Rejected(f"{raw.where}: longer than {cap} tokens", malformed=False))
            else:
                out.append(sample)
        return out


def read_all(prompts: LazyPrompts, workers: OutcomeWorkers | None, stop_on_bad: bool) -> list[Outcome]:
    """Every position of ``prompts`` read now (the in-memory source), by ``workers`` when given.

    With ``stop_on_bad`` the first malformed record in file order is raised as its ``DataError``, before
    anything starts; a data set of nothing but rejected records is an error either way.
    """
    positions = np.arange(len(prompts))
    if workers is None:
        chunks: Iterable[list[Outcome]] = (prompts.outcomes(positions),)
    else:
        splits = np.array_split(positions, max(1, -(-len(positions) // READ_ALL_CHUNK)))
        chunks = (future.result() for future in [workers.submit(split) for split in splits])
    outcomes: list[Outcome] = []
    for chunk in chunks:
        for outcome in chunk:
            if stop_on_bad and isinstance(outcome, Rejected) and outcome.malformed:
                raise DataError(outcome.message)
        outcomes.extend(chunk)
    rejected = [o for o in outcomes if isinstance(o, Rejected)]
    if len(rejected) == len(outcomes):
        raise DataError(f"no prompt of {prompts.index.path} can be served: {rejected[-1].message}")
    too_long = sum(not o.malformed for o in rejected)
    if too_long:
        cap = prompts.prompt_format.max_prompt_len
        logger.info(
            "%d prompt(s) of %s are longer than %d tokens: never served", too_long, prompts.index.path, cap
        )
    if len(rejected) > too_long:
        logger.warning(
            "%d malformed record(s) of %s skipped (--on-bad-prompt skip)",
            len(rejected) - too_long,
            prompts.index.path,
        )
    return outcomes
