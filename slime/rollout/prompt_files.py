"""Prompt files: reading JSONL / Parquet, checking their rows and turning them into ``Sample`` records.

Two steps, kept apart so each can change alone: ``read_records`` knows the file formats (JSONL,
Parquet, the ``PATH@[start:end]`` slice) and where each row came from; ``PromptFormat`` knows what a
row means (``--input-key``, ``--label-key``, ``--metadata-key``, ``--tool-key``, the chat template,
the prompt length cap). ``load_prompts`` joins them for a whole file. The training prompts
(``slime.rollout.data_source``) and the ``--eval-prompt-data`` sets are both read here, with the
same checks.

Bad data is one ``DataError`` line that names the file and line (JSONL, 1-based) or row (Parquet,
0-based), e.g. ``--input-key 'question' not found in data/train.jsonl:3; keys present: prompt, answer``.

For SFT, ``load_sft_pairs`` reads prompt/response pairs with the same reader and the same errors.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.config import split_data_path
from slime.config.settings.data import DataSettings
from slime.rollout.sample import Sample

logger = logging.getLogger(__name__)

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
    path, data_slice = data_file(spec)
    if path.endswith(PARQUET_SUFFIXES):
        records = _read_parquet(path, data_slice)
    else:
        records = _read_jsonl(path, data_slice)
    if not records:
        raise no_records(spec, data_slice)
    return records


def data_file(spec: str) -> tuple[str, slice | None]:
    """The file and the record slice of ``PATH`` or ``PATH@[start:end]``; ``DataError`` for a malformed
    slice or a file that does not exist (read in memory or indexed for streaming alike)."""
    try:
        path, data_slice = split_data_path(spec)
    except ValueError as e:
        raise DataError(str(e)) from e
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist; pass an existing JSONL or Parquet file")
    return path, data_slice


def no_records(spec: str, data_slice: slice | None) -> DataError:
    """The error for a file (slice) that holds no record."""
    what = f"the slice @[{_fmt_slice(data_slice)}] selects no records" if data_slice else "no records"
    return DataError(f"{spec}: {what}; check the file and the slice")


def _fmt_slice(s: slice) -> str:
    return f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"


def _read_jsonl(path: str, data_slice: slice | None) -> list[Record]:
    with open(path, encoding="utf-8") as f:
        lines = [(number, line) for number, line in enumerate(f, start=1) if line.strip()]
    if data_slice is not None:
        lines = lines[data_slice]
    return [jsonl_record(f"{path}:{number}", line) for number, line in lines]


def jsonl_record(where: str, line: str) -> Record:
    """One JSONL line as a Record; ``DataError`` naming ``where`` when it is not a JSON object."""
    data = _loads(
        line, lambda e: f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix or remove the line"
    )
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(data).__name__}")
    return Record(where, data)


def _loads(text: str, invalid: Callable[[json.JSONDecodeError], str]) -> Any:
    """``text`` parsed as JSON; when it is not JSON, a ``DataError`` whose message is ``invalid(error)``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(invalid(e)) from e


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
        value = _loads(
            value, lambda e: f"{flag} {key!r} in {record.where} is a string but not valid JSON ({e.msg})"
        )
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


def render_chat(
    tokenizer: Any, prompt: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """The prompt text the model sees: the chat template applied, with the assistant turn opened.

    A plain string is one user message. Public so that eval and custom generate code render alike.
    """
    text: str = tokenizer.apply_chat_template(
        _as_messages(prompt), tools=tools, tokenize=False, add_generation_prompt=True
    )
    return text


def load_tokenizer(hf_checkpoint: str) -> Any:
    """The HF tokenizer of a local checkpoint directory (imported lazily: transformers is slow to load)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_checkpoint)


@dataclass(frozen=True, kw_only=True)
class PromptFormat:
    """What the fields of a record mean and how its prompt is rendered: one ``Sample`` per record.

    Built once per data set (the tokenizer is loaded once), applied to each record by ``sample``, so
    that whoever reads the records, all at once or one at a time, turns them into the same Samples.
    """

    input_key: str = "input"
    """The prompt: a string or a list of chat messages; required in every record."""
    label_key: str | None = None
    """The label; required in every record when set (a JSON number becomes text)."""
    metadata_key: str | None = "metadata"
    """An optional object (or JSON string of one) that becomes ``Sample.metadata``."""
    tool_key: str | None = None
    """Optional tool specs (a list, or JSON string of one), kept in ``metadata["tools"]`` for custom
    generate functions and passed to the chat template."""
    tokenizer: Any = None
    """The model's HF tokenizer, for the chat template and the length cap."""
    apply_chat_template: bool = False
    """Render the prompt to text with ``tokenizer``."""
    max_prompt_len: int | None = None
    """Drop prompts whose rendered text is longer than this many tokens (needs ``tokenizer``)."""

    def __post_init__(self) -> None:
        if (self.apply_chat_template or self.max_prompt_len is not None) and self.tokenizer is None:
            raise ValueError("apply_chat_template and max_prompt_len need a tokenizer")

    @classmethod
    def from_settings(cls, data: DataSettings, tokenizer: bool = True) -> PromptFormat:
        """The training prompts' format: ``--input-key``, ``--label-key``, ``--metadata-key``,
        ``--tool-key``, ``--apply-chat-template``, ``--rollout-max-prompt-len``. (Each evaluation set
        builds its own, from its settings: ``slime.rollout.evaluation.load_eval_datasets``.) Without
        ``tokenizer`` (a driver's look at the fields alone) neither the template nor the cap applies."""
        max_prompt_len = data.max_prompt_len if tokenizer else None
        apply_chat_template = data.apply_chat_template and tokenizer
        loaded = None
        if apply_chat_template or max_prompt_len is not None:
            if data.tokenizer_path is None:
                raise DataError("--apply-chat-template and --rollout-max-prompt-len need --hf-checkpoint")
            loaded = load_tokenizer(data.tokenizer_path)
        return cls(
            input_key=data.input_key,
            label_key=data.label_key,
            metadata_key=data.metadata_key,
            tool_key=data.tool_key,
            tokenizer=loaded,
            apply_chat_template=apply_chat_template,
            max_prompt_len=max_prompt_len,
        )

    def columns(self, names: list[str]) -> list[str] | None:
        """Of a table's column ``names``, those ``sample`` reads, so a columnar reader (streamed Parquet)
        can skip the rest; None (every column) when one that ``sample`` requires is missing, so that its
        error lists every key the record has."""
        required = {self.input_key} if self.label_key is None else {self.input_key, self.label_key}
        if not required <= set(names):
            return None
        used = required | {self.metadata_key, self.tool_key}
        return [name for name in names if name in used]

    def sample(self, record: Record) -> Sample | None:
        """The PENDING ``Sample`` of ``record``, or None when its prompt is longer than ``max_prompt_len``."""
        if self.input_key not in record.data:
            raise _missing_key("--input-key", self.input_key, record)
        prompt = _check_prompt("--input-key", self.input_key, record)
        label = None
        if self.label_key is not None:
            if self.label_key not in record.data:
                raise _missing_key("--label-key", self.label_key, record)
            label = record.data[self.label_key]
            # JSON numbers (e.g. GSM8K answers) become text, as reward functions compare strings.
            if isinstance(label, (int, float)):
                label = str(label)
        metadata = {}
        if self.metadata_key is not None:
            metadata = dict(_json_field("--metadata-key", self.metadata_key, record, dict) or {})
        tools = None
        if self.tool_key is not None:
            tools = _json_field("--tool-key", self.tool_key, record, list)
            if tools is not None:
                metadata["tools"] = tools
        if self.apply_chat_template:
            try:
                prompt = render_chat(self.tokenizer, prompt, tools)
            except Exception as e:
                raise DataError(
                    f"--apply-chat-template failed on {record.where} ({type(e).__name__}: {e})"
                ) from e
        if self.max_prompt_len is not None:
            text = prompt if isinstance(prompt, str) else render_chat(self.tokenizer, prompt, tools)
            if len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) > self.max_prompt_len:
                return None
        return Sample(prompt=prompt, label=label, metadata=metadata)


def load_prompts(spec: str, prompt_format: PromptFormat | None = None) -> list[Sample]:
    """Read ``spec`` into one PENDING ``Sample`` per record (``PromptFormat()`` when no format is given);
    raises ``DataError`` when the length cap leaves none."""
    prompt_format = PromptFormat() if prompt_format is None else prompt_format
    samples = []
    dropped = 0
    for record in read_records(spec):
        sample = prompt_format.sample(record)
        if sample is None:
            dropped += 1
        else:
            samples.append(sample)
    max_prompt_len = prompt_format.max_prompt_len
    if dropped:
        logger.info("dropped %d prompt(s) of %s longer than %d tokens", dropped, spec, max_prompt_len)
    if not samples:
        raise DataError(
            f"every prompt of {spec} is longer than --rollout-max-prompt-len {max_prompt_len}; raise it"
        )
    return samples


def load_sft_pairs(
    spec: str, prompt_key: str, response_key: str
) -> list[tuple[str | list[dict[str, Any]], str]]:
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
