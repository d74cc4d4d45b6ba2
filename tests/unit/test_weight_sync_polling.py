"""How a weight-update broadcast is waited for (``slime.weight_sync.process_group.wait_for_work``).

A CUDA collective's future is done once its kernel is enqueued (``ProcessGroupNCCL::collective`` in
torch's ``ProcessGroupNCCL.cpp`` marks it completed right after the launch), while ``is_completed()``
turns true only when the kernel has finished. ``DeviceWork`` below behaves that way on the CPU, so the
waiter's NCCL behaviour is checked here; a real gloo group checks the CPU path end to end.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slime.utils.http import free_port
from slime.weight_sync.process_group import (
    POLL_S,
    abandon_group,
    broadcast_from_rank0,
    create_weight_update_group,
    start_broadcast_from_rank0,
    wait_for_work,
)


class DeviceWork:
    """A ``dist.Work`` shaped like NCCL's: its future is done at once, the work when ``finish`` is called."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result([])
        self.finished = threading.Event()
        self.error: Exception | None = None
        self.waited = 0

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def finish(self, error: Exception | None = None) -> None:
        self.error = error
        self.finished.set()

    def wait(self, timeout=None) -> bool:
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


def wait_in_thread(work, timeout_s: float, **kwargs) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            wait_for_work(work, timeout_s, **kwargs)
            outcome["returned"] = time.monotonic()
        except BaseException as exc:
            outcome["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_the_wait_lasts_until_the_work_completes_not_its_future():
    work = DeviceWork()
    thread, outcome = wait_in_thread(work, 30, stop=lambda: None)
    time.sleep(0.3)
    assert thread.is_alive() and not outcome, "the wait ended on the future, before the work had finished"
    finished_at = time.monotonic()
    work.finish()
    thread.join(5)
    assert "returned" in outcome, outcome
    assert outcome["returned"] - finished_at < 0.5
    assert work.waited == 1  # the work's own wait runs once, after completion (it raises its error)


def test_a_peer_that_never_finishes_is_named_in_one_line_at_the_deadline():
    work = DeviceWork()
    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        wait_for_work(work, 0.4, stop=lambda: None, peer="engines http://127.0.0.1:1")
    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert 0.4 <= elapsed < 0.4 + 0.5, elapsed
    assert "http://127.0.0.1:1" in message and "0.4 s" in message and "\n" not in message
    assert work.waited == 0


def test_the_deadline_counts_from_the_start_of_the_collective():
    with pytest.raises(TimeoutError):
        wait_for_work(DeviceWork(), 1.0, started=time.monotonic() - 1.0)


def test_a_stop_ends_the_wait_within_a_poll_interval():
    work = DeviceWork()
    refused = RuntimeError("engine http://127.0.0.1:1 refused the update")
    stop_at = time.monotonic() + 0.2
    thread, outcome = wait_in_thread(work, 30, stop=lambda: refused if time.monotonic() >= stop_at else None)
    thread.join(5)
    assert outcome.get("raised") is refused
    assert time.monotonic() - stop_at < 0.5


def test_an_error_of_the_finished_work_is_raised():
    work = DeviceWork()
    work.finish(RuntimeError("connection closed by peer"))
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        wait_for_work(work, 5, stop=lambda: None)


def test_nccl_polling_backs_off_to_the_poll_interval():
    """A long device collective costs a bounded number of completion checks, not a busy loop."""
    work = DeviceWork()
    checks = 0
    completed = work.is_completed

    def counted() -> bool:
        nonlocal checks
        checks += 1
        return completed()

    work.is_completed = counted
    timer = threading.Timer(0.5, work.finish)
    timer.start()
    wait_for_work(work, 30)
    # The spin phase (SPIN_S of yields) makes about a thousand checks, however fast this machine
    # yields; the polls after it about 0.5 / POLL_S. A busy loop over 0.5 s would make ~10^5-10^6.
    assert checks <= 5_000, checks
    assert checks >= 0.5 / POLL_S / 2, checks  # it did keep checking until the work finished


@pytest.fixture
def gloo_pair():
    """Rank 0 and rank 1 of a real two-rank gloo weight-update group, in this process."""
    port = free_port()
    peer: dict = {}
    joiner = threading.Thread(
        target=lambda: peer.update(
            group=create_weight_update_group("127.0.0.1", port, 1, 2, "poll", timeout_s=30)
        )
    )
    joiner.start()
    sender = create_weight_update_group("127.0.0.1", port, 0, 2, "poll", timeout_s=30)
    joiner.join(30)
    yield sender, peer["group"]


def test_gloo_broadcast_arrives_and_a_missing_peer_times_out_naming_it(gloo_pair):
    sender, receiver = gloo_pair
    sent = torch.arange(1000, dtype=torch.float32)
    received = torch.zeros(1000)
    receiving = start_broadcast_from_rank0(receiver, received, 30)
    wait_for_work(start_broadcast_from_rank0(sender, sent, 30), 30, stop=lambda: None, peer="rank 1")
    wait_for_work(receiving, 30)
    assert torch.equal(received, sent)

    # Rank 1 never joins the next broadcast: the sender gives up at its own deadline, naming it.
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no answer from rank 1 of its group within 0\.5 s"):
        broadcast_from_rank0(sender, sent, 0.5, stop=lambda: None)
    assert time.monotonic() - started < 0.5 + 0.5
    abandon_group(sender)
    abandon_group(receiver)
