"""Prompt sets of 10k to 1M records: start-up time, memory and serving time, streaming vs in memory.

For each size (plain prompts, and with ``--apply-chat-template`` through a tiny model's tokenizer),
each source (``--streaming-data`` or not) and ``--num-data-workers`` 0 and 2, two fresh processes do
what a run does with its data, with the same slime code:

- the driver: in memory, ``make_data_source(data, args)`` (read, template, check every record) and pickling
  the source, which is what Ray ships to the rollout manager; streaming, ``check_streaming_data``;
- the rollout manager: in memory, unpickling that source; streaming, building its own from the path
  (index pass, workers started); then one rollout's prompts (``get_samples``), a pause standing in for
  the generation, and the next rollout's.

Peak RSS is sampled every 10 ms in each process; its worker processes' (summed) is reported apart.
"Above empty" subtracts the same configuration run on a one-record file, so imports and the tokenizer
do not count (start-up is reported both ways: loading a tokenizer takes seconds of its own). A full
JSON parse of the largest file is timed too: it is what a complete bad-line check before start-up
would cost (``--streaming-data`` checks a record when it is served).

The Parquet rows stream the same records from a Parquet file (200k rows in row groups of 65,536 by
default, plus a column no flag uses), shuffled and in file order: a shuffled rollout touches every
row group, which is decoded once per rollout, not once per prompt (issue 32, M7).

    python bench/data_scale.py
    python bench/data_scale.py --sizes 10000 100000 --rollout-batch-size 256
    python bench/data_scale.py --formats parquet --out bench/results/data_scale_parquet.json

Writes bench/results/data_scale.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = "--measure-one"
TEXT = "Find the sum of the digits of the smallest positive integer that satisfies the conditions below. "


def record(i: int) -> dict:
    """Record ``i`` of a generated file: math-like, ~330 bytes, as in the measured 1M-prompt file."""
    prompt = f"Problem {i}: {TEXT * 2}Answer with a number."
    return {"input": prompt, "label": str(i % 97), "metadata": {"id": i, "src": "gen"}}


def write_prompts(path: Path, n: int) -> Path:
    """``n`` records as JSONL."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(record(i)) + "\n")
    return path


def write_parquet(path: Path, n: int, row_group_size: int) -> Path:
    """``n`` records as Parquet, with a ``notes`` column of ~200 bytes per row that no flag reads (a
    streamed read decodes only the columns it uses)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{**record(i), "notes": f"note {i:07d}; " * 14} for i in range(n)])
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


class PeakRss:
    """The largest RSS of this process, and of its worker processes together, sampled every 10 ms by a
    thread (``ru_maxrss`` would not do: Linux carries it over from the forking parent)."""

    def __init__(self) -> None:
        self.own_mb = self.workers_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(0.01):
                return

    def _sample(self) -> None:
        me, workers = psutil.Process(), 0
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                workers += child.memory_info().rss
        self.own_mb = max(self.own_mb, me.memory_info().rss / 2**20)
        self.workers_mb = max(self.workers_mb, workers / 2**20)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return {"rss_mb": self.own_mb, "workers_rss_mb": self.workers_mb}


def run_args(config: dict) -> argparse.Namespace:
    from slime.config import build_parser

    argv = ["--prompt-data", config["data"], "--rollout-batch-size", str(config["rollout_batch_size"])]
    argv += ["--n-samples-per-prompt", "8", "--label-key", "label"]
    argv += ["--num-data-workers", str(config["workers"])]
    if config["shuffle"]:
        argv.append("--rollout-shuffle")
    if config["streaming"]:
        argv.append("--streaming-data")
    if config["template"]:
        argv += ["--apply-chat-template", "--hf-checkpoint", config["model"]]
    return build_parser().parse_args(argv)


def driver(config: dict) -> dict:
    from slime.config.settings.data import DataSettings
    from slime.rollout.data_source import check_streaming_data, make_data_source

    args = run_args(config)
    data = DataSettings.from_args(args)
    start = time.perf_counter()
    # What the driver hands the rollout manager (Ray pickles it): the index, or the whole source.
    shipped = check_streaming_data(data) if config["streaming"] else make_data_source(data, args)
    with open(config["pickle"], "wb") as f:
        pickle.dump(shipped, f, protocol=5)
    payload = os.path.getsize(config["pickle"])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "payload_mb": payload / 2**20}


def manager(config: dict) -> dict:
    from slime.config.settings.data import DataSettings
    from slime.rollout.data_source import make_data_source

    args = run_args(config)
    data = DataSettings.from_args(args)
    start = time.perf_counter()
    with open(config["pickle"], "rb") as f:
        shipped = pickle.load(f)
    source = make_data_source(data, args, shipped) if config["streaming"] else shipped
    built = time.perf_counter() - start
    timings = []
    for _ in range(2):
        start = time.perf_counter()
        source.get_samples(args.rollout_batch_size)
        timings.append(time.perf_counter() - start)
        time.sleep(config["generation_s"])  # the engines generate; the workers read ahead
    source.close()
    return {"seconds": built, "first_rollout_s": timings[0], "next_rollout_s": timings[1]}


def child(role: str, config: str) -> None:
    """Entry point of one measured process: prints ``role``'s result and peak RSS (its workers' apart)."""
    import slime.rollout.data_source  # noqa: F401 (imported before the baseline is taken)

    peak = PeakRss()
    result = {"driver": driver, "manager": manager}[role](json.loads(config))
    print(json.dumps({**result, **peak.stop()}))


def in_process(role: str, config: dict) -> dict:
    """``role`` run in a fresh interpreter."""
    argv = [sys.executable, __file__, CHILD, role, json.dumps(config)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(config: dict) -> dict:
    result = {"driver": in_process("driver", config), "manager": in_process("manager", config)}
    result["startup_s"] = result["driver"]["seconds"] + result["manager"]["seconds"]
    return result


def json_parse_pass_s(path: Path) -> float:
    start = time.perf_counter()
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                json.loads(line)
    return time.perf_counter() - start


def jsonl_runs(opts: argparse.Namespace, workdir: Path) -> list[dict]:
    """The grid of the module docstring: sizes x chat template x source x workers, shuffled."""
    from tools.make_tiny_model import make_tiny_model

    model = str(make_tiny_model(workdir / "model"))
    files = {n: write_prompts(workdir / f"prompts_{n}.jsonl", n) for n in [1, *opts.sizes]}
    runs = []
    for template in (False, True):
        for streaming in (False, True):
            for workers in opts.workers:
                empty = None
                for n in [1, *opts.sizes]:
                    config = {
                        "data": str(files[n]), "model": model, "template": template, "streaming": streaming,
                        "shuffle": True, "workers": workers, "generation_s": opts.generation_s,
                        "rollout_batch_size": min(opts.rollout_batch_size, n),
                        "pickle": str(workdir / "source.pkl"),
                    }  # fmt: skip
                    result = measure(config)
                    if n == 1:
                        empty = result
                        continue
                    above = {
                        role: result[role]["rss_mb"] - empty[role]["rss_mb"] for role in ("driver", "manager")
                    }
                    run = {
                        "prompts": n, "file_mb": files[n].stat().st_size / 2**20, "chat_template": template,
                        "streaming": streaming, "shuffle": True, "num_data_workers": workers, **result,
                        "driver_plus_manager_mb_above_empty": above["driver"] + above["manager"],
                        "startup_s_above_empty": result["startup_s"] - empty["startup_s"],
                    }  # fmt: skip
                    runs.append(run)
                    served = result["manager"]
                    print(
                        f"{n:>8} template={template!s:5} streaming={streaming!s:5} N={workers}: start-up "
                        f"{run['startup_s']:6.2f} s, +{run['driver_plus_manager_mb_above_empty']:7.1f} MB, "
                        f"rollout {served['first_rollout_s']:.3f} / {served['next_rollout_s']:.3f} s",
                        flush=True,
                    )
    return runs


def parquet_runs(opts: argparse.Namespace, workdir: Path) -> list[dict]:
    """One streamed Parquet file, in file order and shuffled, with each number of workers."""
    rows, group = opts.parquet_rows, opts.parquet_row_group
    path = write_parquet(workdir / "prompts.parquet", rows, group)
    runs = []
    for shuffle in (False, True):
        for workers in opts.workers:
            config = {
                "data": str(path), "template": False, "streaming": True, "shuffle": shuffle,
                "workers": workers, "rollout_batch_size": min(opts.rollout_batch_size, rows),
                "generation_s": opts.generation_s, "pickle": str(workdir / "source.pkl"),
            }  # fmt: skip
            result = measure(config)
            runs.append({
                "prompts": rows, "row_group_rows": group, "file_mb": path.stat().st_size / 2**20,
                "shuffle": shuffle, "num_data_workers": workers, **result,
            })  # fmt: skip
            served = result["manager"]
            print(
                f"parquet {rows} rows / groups of {group} shuffle={shuffle!s:5} N={workers}: start-up "
                f"{result['startup_s']:6.2f} s, rollout {served['first_rollout_s']:.3f} / "
                f"{served['next_rollout_s']:.3f} s",
                flush=True,
            )
    return runs


def main() -> None:
    if sys.argv[1:2] == [CHILD]:
        return child(*sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", choices=["jsonl", "parquet"], default=["jsonl", "parquet"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--parquet-rows", type=int, default=200_000)
    parser.add_argument("--parquet-row-group", type=int, default=65_536, help="rows per Parquet row group")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rollout-batch-size", type=int, default=512)
    parser.add_argument("--generation-s", type=float, default=1.0, help="pause standing in for a rollout")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "data_scale.json")
    opts = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="data_scale_"))
    result = {
        "benchmark": "data_scale",
        "date": time.strftime("%Y-%m-%d"),
        "config": {
            "rollout_batch_size": opts.rollout_batch_size, "n_samples_per_prompt": 8,
            "generation_s": opts.generation_s,
        },
        "machine": {
            "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "targets": {"streaming_startup_s": 2.0, "driver_plus_manager_mb_above_empty": 200},
    }  # fmt: skip
    if "jsonl" in opts.formats:
        result["runs"] = jsonl_runs(opts, workdir)
        largest = workdir / f"prompts_{max(opts.sizes)}.jsonl"
        result["json_parse_pass_s"] = {"prompts": max(opts.sizes), "seconds": json_parse_pass_s(largest)}
    if "parquet" in opts.formats:
        result["parquet_runs"] = parquet_runs(opts, workdir)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
