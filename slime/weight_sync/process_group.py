"""The trainer -> engine weight-update process group, as SGLang builds it.

SGLang's engine joins a group made by `init_custom_process_group(backend,
init_method="tcp://addr:port", world_size, rank=rank_offset, group_name)`: torch's tcp rendezvous (a
TCPStore hosted by rank 0, the trainer), wrapped in `PrefixStore(group_name)`, then torch's
`_new_process_group_helper`, which prefixes `"<group_name>/"` and the device (`"cpu/"` for gloo,
`"cuda/"` for nccl) before building the backend. `create_weight_update_group` builds the very same
store chain and backend with public classes only (TCPStore, PrefixStore, ProcessGroupGloo /
ProcessGroupNCCL) and uses the backend object directly, so the engine needs no default process group
and disturbs no global torch.distributed state, while a trainer that uses SGLang's recipe (or this
function) meets it at the same rendezvous keys. Every collective uses the group's timeout, so a missing
peer fails the call instead of hanging it.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from slime.utils.http import listening_socket_fd

DEFAULT_TIMEOUT_S = 300.0


def create_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) a weight-update group; returns the backend (gloo or nccl) object.

    Same rendezvous as SGLang's engine and trainer side (see the module docstring). Blocks until all
    `world_size` ranks have joined or `timeout_s` passed (then raises).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
        # on master_address alone (by itself the store listens on every interface)
        master_listen_fd=listening_socket_fd(master_address, int(master_port)) if rank == 0 else None,
    )
    store = dist.PrefixStore(group_name, store)
    store = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, world_size, timeout)
    elif backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA; this process runs on the CPU, use backend gloo")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, world_size, options)
    else:
        raise ValueError(f"unsupported weight-update backend {backend!r} (use gloo or nccl)")
    if hasattr(group, "_set_sequence_number_for_group"):
        group._set_sequence_number_for_group()  # what torch's helper does after building a backend
    return group


def start_broadcast_from_rank0(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> dist.Work:
    """Start receiving (or, on rank 0, sending) `tensor` in place; `wait` on the result (see below)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = datetime.timedelta(seconds=timeout_s)
    return group.broadcast([tensor], options)


def broadcast_from_rank0(
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    timeout_s: float,
    stop: Callable[[], BaseException | None] | None = None,
) -> None:
    """Receive (or, on rank 0, send) `tensor` in place; raises if the peer does not show up in time,
    or what `stop` returns as soon as it returns something (see `wait_for_work`)."""
    wait_for_work(start_broadcast_from_rank0(group, tensor, timeout_s), timeout_s, stop)


# Groups whose collective was given up on. Destroying one blocks until its pending operation times
# out (gloo joins its worker thread; NCCL waits for the kernel), so they are kept, unused, instead.
_ABANDONED: list[dist.ProcessGroup] = []

POLL_S = 0.005


def wait_for_work(
    work: dist.Work, timeout_s: float, stop: Callable[[], BaseException | None] | None = None
) -> None:
    """Waits for a started collective; raises what ``stop`` returns as soon as it returns something.

    A weight update is a collective plus an HTTP call on every engine. An engine that refuses the
    call never joins the collective, which would then hang until its timeout: polling ``stop``
    (which looks at the HTTP replies) turns that refusal into an error within a poll interval.
    """
    if stop is None:
        work.wait(datetime.timedelta(seconds=timeout_s))
        return
    # Woken by the collective's own future, not by the poll: a fixed sleep added up to a poll interval
    # to every bucket on both sides of the push (the quickstart's push is one bucket of 2 MB).
    finished = threading.Event()
    work.get_future().add_done_callback(lambda _: finished.set())
    deadline = time.monotonic() + timeout_s
    while not finished.wait(POLL_S):
        failure = stop()
        if failure is not None:
            raise failure
        if time.monotonic() >= deadline:
            raise TimeoutError(f"a weight-update collective did not finish within {timeout_s:.0f} s")
    work.wait(datetime.timedelta(seconds=timeout_s))  # raises the collective's own error, if any


def abandon_group(group: dist.ProcessGroup | None) -> None:
    """Drops a group whose last collective may still be pending, without blocking on it.

    An NCCL group is aborted first: its watchdog would otherwise end the whole process when the
    pending collective times out. gloo has no such watchdog, and its ``abort`` does not end a wait.
    """
    if group is None:
        return
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None and isinstance(group, nccl):
        with contextlib.suppress(Exception):
            group.abort()
    _ABANDONED.append(group)
