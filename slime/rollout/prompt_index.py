"""Where each record of a prompt file starts, so ``--streaming-data`` can read any record on demand.

``PromptIndex.build`` makes one pass over the file and keeps a few bytes per record (numpy arrays,
not Python objects): for JSONL the byte offset of each record's line (8 bytes) and its 1-based line
number (4 bytes, for errors); for Parquet the row number, read back through the file's row groups.
The ``PATH@[start:end]`` slice counts records exactly as ``prompt_files.read_records`` does (blank
JSONL lines are not records), so a record's position in the index is its position in the in-memory
list. The pass checks the file's structure only (it exists, it has records, the slice selects some,
its lines end in ``\\n``); a record's content is checked when ``RecordReader`` reads it.

The pass runs at numpy speed: 0.4 s for a 1M-line, 330 MB file (docs/guides/large-prompt-sets.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from slime.rollout.prompt_files import (
    PARQUET_SUFFIXES,
    DataError,
    Record,
    data_file,
    jsonl_record,
    no_records,
)

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

CHUNK_BYTES = 8 << 20

# A line counts as blank when ``str.strip`` leaves nothing, as in ``read_records``. Lines that start
# with one of these bytes (ASCII whitespace, or a multi-byte character that may be Unicode whitespace)
# are decoded and checked one by one; every other line is a record without a look.
_MAYBE_BLANK = np.zeros(256, dtype=bool)
_MAYBE_BLANK[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
_MAYBE_BLANK[0x80:] = True


@dataclass(frozen=True, eq=False)
class PromptIndex:
    """The records of one (sliced) prompt file, by position: record ``i`` of the slice is at
    ``positions[i]``."""

    path: str
    positions: np.ndarray
    """JSONL: the byte offset of each record's line (int64); Parquet: its row number in the file."""
    lines: np.ndarray | None
    """JSONL: each record's 1-based line number (uint32); None for Parquet."""

    @classmethod
    def build(cls, spec: str) -> PromptIndex:
        """Index ``PATH`` or ``PATH@[start:end]``; ``DataError`` for a missing file, a structural problem
        or when no record is left."""
        path, data_slice = data_file(spec)
        if path.endswith(PARQUET_SUFFIXES):
            positions, lines = _parquet_rows(path), None
        else:
            positions, lines = _jsonl_lines(path)
        if data_slice is not None:
            positions = positions[data_slice]
            lines = None if lines is None else lines[data_slice]
        if not len(positions):
            raise no_records(spec, data_slice)
        return cls(path, positions, lines)

    def __len__(self) -> int:
        return len(self.positions)

    def where(self, record: int) -> str:
        """``path:line`` or ``path:row N``, as ``read_records`` names the same record."""
        if self.lines is None:
            return f"{self.path}:row {self.positions[record]}"
        return f"{self.path}:{self.lines[record]}"


def _jsonl_lines(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets and line numbers of the non-blank lines, a chunk of the file at a time."""
    offsets: list[np.ndarray] = [np.empty(0, np.int64)]
    numbers: list[np.ndarray] = [np.empty(0, np.uint32)]
    with open(path, "rb") as f:
        tail = b""  # the unfinished last line of the previous chunk
        base = 0  # file offset of ``tail``'s first byte
        lines_before = 0
        while True:
            chunk = f.read(CHUNK_BYTES)
            buf = tail + chunk
            if not buf:
                break
            data = np.frombuffer(buf, dtype=np.uint8)
            ends = np.flatnonzero(data == 10)
            if not chunk:  # the last line, without a newline
                ends = np.append(ends, len(buf))
            if not len(ends):  # one line longer than a chunk: read on
                tail = buf
                continue
            consumed = min(int(ends[-1]) + 1, len(buf))
            _refuse_bare_cr(path, data[:consumed], ends, lines_before)
            starts = np.concatenate(([0], ends[:-1] + 1))
            filled = starts < ends
            keep = filled & ~_MAYBE_BLANK[data[np.minimum(starts, len(buf) - 1)]]
            for i in np.flatnonzero(filled & ~keep):
                keep[i] = bool(buf[starts[i] : ends[i]].decode("utf-8", "replace").strip())
            offsets.append(base + starts[keep])
            numbers.append((lines_before + 1 + np.flatnonzero(keep)).astype(np.uint32))
            lines_before += len(ends)
            tail, base = buf[consumed:], base + consumed
            if not chunk:
                break
    return np.concatenate(offsets).astype(np.int64), np.concatenate(numbers)


def _refuse_bare_cr(path: str, data: np.ndarray, ends: np.ndarray, lines_before: int) -> None:
    """A ``\\r`` not followed by ``\\n`` ends a line for Python's text reader (``read_records``) but
    not for this index; such files (old Mac line endings) are refused rather than read differently."""
    cr = np.flatnonzero(data[:-1] == 13)
    bare = cr[data[cr + 1] != 10]
    if len(bare):
        line = lines_before + 1 + int(np.searchsorted(ends, bare[0]))
        raise DataError(f"{path}:{line}: a carriage return without a newline; use \\n line endings")


def _parquet_rows(path: str) -> np.ndarray:
    import pyarrow.parquet as pq

    try:
        num_rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as e:
        raise DataError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from e
    return np.arange(num_rows, dtype=np.int64)


class RecordReader:
    """Reads records of an index back from its file: a JSONL line by its offset; Parquet rows a batch at a
    time, each row group the batch touches decoded once, with only the columns the caller uses.

    A shuffled batch touches most row groups, and decoding a whole row group per row served cost five
    times an unshuffled read (issue 32, M7). The last row group decoded is kept, so reading in file
    order decodes each once. Picklable: the open file is not part of its state, so each worker process
    opens its own.
    """

    def __init__(
        self, index: PromptIndex, columns: Callable[[list[str]], list[str] | None] | None = None
    ) -> None:
        """``columns``: given a Parquet file's column names, those to decode (None: every column)."""
        self.index = index
        self.columns = columns
        self._file: BinaryIO | None = None
        self._parquet: pq.ParquetFile | None = None
        self._read_columns: list[str] | None = None
        self._group: tuple[int, pa.Table] | None = None  # the last row group decoded: (its number, its rows)
        self._group_starts: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"index": self.index, "columns": self.columns}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["index"], state["columns"])

    def read(self, records: Sequence[int] | np.ndarray) -> Sequence[Record | DataError]:
        """The raw records at these index positions, in order; a malformed one is its ``DataError``."""
        if self.index.lines is None:
            return self._parquet_records(np.asarray(records, dtype=np.int64))
        return [self._jsonl_record(int(r)) for r in records]

    def _jsonl_record(self, record: int) -> Record | DataError:
        if self._file is None:
            self._file = open(self.index.path, "rb")  # noqa: SIM115 (kept open for the next reads)
        self._file.seek(int(self.index.positions[record]))
        where = self.index.where(record)
        try:
            return jsonl_record(where, self._file.readline().decode("utf-8"))
        except UnicodeDecodeError as e:
            return DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start}); fix or remove the line")
        except DataError as e:
            return e

    def _parquet_records(self, records: np.ndarray) -> list[Record]:
        """The rows at these index positions, in order, decoded a row group at a time (in file order, so
        the group kept last is where a read in file order goes on)."""
        if self._parquet is None:
            self._open_parquet()
        starts = self._group_starts
        assert starts is not None  # set by _open_parquet
        rows = self.index.positions[records]
        groups = np.searchsorted(starts, rows, side="right") - 1
        found: dict[int, Record] = {}  # by place in ``records``
        for group in np.unique(groups).tolist():
            at = np.flatnonzero(groups == group)
            data = self._row_group(group).take(rows[at] - starts[group]).to_pylist()
            for i, item in zip(at.tolist(), data, strict=True):
                found[i] = Record(self.index.where(int(records[i])), item)
        return [found[i] for i in range(len(records))]

    def _open_parquet(self) -> None:
        import pyarrow.parquet as pq

        parquet = self._parquet = pq.ParquetFile(self.index.path)
        metadata = parquet.metadata
        self._group_starts = np.cumsum(
            [0, *(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))]
        )
        if self.columns is not None:
            self._read_columns = self.columns(parquet.schema_arrow.names)

    def _row_group(self, group: int) -> pa.Table:
        if self._group is None or self._group[0] != group:
            self._group = None  # free the kept group before decoding the next
            assert self._parquet is not None  # opened by _parquet_records
            self._group = (group, self._parquet.read_row_group(group, columns=self._read_columns))
        return self._group[1]
