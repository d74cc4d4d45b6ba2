"""Starting and stopping an engine leaves nothing in /dev/shm.

Other processes of the machine create files there too, so each test looks only at the names its own
processes could have made: ``torch_<pid>_*`` (torch's shared-memory storages, named after the pid that
made them), and any file a process of the engine's group held mapped or open while it ran.

The torch engine is one process and makes no file there; the colocated handoff's file is the
sender's, and goes as soon as the sender frees its staging buffer (``TensorWeightUpdater.disconnect``
does: left to the end of a trainer actor, which Ray SIGKILLs together with torch's shared-memory
manager, the process that would have unlinked it, it stayed).

The second test is about the stop order. SGLang's server is several processes (``mp.set_start_method(
"spawn")`` in ``srt/entrypoints/engine.py``); on SIGTERM its tokenizer manager has the schedulers exit
(``ShutdownReq``) and then SIGKILLs every child left (``kill_process_tree(os.getpid(),
include_parent=False)``: ``sigterm_watchdog`` in ``srt/managers/tokenizer_manager.py``, 0.5.19 and
0.5.23), multiprocessing's resource tracker included; a scheduler has no SIGTERM handler of its own.
A SIGTERM to the whole process group killed the children before that shutdown, without their exit
handlers, and the semaphores they had made stayed. ``SERVER`` is a server of that shape.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from slime.backends.engine_server import start_engine_server
from slime.backends.torch_engine.launcher import serving
from slime.backends.torch_engine.weights import iter_safetensors
from slime.engine_client.weight_updates import weight_update_session
from slime.utils.http import ServerProcess, post_json_sync
from slime.weight_sync import ipc

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)"),
]

SHM = Path("/dev/shm")


def group_pids(pgid: int) -> set[int]:
    """The running processes of process group ``pgid``."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.add(int(entry))
            except ProcessLookupError:
                continue
    return pids


def shm_files_in_use(pids: set[int]) -> set[str]:
    """Names in /dev/shm that ``pids`` hold mapped or open."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                paths = [line.split()[-1] for line in maps if "/dev/shm/" in line]
            paths += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        names.update(Path(p).name for p in paths if p.startswith("/dev/shm/"))
    return names


def made_by(pids: set[int]) -> set[str]:
    """Names in /dev/shm of torch storages that ``pids`` made."""
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    return {name for name in os.listdir(SHM) if name.startswith(prefixes)}


def test_a_torch_engine_started_used_and_stopped_leaves_nothing_in_dev_shm(tiny_models, tmp_path):
    model = tiny_models["qwen2"]
    before = set(os.listdir(SHM))
    command = serving(model, "--log-level", "warning")
    engine = start_engine_server(
        "torch engine", command, tmp_path / "engine.log", timeout_s=120, env={"OMP_NUM_THREADS": "1"}
    )
    try:
        pids = group_pids(engine.process.pid)
        post_json_sync(
            f"{engine.url}/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
        )
        # The colocated handoff: the engine maps this process's shared-memory buffer and copies from it.
        staging = ipc.StagingBuffer()
        bucket = staging.pack(next(ipc.split_by_dtype(iter_safetensors(str(model)))))
        with weight_update_session([engine.url], 60):
            reply = post_json_sync(
                f"{engine.url}/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [ipc.serialize(bucket.payload())],
                    "load_format": "flattened_bucket",
                    "weight_version": "shm",
                },
            )
        assert reply["success"], reply
        pids |= group_pids(engine.process.pid)
        engine_files = (shm_files_in_use(pids) | made_by(pids)) - before
        mine = made_by({os.getpid()}) - before
        assert mine, "the handoff made no shared-memory file: this test checks nothing"
        del bucket  # a view of the staging buffer
        staging.free()
    finally:
        engine.stop()
    left = set(os.listdir(SHM))
    engine_left = (engine_files & left) | made_by(pids)
    assert not engine_left, f"the engine left {sorted(engine_left)} in /dev/shm"
    assert not mine & left, f"the freed handoff buffer left {sorted(mine & left)} in /dev/shm"


SERVER = """
import contextlib
import multiprocessing as mp
import signal
import sys
import time

import psutil


def scheduler(name_file, requests):
    lock = mp.get_context("spawn").Lock()  # a named semaphore; its finalizer unlinks it at a normal exit
    with open(name_file, "w") as out:
        out.write(lock._semlock.name)
    requests.recv()  # the shutdown request: return, exit normally


def shut_down(signum, frame):
    with contextlib.suppress(OSError):  # like ShutdownReq: the schedulers exit by themselves
        to_scheduler.send("shutdown")
    child.join(10)
    for process in psutil.Process().children(recursive=True):  # like kill_process_tree
        process.kill()
    sys.exit(0)


if __name__ == "__main__":
    to_scheduler, requests = mp.get_context("spawn").Pipe()
    signal.signal(signal.SIGTERM, shut_down)
    child = mp.get_context("spawn").Process(target=scheduler, args=(sys.argv[1], requests))
    child.start()
    while True:
        time.sleep(1)
"""


def test_stop_lets_a_server_of_several_processes_shut_them_down_so_their_semaphores_go(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    name_file = tmp_path / "semaphore"
    server = ServerProcess(
        "sglang-shaped server",
        [sys.executable, str(script), str(name_file)],
        tmp_path / "log",
        dict(os.environ),
    )
    server.start()
    try:
        server.wait_ready(lambda: name_file.exists() and name_file.read_text() != "", 60, interval_s=0.05)
        semaphore = SHM / ("sem." + name_file.read_text().lstrip("/"))
        assert semaphore.exists(), f"{semaphore} was not made: this test checks nothing"
    finally:
        server.stop()
    assert server.exit_code() == 0, server.log_tail()
    assert not semaphore.exists(), f"{semaphore.name} stayed in /dev/shm after the server stopped"
