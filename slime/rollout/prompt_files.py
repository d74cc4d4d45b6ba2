"""Prompt files: reading JSONL / Parquet, checking their rows and turning them into ``Sample`` records.

Two steps, kept apart so each can change alone: ``read_records`` knows the file formats (JSONL,
Parquet, the ``PATH@[start:end]`` slice) and where each row came from; ``PromptFormat`` knows what a
row means (``--input-key``, ``--label-key``, ``--metadata-key``, ``--tool-key``, the chat template,
the prompt length cap). ``load_prompts`` joins them for a whole file. The training prompts
(``slime.rollout.data_source``) and the ``--eval-prompt-data`` sets are both read here, with the
same checks.

Bad data is one ``DataError`` line that names the file and line (JSONL, 1-based) or row (Parquet,
0-based), e.g. ``--input-key 'question' not found in data/train.jsonl:3; keys present: prompt, answer``.

Images (``--multimodal-keys '{"image": "images"}'``) are read with their record: the items of the
column are checked (a path must exist, relative to the prompt file; base64 is not decoded here), their
count must equal the prompt's image placeholders, and they are kept raw on ``Sample.multimodal_inputs``.

For SFT, ``load_sft_pairs`` reads prompt/response pairs with the same reader and the same errors.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.config import split_data_path
from slime.config.settings.data import DataSettings
from slime.rollout.sample import Sample
from slime.rollout.tokenizer_cache import load_tokenizer

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

    @property
    def path(self) -> str:
        """The file the record was read from (``where`` without its line or row)."""
        return self.where.rsplit(":", 1)[0]


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
    multimodal_keys: dict[str, str] | None = None
    """``--multimodal-keys``: modality (``"image"``) -> the field holding the record's items
    (``multimodal_items``); None for text-only data."""

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
            multimodal_keys=data.multimodal_keys,
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
        used = required | {self.metadata_key, self.tool_key, *(self.multimodal_keys or {}).values()}
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
        multimodal_inputs = None
        if self.multimodal_keys:
            multimodal_inputs = multimodal_items(self.multimodal_keys, record, prompt)
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
        return Sample(prompt=prompt, label=label, metadata=metadata, multimodal_inputs=multimodal_inputs)


IMAGE_PLACEHOLDER = "<image>"
"""An image's place in a string prompt (or in a chat message's text), as upstream slime writes it."""
IMAGE_PARTS = ("image", "image_url")
"""``type`` of the OpenAI-style content parts that stand for an image in a chat message."""
PIXEL_KEYS = ("min_pixels", "max_pixels")
_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_MIN_BASE64_LEN = 32
"""Shorter strings are never taken for base64 images (even a 1x1 PNG encodes to ~90 characters)."""


def count_image_placeholders(prompt: str | list[dict[str, Any]]) -> int:
    """Image placeholders of a prompt: ``<image>`` in a string or a message's text, plus each
    ``{"type": "image"}`` / ``{"type": "image_url", ...}`` part of a message's content list."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    count = 0
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str):
            count += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, str):
                    count += part.count(IMAGE_PLACEHOLDER)
                elif isinstance(part, dict):
                    if part.get("type") in IMAGE_PARTS:
                        count += 1
                    elif isinstance(part.get("text"), str):
                        count += part["text"].count(IMAGE_PLACEHOLDER)
    return count


def multimodal_items(
    keys: dict[str, str], record: Record, prompt: str | list[dict[str, Any]]
) -> dict[str, list[Any]] | None:
    """``Sample.multimodal_inputs`` of ``record`` (``{"image": [item, ...]}`` in prompt order), or None
    when it has no item. ``DataError`` (naming ``file:line``) for an ill-formed item, a path that does not
    exist, or item and placeholder counts that differ. Items stay raw (nothing is decoded); a relative
    path becomes the absolute path of the file it names, so it is found from any process."""
    out: dict[str, list[Any]] = {}
    for modality, key in keys.items():
        value = record.data.get(key)
        if isinstance(value, tuple):
            value = list(value)
        if value is None:
            raw: list[Any] = []
        elif isinstance(value, list):
            raw = value
        else:
            raw = [value]  # a single item
        items = [_image_item(key, record, i, item) for i, item in enumerate(raw)]
        placeholders = count_image_placeholders(prompt)
        if placeholders != len(items):
            held = f"{key!r} holds {len(items)}" if key in record.data else f"has no {key!r} field, so 0"
            raise DataError(
                f"{record.where}: the prompt has {placeholders} image placeholder(s) but the record "
                f"{held} image(s); write one {IMAGE_PLACEHOLDER} (or {{'type': 'image'}} message part) "
                f"per item of {key!r}, in order (--multimodal-keys)"
            )
        if items:
            out[modality] = items
    return out or None


def _image_item(key: str, record: Record, i: int, item: Any) -> Any:
    """One image item checked (cheaply: a path exists, base64 looks like base64), kept raw."""
    what = f"{key}[{i}] in {record.where}"
    if isinstance(item, dict):
        unknown = set(item) - {"image", "type", *PIXEL_KEYS}
        if unknown or "image" not in item or item.get("type") not in (None, "image"):
            raise DataError(
                f"{what}: an image dict is {{'image': <path or base64>, 'min_pixels': N, 'max_pixels': N}}, "
                f"got keys {', '.join(sorted(item))}; fix the item"
            )
        for pixels in PIXEL_KEYS:
            value = item.get(pixels)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise DataError(f"{what}: {pixels} must be a positive integer, got {value!r}")
        low, high = item.get("min_pixels"), item.get("max_pixels")
        if low is not None and high is not None and low > high:
            raise DataError(f"{what}: min_pixels {low} is greater than max_pixels {high}; swap or fix them")
        return {**item, "image": _image_source(what, record, item["image"])}
    return _image_source(what, record, item)


def _image_source(what: str, record: Record, source: Any) -> str:
    """A path (made absolute; it must exist) or a base64 string (with or without a ``data:`` prefix)."""
    if not isinstance(source, str) or not source:
        raise DataError(
            f"{what}: an image is a path or a base64 string (or a dict with 'image'), "
            f"got {type(source).__name__}"
        )
    if source.startswith("data:"):
        match = _DATA_URL.match(source)
        if match is None or not _BASE64.fullmatch(source[match.end() :]):
            raise DataError(f"{what}: {source[:40]!r}... is not a data:image/<format>;base64,<data> URL")
        return source
    path = source if os.path.isabs(source) else os.path.join(os.path.dirname(record.path), source)
    if os.path.isfile(path):
        return os.path.abspath(path)
    if len(source) >= _MIN_BASE64_LEN and len(source) % 4 == 0 and _BASE64.fullmatch(source):
        return source
    raise DataError(
        f"{what}: image file {path} does not exist; fix the path (relative paths are read from the "
        "prompt file's directory) or give the image as base64"
    )


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
