"""--streaming-data and --num-data-workers: the same prompts in the same order as the in-memory source,
bad lines named by file:line, and worker processes that change nothing but speed."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from slime.config import build_parser
from slime.config.settings.data import DataSettings
from slime.rollout.data_source import PromptDataSource, check_streaming_data
from slime.rollout.lazy_prompts import LazyPrompts, read_all
from slime.rollout.prompt_files import DataError, PromptFormat, load_prompts
from slime.rollout.prompt_index import PromptIndex
from slime.rollout.prompt_workers import PromptWorkers
from slime.rollout.sample import Sample


class CharTokenizer:
    """One token per character, and a chat template that only wraps: enough for the length cap."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def prompt_file(path: Path, n: int) -> Path:
    """``n`` records of growing length, with blank lines between some (they are not records)."""
    lines = []
    for i in range(n):
        lines.append(json.dumps({"input": f"q{i}" + "x" * (i % 7), "label": str(i), "metadata": {"i": i}}))
        if i % 5 == 0:
            lines.append("  " if i % 2 else "")
    path.write_text("\n".join(lines) + "\n")
    return path


MAX_PROMPT_LEN = 24
FORMAT = PromptFormat(
    label_key="label", tokenizer=CharTokenizer(), apply_chat_template=True, max_prompt_len=MAX_PROMPT_LEN
)
SOURCE = {"n_samples_per_prompt": 2, "shuffle": True, "seed": 7}


def in_memory(spec: str, num_workers: int = 0) -> PromptDataSource:
    lazy = LazyPrompts(PromptIndex.build(spec), FORMAT)
    workers = PromptWorkers(lazy, num_workers) if num_workers else None
    try:
        return PromptDataSource(read_all(lazy, workers, True), **SOURCE)
    finally:
        if workers is not None:
            workers.close()


def streaming(spec: str, num_workers: int = 0) -> PromptDataSource:
    lazy = LazyPrompts(PromptIndex.build(spec), FORMAT)
    workers = PromptWorkers(lazy, num_workers) if num_workers else None
    return PromptDataSource(lazy, **SOURCE, workers=workers, prefetch=4 if workers else 0)


def serve(
    make: Callable[[], PromptDataSource], rounds: int, ckpt: Path, save_at: int | None = None
) -> list[dict]:
    """``rounds`` calls of get_samples(3), each returning one of its groups (as an aborted rollout does);
    with ``save_at``, the position is saved after that call and a fresh source loads it and goes on."""
    source, served = make(), []
    for call in range(rounds):
        groups = source.get_samples(3)
        served += [sample.to_dict() for group in groups for sample in group]
        source.add_samples([groups[call % 3]])
        if call == save_at:
            source.save(call, ckpt)
            source.close()
            source = make()
            assert source.load(call, ckpt)
    source.close()
    return served


def test_streaming_serves_what_memory_serves_over_three_epochs_with_slices_buffer_and_resume(tmp_path):
    spec = f"{prompt_file(tmp_path / 'd.jsonl', 30)}@[2:-3]"  # records 2..26
    memory = in_memory(spec)
    kept = sum(17 + len(f"q{i}") + i % 7 <= MAX_PROMPT_LEN for i in range(2, 27))  # the rendered length
    assert len(memory) == 25 and sum(isinstance(p, Sample) for p in memory.prompts) == kept == 19
    expected = serve(lambda: memory, 30, tmp_path)  # 61 fresh prompts: 3 epochs and a bit
    assert memory.epoch == 3
    for save_at in (None, 13):  # 13: mid-epoch 1, with returned groups in the buffer
        assert serve(lambda: streaming(spec), 30, tmp_path / "ckpt", save_at) == expected
    # Without a cap the in-memory source holds what prompt_files.load_prompts reads, in file order.
    plain = PromptFormat(label_key="label")
    assert read_all(LazyPrompts(PromptIndex.build(spec), plain), None, True) == load_prompts(spec, plain)


@pytest.mark.e2e  # worker processes
def test_num_data_workers_serve_the_same_order_and_stop_with_the_source(tmp_path):
    spec = f"{prompt_file(tmp_path / 'd.jsonl', 30)}@[2:-3]"
    expected = serve(lambda: streaming(spec), 20, tmp_path)
    sources = []

    def with_workers() -> PromptDataSource:
        sources.append(streaming(spec, num_workers=2))
        return sources[-1]

    assert serve(with_workers, 20, tmp_path / "ckpt", save_at=9) == expected
    assert serve(lambda: in_memory(spec, num_workers=2), 20, tmp_path) == expected
    pids = [pid for source in sources for pid in source.workers.pids()]
    assert pids and not any(psutil.pid_exists(pid) for pid in pids)


def test_a_malformed_line_500000_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "big.jsonl"
    good = b'{"input": "q"}\n'
    path.write_bytes(good * 499_999 + b'{"input": "q",}\n' + good * 10)
    started = time.perf_counter()
    index = PromptIndex.build(str(path))
    assert len(index) == 500_010 and time.perf_counter() - started < 5
    message = rf"^{re.escape(str(path))}:500000: not valid JSON \(.*\); fix or remove the line$"
    args = build_parser().parse_args(["--prompt-data", f"{path}@[499997:]", "--rollout-batch-size", "4"])
    data = DataSettings.from_args(args)
    assert len(check_streaming_data(data)) == 13  # the driver looks at the structure and line 499998
    data = dataclasses.replace(data, streaming_data=True)
    source = PromptDataSource.from_settings(data, args)
    source.get_samples(2)  # lines 499998 and 499999
    with pytest.raises(DataError, match=message):
        source.get_samples(1)
    data = dataclasses.replace(data, on_bad_prompt="skip")
    source = PromptDataSource.from_settings(data, args)
    assert len(source.get_samples(15)) == 15 and source.skipped == 2  # once in each of two epochs
    data = dataclasses.replace(
        data, streaming_data=False, on_bad_prompt="stop"
    )  # in memory: before anything starts
    with pytest.raises(DataError, match=message):
        PromptDataSource.from_settings(data, args)


def test_the_driver_check_names_a_wrong_key_and_structural_problems(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "a"}\n{"question": "b"}\n')
    data = DataSettings.from_args(build_parser().parse_args(["--prompt-data", str(path), "--streaming-data"]))
    with pytest.raises(DataError, match=rf"--input-key 'input' not found in {re.escape(str(path))}:1"):
        check_streaming_data(data)
    path.write_bytes(b'{"input": "a"}\r{"input": "b"}\r\n')
    with pytest.raises(DataError, match=r":1: a carriage return without a newline"):
        check_streaming_data(data)
    path.write_text('{"input": "a"}')  # no final newline: still one record
    assert len(check_streaming_data(data)) == 1
    data = dataclasses.replace(data, prompt_data=f"{path}@[3:]")
    with pytest.raises(DataError, match=r"the slice @\[3:\] selects no records"):
        check_streaming_data(data)


def test_parquet_streams_through_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"input": f"q{i}", "label": str(i)} for i in range(20)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=6)
    spec = f"{path}@[3:17]"
    plain = PromptFormat(label_key="label")
    lazy = LazyPrompts(PromptIndex.build(spec), plain)
    assert [lazy[i] for i in (13, 0, 7)] == [load_prompts(spec, plain)[i] for i in (13, 0, 7)]
    assert lazy.index.where(0) == f"{path}:row 3"


def test_a_shuffled_parquet_batch_decodes_each_row_group_once_and_only_the_used_columns(
    tmp_path, monkeypatch
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"input": f"q{i}", "label": str(i), "metadata": json.dumps({"i": i}), "unused": "x" * 50}
        for i in range(60)
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=6)  # 10 row groups
    spec = f"{path}@[2:58]"
    plain = PromptFormat(label_key="label")
    reads: list[tuple[int, list[str] | None]] = []
    read_row_group = pq.ParquetFile.read_row_group

    def counted(self, i, columns=None, **kwargs):
        reads.append((i, columns))
        return read_row_group(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    streamed = PromptDataSource(LazyPrompts(PromptIndex.build(spec), plain), shuffle=True, seed=3)
    served = streamed.get_samples(16)
    order = list(range(56))
    random.Random(3).shuffle(order)  # the epoch's order, as it always was
    assert [group[0].prompt for group in served] == [f"q{2 + r}" for r in order[:16]]
    memory = PromptDataSource(load_prompts(spec, plain), shuffle=True, seed=3)  # the whole table read at once
    assert served == memory.get_samples(16)
    used = ["input", "label", "metadata"]
    assert reads == [(group, used) for group in sorted({(2 + r) // 6 for r in order[:16]})]
    reads.clear()  # in memory: the file read in order, each row group once
    assert read_all(LazyPrompts(PromptIndex.build(spec), plain), None, True) == load_prompts(spec, plain)
    assert reads == [(group, used) for group in range(10)]
    # A missing key is named with every column of the file, as when the whole row is read.
    wrong = LazyPrompts(PromptIndex.build(spec), PromptFormat(input_key="question"))[0]
    keys = ", ".join(rows[0])
    assert wrong.message == f"--input-key 'question' not found in {path}:row 2; keys present: {keys}"


@pytest.mark.e2e  # worker processes
def test_workers_exit_when_their_owner_is_killed(tmp_path):
    """A Ray actor killed by ``ray.kill`` runs no shutdown: its workers must notice and exit by themselves."""
    import os
    import signal
    import subprocess
    import sys

    spec = prompt_file(tmp_path / "d.jsonl", 10)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER.format(spec=str(spec))],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    pids = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids):
        assert time.monotonic() < deadline, "a worker outlived its owner"
        time.sleep(0.2)


OWNER = """
import numpy as np, time
from slime.rollout.lazy_prompts import LazyPrompts
from slime.rollout.prompt_files import PromptFormat
from slime.rollout.prompt_index import PromptIndex
from slime.rollout.prompt_workers import PromptWorkers

workers = PromptWorkers(LazyPrompts(PromptIndex.build("{spec}"), PromptFormat()), 2)
futures = [workers.submit(np.arange(5)) for _ in range(4)]
[f.result() for f in futures]
print(*workers.pids(), flush=True)
time.sleep(60)
"""
