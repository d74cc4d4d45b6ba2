"""Prompt data: reading JSONL / Parquet into ``Sample`` records and serving them in resumable groups.

``PromptDataSource`` is the start of every rollout (DESIGN.md §2). It hands out groups of
``n_samples_per_prompt`` copies of one prompt, walks the data epoch after epoch (reshuffled per epoch
with a seed derived from ``--rollout-seed``, so any run can be replayed), takes back aborted groups for
the next rollout, and saves its position next to the checkpoint so a resumed run sees exactly the
prompts the uninterrupted run would have seen (DESIGN.md §7, last invariant).

Saved position: ``<directory>/rollout/data_source_<rollout_id>.json``, a JSON object::

    {"format": 1, "num_prompts": 1000, "epoch": 2, "offset": 64,
     "next_group_index": 2064, "next_sample_index": 16512, "buffer": [[<Sample.to_dict()>, ...], ...]}

``offset`` counts prompts already served from epoch ``epoch``'s order; ``buffer`` holds the groups
returned with ``add_samples`` and not served yet (empty in the common case, so the file stays small).

Bad data is one ``DataError`` line that names the file and line (JSONL, 1-based) or row (Parquet,
0-based), e.g. ``--input-key 'question' not found in data/train.jsonl:3; keys present: prompt, answer``.

For SFT, ``load_sft_pairs`` reads prompt/response pairs with the same reader and the same errors.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from slime.config import ConfigError, split_data_path
from slime.rollout.sample import Sample

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
PARQUET_SUFFIXES = (".parquet", ".pq")


class DataError(Exception):
    """Prompt data that cannot be used; the message names the file (and line) and what is wrong.

    The driver prints ``line()`` and exits: a broken data file is a user error, not a traceback.
    """

    def line(self) -> str:
        """The one line the driver prints to stderr."""
        return f"error: {self}"


@dataclass(frozen=True)
class Record:
    """One raw row of a data file, with where it came from so errors can point at it."""

    where: str
    """``path:line`` (JSONL, 1-based line) or ``path:row N`` (Parquet, 0-based row)."""
    data: dict[str, Any]


def read_records(spec: str) -> list[Record]:
    """Read the rows of a JSONL or Parquet file, sliced by an optional ``@[start:end]`` suffix.

    The slice counts records (blank JSONL lines are not records) and is applied before JSON parsing, so
    a huge file sliced to a few rows is cheap. Raises ``DataError`` for a missing file, a malformed line,
    a row that is not an object, or when nothing is left.
    """
    try:
        path, data_slice = split_data_path(spec)
    except ValueError as e:
        raise DataError(str(e)) from e
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist; pass an existing JSONL or Parquet file")
    if path.endswith(PARQUET_SUFFIXES):
        records = _read_parquet(path, data_slice)
    else:
        records = _read_jsonl(path, data_slice)
    if not records:
        what = f"the slice @[{_fmt_slice(data_slice)}] selects no records" if data_slice else "no records"
        raise DataError(f"{spec}: {what}; check the file and the slice")
    return records


def _fmt_slice(s: slice) -> str:
    return f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"


def _read_jsonl(path: str, data_slice: slice | None) -> list[Record]:
    with open(path, encoding="utf-8") as f:
        lines = [(number, line) for number, line in enumerate(f, start=1) if line.strip()]
    if data_slice is not None:
        lines = lines[data_slice]
    records = []
    for number, line in lines:
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix or remove the line"
            ) from e
        if not isinstance(data, dict):
            raise DataError(f"{where}: expected a JSON object per line, got {type(data).__name__}")
        records.append(Record(where, data))
    return records


def _read_parquet(path: str, data_slice: slice | None) -> list[Record]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from e
    rows = range(table.num_rows)
    if data_slice is not None:
        rows = rows[data_slice]
    if not rows:
        return []
    # A slice of a range is a range with step 1 here (the slice syntax has no step).
    data = table.slice(rows.start, len(rows)).to_pylist()
    return [Record(f"{path}:row {row}", item) for row, item in zip(rows, data, strict=True)]


def _missing_key(flag: str, key: str, record: Record) -> DataError:
    present = ", ".join(record.data) or "(none)"
    return DataError(f"{flag} {key!r} not found in {record.where}; keys present: {present}")


def _json_field(flag: str, key: str, record: Record, expected: type) -> Any:
    """A field that may hold a JSON string (common in Parquet exports) instead of the value itself."""
    value = record.data.get(key)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{flag} {key!r} in {record.where} is a string but not valid JSON ({e.msg})"
            ) from e
    if value is not None and not isinstance(value, expected):
        raise DataError(
            f"{flag} {key!r} in {record.where} must be a {expected.__name__}, got {type(value).__name__}"
        )
    return value


def _check_prompt(flag: str, key: str, record: Record) -> str | list[dict[str, Any]]:
    prompt = record.data[key]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        return prompt
    raise DataError(
        f"{flag} {key!r} in {record.where} must be a string or a non-empty list of chat messages "
        f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}"
    )


def _as_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def render_chat(tokenizer: Any, prompt: str | list[dict[str, Any]], tools: list | None = None) -> str:
    """The prompt text the model sees: the chat template applied, with the assistant turn opened.

    A plain string is one user message. Public so that eval and custom generate code render alike.
    """
    return tokenizer.apply_chat_template(
        _as_messages(prompt), tools=tools, tokenize=False, add_generation_prompt=True
    )


def load_prompts(
    spec: str,
    *,
    input_key: str = "input",
    label_key: str | None = None,
    metadata_key: str | None = "metadata",
    tool_key: str | None = None,
    tokenizer: Any = None,
    apply_chat_template: bool = False,
    max_prompt_len: int | None = None,
) -> list[Sample]:
    """Read ``spec`` into one PENDING ``Sample`` per record.

    ``input_key`` (and ``label_key`` when given) must be in every record; ``metadata_key`` and
    ``tool_key`` are optional per record (a JSON string is parsed). Tools are kept in
    ``metadata["tools"]`` for custom generate functions and passed to the chat template.
    ``apply_chat_template`` renders the prompt to text with ``tokenizer``; ``max_prompt_len`` drops
    prompts whose rendered text is longer than that many tokens (both need ``tokenizer``).
    """
    if (apply_chat_template or max_prompt_len is not None) and tokenizer is None:
        raise ValueError("apply_chat_template and max_prompt_len need a tokenizer")
    samples = []
    dropped = 0
    for record in read_records(spec):
        if input_key not in record.data:
            raise _missing_key("--input-key", input_key, record)
        prompt = _check_prompt("--input-key", input_key, record)
        label = None
        if label_key is not None:
            if label_key not in record.data:
                raise _missing_key("--label-key", label_key, record)
            label = record.data[label_key]
            # JSON numbers (e.g. GSM8K answers) become text, as reward functions compare strings.
            if isinstance(label, (int, float)):
                label = str(label)
        metadata = {}
        if metadata_key is not None:
            metadata = dict(_json_field("--metadata-key", metadata_key, record, dict) or {})
        tools = None
        if tool_key is not None:
            tools = _json_field("--tool-key", tool_key, record, list)
            if tools is not None:
                metadata["tools"] = tools
        if apply_chat_template:
            try:
                prompt = render_chat(tokenizer, prompt, tools)
            except Exception as e:
                raise DataError(
                    f"--apply-chat-template failed on {record.where} ({type(e).__name__}: {e})"
                ) from e
        if max_prompt_len is not None:
            text = prompt if isinstance(prompt, str) else render_chat(tokenizer, prompt, tools)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_prompt_len:
                dropped += 1
                continue
        samples.append(Sample(prompt=prompt, label=label, metadata=metadata))
    if dropped:
        logger.info("dropped %d prompt(s) of %s longer than %d tokens", dropped, spec, max_prompt_len)
    if not samples:
        raise DataError(
            f"every prompt of {spec} is longer than --rollout-max-prompt-len {max_prompt_len}; raise it"
        )
    return samples


def load_sft_pairs(spec: str, prompt_key: str, response_key: str) -> list[tuple[str | list[dict], str]]:
    """``(prompt, response)`` pairs for supervised fine-tuning, read and checked like prompt data.

    The prompt is returned raw (string or chat messages) so the caller renders and masks it the way its
    loss needs; the response must be a string.
    """
    pairs = []
    for record in read_records(spec):
        for flag, key in (("prompt key", prompt_key), ("response key", response_key)):
            if key not in record.data:
                raise _missing_key(flag, key, record)
        response = record.data[response_key]
        if not isinstance(response, str):
            raise DataError(
                f"response key {response_key!r} in {record.where} must be a string, "
                f"got {type(response).__name__}"
            )
        pairs.append((_check_prompt("prompt key", prompt_key, record), response))
    return pairs


def load_tokenizer(hf_checkpoint: str) -> Any:
    """The HF tokenizer of a local checkpoint directory (imported lazily: transformers is slow to load)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_checkpoint)


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
        """``buffer_filter`` picks which returned groups are served first (``--buffer-filter-path``)."""
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
        max_prompt_len = args.rollout_max_prompt_len
        tokenizer = None
        if args.apply_chat_template or max_prompt_len is not None:
            if args.hf_checkpoint is None:
                raise DataError("--apply-chat-template and --rollout-max-prompt-len need --hf-checkpoint")
            tokenizer = load_tokenizer(args.hf_checkpoint)
        prompts = load_prompts(
            args.prompt_data,
            input_key=args.input_key,
            label_key=args.label_key,
            metadata_key=args.metadata_key,
            tool_key=args.tool_key,
            tokenizer=tokenizer,
            apply_chat_template=args.apply_chat_template,
            max_prompt_len=max_prompt_len,
        )
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
