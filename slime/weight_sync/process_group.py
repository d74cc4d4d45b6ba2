"""The trainer -> engine weight-update process group, as SGLang builds it.

SGLang's engine joins a group made by `init_custom_process_group(backend,
init_method="tcp://addr:port", world_size, rank=rank_offset, group_name)`: torch's tcp rendezvous (a
TCPStore hosted by rank 0, the trainer), wrapped in `PrefixStore(group_name)`, then torch's
`_new_process_group_helper`, which prefixes `"<group_name>/"` and the device (`"cpu/"` for gloo,
`"cuda/"` for nccl) before building the backend. `create_weight_update_group` builds the very same
store chain and backend with public classes only (TCPStore, PrefixStore, ProcessGroupGloo /
ProcessGroupNCCL) and uses the backend object directly, so the engine needs no default process group
and disturbs no global torch.distributed state, while a trainer that uses SGLang's recipe (or this
function) meets it at the same rendezvous keys. A broadcast's waiter (``wait_for_work``) gives up at the
caller's timeout with its own error; the transport's own timeouts run ``TRANSPORT_TIMEOUT_MARGIN_S``
longer, as a backstop that never races it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.distributed as dist

from slime.utils.http import listening_socket_fd

DEFAULT_TIMEOUT_S = 300.0

# How much longer than the waiter's timeout a gloo broadcast and the NCCL watchdog wait. The waiter must
# give up first: its error names the peer, and NCCL's watchdog ends the whole process when a collective
# outlives the group's timeout, unless the caller has aborted the group by then (``abandon_group``).
TRANSPORT_TIMEOUT_MARGIN_S = 60.0


class WeightGroup(Protocol):
    """The backend ``create_weight_update_group`` builds (``ProcessGroupGloo`` / ``ProcessGroupNCCL``),
    used directly: what the weight-update code calls on it."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...
    def rank(self) -> int: ...
    def size(self) -> int: ...
    def abort(self) -> None: ...


def create_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) a weight-update group; returns the backend (gloo or nccl) object.

    Same rendezvous as SGLang's engine and trainer side (see the module docstring). Blocks until all
    `world_size` ranks have joined or `timeout_s` passed (then raises).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store: dist.Store = dist.TCPStore(
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
    group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
    if backend == "gloo":
        group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, world_size, timeout)
    elif backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA; this process runs on the CPU, use backend gloo")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout + datetime.timedelta(seconds=TRANSPORT_TIMEOUT_MARGIN_S)  # the watchdog's
        group = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, world_size, options)
    else:
        raise ValueError(f"unsupported weight-update backend {backend!r} (use gloo or nccl)")
    if hasattr(group, "_set_sequence_number_for_group"):
        group._set_sequence_number_for_group()  # what torch's helper does after building a backend
    return cast(WeightGroup, group)  # torch's stubs leave the backends' collectives (broadcast) out


def start_broadcast_from_rank0(group: WeightGroup, tensor: torch.Tensor, timeout_s: float) -> dist.Work:
    """Start receiving (or, on rank 0, sending) `tensor` in place; wait on the result with
    `wait_for_work` and the same `timeout_s` (gloo's own timeout, the backstop, is later)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = datetime.timedelta(seconds=timeout_s + TRANSPORT_TIMEOUT_MARGIN_S)
    return group.broadcast([tensor], options)


def broadcast_from_rank0(
    group: WeightGroup,
    tensor: torch.Tensor,
    timeout_s: float,
    stop: Callable[[], BaseException | None] | None = None,
) -> None:
    """Receive (or, on rank 0, send) `tensor` in place; raises if the peer does not show up in time,
    or what `stop` returns as soon as it returns something (see `wait_for_work`)."""
    last = group.size() - 1
    receivers = "rank 1" if last == 1 else f"ranks 1-{last}"
    peer = f"{receivers if group.rank() == 0 else 'rank 0 (the trainer)'} of its group"
    wait_for_work(start_broadcast_from_rank0(group, tensor, timeout_s), timeout_s, stop, peer)


# Groups whose collective was given up on. Destroying one blocks until its pending operation times
# out (gloo joins its worker thread; NCCL waits for the kernel), so they are kept, unused, instead.
_ABANDONED: list[WeightGroup] = []

POLL_S = 0.005
SPIN_S = 0.001
FIRST_POLL_S = 0.0001


def wait_for_work(
    work: dist.Work,
    timeout_s: float,
    stop: Callable[[], BaseException | None] | None = None,
    peer: str = "the other ranks of its group",
    started: float | None = None,
) -> None:
    """Waits until a started collective has finished; raises what ``stop`` returns as soon as it returns
    something, and a one-line ``TimeoutError`` naming ``peer`` once ``timeout_s`` have passed since
    ``started`` (a ``time.monotonic()``, by default now: NCCL's watchdog, too, counts from the start).

    A weight update is a collective plus an HTTP call on every engine. An engine that refuses the
    call never joins the collective, which would then hang until its timeout: polling ``stop``
    (which looks at the HTTP replies) turns that refusal into an error within a poll interval.

    Finished means ``work.is_completed()``: gloo sets it once the data is in place, NCCL once the
    kernel has finished on the GPU. The work's future is no such signal: ProcessGroupNCCL completes it
    as soon as the kernel is enqueued, so a waiter on the future alone never notices a peer that died.
    The future still wakes this wait the moment a gloo collective ends, so a CPU push pays no poll
    interval per bucket. gloo marks the work completed a moment (microseconds) after it completes the
    future, so the wait then spins for up to ``SPIN_S``, yielding the CPU: a sleep, even ``sleep(0)``,
    costs tens of microseconds of timer slack on Linux. A work still running after that is a device
    one (NCCL): it is polled at intervals that grow from ``FIRST_POLL_S`` to ``POLL_S``, so a short
    broadcast is seen finished within about its own duration and a long one within ``POLL_S``.
    """
    deadline = (time.monotonic() if started is None else started) + timeout_s
    woken = threading.Event()
    work.get_future().add_done_callback(lambda _: woken.set())
    spin_end, interval = None, FIRST_POLL_S
    while not work.is_completed():
        failure = None if stop is None else stop()
        if failure is not None:
            raise failure
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"a weight-update broadcast got no answer from {peer} within {timeout_s:g} s")
        if not woken.is_set():
            woken.wait(min(POLL_S, deadline - now))
            continue
        spin_end = spin_end or now + SPIN_S
        if now < spin_end:
            os.sched_yield()
        else:
            time.sleep(min(interval, deadline - now))
            interval = min(2 * interval, POLL_S)
    work.wait(datetime.timedelta(seconds=timeout_s))  # raises the collective's own error, if any


def abandon_group(group: WeightGroup | None) -> None:
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
