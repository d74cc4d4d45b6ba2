"""Continuous batching: one scheduler thread drives the model; HTTP handlers talk to it through a queue.

Each iteration of the loop (i) applies what arrived (new requests, aborts, control commands such as
pause or a weight load, which therefore always run *between* forwards), (ii) admits waiting requests
into free slots, up to `max_running_requests` and the `max_total_tokens` budget, and prefills them in
one batch (each gets its first token), (iii) runs one decode step over every running request. A
request that finishes leaves at once (its slot is refilled by the last one, see kv_cache.py), so
nothing is padded to the longest request of a batch and late arrivals join a running batch.

Requests reach HTTP handlers only through callbacks (`Request.on_finish`) that the server turns into
asyncio futures; the scheduler itself knows nothing about HTTP.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime.backends.torch_engine import protocol
from slime.backends.torch_engine.model_runner import ModelRunner
from slime.backends.torch_engine.replies import generate_reply
from slime.backends.torch_engine.request import Request
from slime.backends.torch_engine.sampling import RowSampling, ban_tokens, sample

logger = logging.getLogger(__name__)

# What SGLang 0.5.19-0.5.23 answer for a request that an abort_request took from the waiting queue
# (``TokenizerManager._handle_abort_req``: the AbortReq carries no reason of its own).
QUEUED_ABORT_MESSAGE = "Abort in waiting queue"

# Padded tokens one prefill forward may take (rows x longest prompt); at least one request always fits.
PREFILL_TOKEN_BUDGET = 8192

# An idle engine that receives requests waits for more before its first prefill, until no new one came
# for GATHER_QUIET_S or GATHER_MAX_S passed: requests sent together (a rollout's prompt groups, whose
# HTTP requests arrive a fraction of a millisecond apart) are prefilled in one forward and decode in
# step, instead of a first prefill of whatever arrived first and a second one that joins it. On the
# quickstart step (16 batched requests of 8) that is 1.1 instead of 2.1 prefills and 7 instead of
# 9 decode steps. SGLang's counterpart is its prefill delayer (``--enable-prefill-delayer``, off by
# default, ``managers/prefill_delayer.py``), which waits in forward passes rather than time; the
# requests and replies are the same either way.
GATHER_QUIET_S = 0.001
GATHER_MAX_S = 0.005


@dataclass
class SchedulerStats:
    """Counters that make batching observable (reported by /get_server_info internal_states)."""

    prefill_batches: int = 0
    prefill_tokens: int = 0  # computed; a copied prompt's are not (see _prefill)
    prefill_copied_requests: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    max_running_seen: int = 0
    joined_running_batch: int = 0  # requests admitted while other requests were decoding
    finished_requests: int = 0
    aborted_requests: int = 0
    last_gen_throughput: float = 0.0


class Scheduler:
    """The engine loop; public methods are thread-safe, `_`-methods run on the scheduler thread only."""

    def __init__(
        self,
        runner: ModelRunner,
        max_running_requests: int,
        max_total_tokens: int | None,
        random_seed: int | None,
    ) -> None:
        self.runner = runner
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        # With LoRA: whether a batch may hold these adapters (``LoraManager.batch_fits``).
        self.lora_batch_fits: Callable[[set[str | None]], bool] | None = None
        self.generator = torch.Generator(device=runner.device)
        if random_seed is not None:
            self.generator.manual_seed(random_seed)
        else:
            self.generator.seed()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # running[i].slot == i
        self.paused = False
        self.weight_version = "default"
        self.stats = SchedulerStats()
        self._inbox: list[tuple[str, Any]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="torch-engine-scheduler", daemon=True)
        self._throughput_window: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)

    # ---- thread-safe API ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        self._post("request", request)

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Aborted") -> None:
        """Abort requests whose rid starts with `rid` (SGLang matches by prefix), or all of them."""
        if not abort_all and not rid:
            return
        self._post("abort", (rid, abort_all, message))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the scheduler thread between two forwards; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post("call", (fn, future))
        return future

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (their callers get an abort reply) and end the thread."""
        self._post("stop", None)
        self._thread.join(timeout)

    def load(self) -> dict[str, int]:
        """The numbers of /v1/loads (read without locking: a snapshot for monitoring only)."""
        running, waiting = list(self.running), list(self.waiting)
        tokens = sum(r.kv_len for r in running) + sum(len(r.input_ids) for r in waiting)
        return {"num_running_reqs": len(running), "num_waiting_reqs": len(waiting), "num_tokens": tokens}

    def _post(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._inbox.append((kind, payload))
            self._cond.notify()

    # ---- scheduler thread -----------------------------------------------------------------------

    def _has_work(self) -> bool:
        return not self.paused and bool(self.running or self.waiting)

    def _gather_arrivals(self) -> None:
        """Called with ``_cond`` held: see GATHER_QUIET_S. Only new requests are waited for, on an engine
        with nothing running; anything else in the inbox (an abort, a pause, a weight load) ends it."""
        if self.running or not self._inbox or any(kind != "request" for kind, _ in self._inbox):
            return
        deadline = time.perf_counter() + GATHER_MAX_S
        seen = len(self._inbox)
        while time.perf_counter() < deadline:
            self._cond.wait(GATHER_QUIET_S)
            if len(self._inbox) == seen or any(kind != "request" for kind, _ in self._inbox[seen:]):
                return
            seen = len(self._inbox)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._has_work():
                    self._cond.wait()
                self._gather_arrivals()
                items, self._inbox = self._inbox, []
            # Inference mode for the control items too: aborting a running request moves another's
            # KV row into its slot, an in-place write to the cache's inference tensors.
            try:
                with torch.inference_mode():
                    for kind, payload in items:
                        self._handle(kind, payload)
            except Exception as exc:  # keep serving: fail what is in flight, never end the thread
                self._fail_all("engine control call failed", exc)
            if self._stopping:
                return
            if not self._has_work():
                continue
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as exc:  # keep serving: fail the requests of the broken step, not the server
                self._fail_all("engine step failed", exc)

    def _fail_all(self, what: str, exc: Exception) -> None:
        logger.exception(what)
        for request in list(self.running) + list(self.waiting):
            self._finish(request, protocol.finish_abort(f"engine error: {exc}"))
        self.running.clear()
        self.waiting.clear()
        self.runner.cache.clear()

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "request":
            self.waiting.append(payload)
        elif kind == "abort":
            rid, abort_all, message = payload
            self._abort_matching(lambda r: abort_all or r.rid.startswith(rid), message, QUEUED_ABORT_MESSAGE)
        elif kind == "call":
            fn, future = payload
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
        elif kind == "stop":
            self._abort_matching(lambda r: True, "server shutting down")
            self._stopping = True

    def _abort_matching(
        self, match: Callable[[Request], bool], message: str, queued_message: str | None = None
    ) -> int:
        """Abort waiting requests now and running ones (they keep what they produced); returns the count.

        A waiting request is answered as SGLang answers one popped from its waiting queue
        (``queued_message``, default ``message``; see ``replies.generate_reply``)."""
        count = 0
        for request in [r for r in self.waiting if match(r)]:
            self.waiting.remove(request)
            request.aborted_in_queue = True
            self._finish(request, protocol.finish_abort_queued(queued_message or message))
            count += 1
        leaving = [r for r in self.running if match(r)]
        self._remove_running(leaving)
        for request in leaving:
            self._finish(request, protocol.finish_abort(message))
        return count + len(leaving)

    # The control operations below are called through `call()`, so they run on this thread.

    def abort_all(self, message: str = "Aborted") -> int:
        return self._abort_matching(lambda r: True, message)

    def pause(self, mode: str) -> None:
        """SGLang's pause modes: abort everything, retract running requests to the queue, or keep them."""
        self.paused = True
        if mode == "abort":
            self.abort_all()
        elif mode == "retract":
            self._retract_all()

    def resume(self) -> None:
        self.paused = False

    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    def _retract_all(self) -> None:
        """Drop the KV of running requests and queue them first; they are re-prefilled on continue."""
        for request in reversed(self.running):
            request.slot, request.kv_len = -1, 0
            request.num_retractions += 1
            self.waiting.appendleft(request)
        self.running.clear()
        self.runner.cache.clear()

    def _step(self) -> None:
        batch = self._admit()
        if batch:
            self._prefill(batch)
        if self.running:
            self._decode()

    def _admit(self) -> list[Request]:
        batch: list[Request] = []
        reserved = sum(r.reserved_tokens() for r in self.running)
        width = 0
        # A request whose adapter does not fit the batch waits and later ones are still admitted,
        # as SGLang's ``can_schedule_lora_req`` skips it.
        skipped: list[Request] = []
        adapters = {r.lora_id for r in self.running}
        while self.waiting and len(self.running) + len(batch) < self.max_running_requests:
            request = self.waiting[0]
            lora_id = request.lora_id
            fits = (
                self.lora_batch_fits is None
                or lora_id in adapters
                or self.lora_batch_fits(adapters | {lora_id})
            )
            if not fits:
                skipped.append(self.waiting.popleft())
                continue
            length = len(request.input_ids) + len(request.output_ids)
            if batch and (len(batch) + 1) * max(width, length) > PREFILL_TOKEN_BUDGET:
                break
            # Prompt logprobs need logits at every position: such a request is prefilled on its own.
            if batch and (self._needs_all_logits(request) or self._needs_all_logits(batch[0])):
                break
            if (
                self.max_total_tokens is not None
                and (self.running or batch)
                and reserved + request.reserved_tokens() > self.max_total_tokens
            ):
                break
            self.waiting.popleft()
            batch.append(request)
            adapters.add(request.lora_id)
            reserved += request.reserved_tokens()
            width = max(width, length)
        self.waiting.extendleft(reversed(skipped))
        return batch

    @staticmethod
    def _needs_all_logits(request: Request) -> bool:
        """Prompt logprobs are computed once, at the first prefill (not again after a retraction)."""
        return request.wants_input_logprobs and not request.output_ids and request.num_retractions == 0

    def _prefill(self, batch: list[Request]) -> None:
        """Prefills ``batch`` into the next free slots and samples each request's first token.

        Requests with the same tokens (the samples of one prompt, sent together) are computed once: the
        first of them is prefilled, the others get a copy of its keys, values and last logits, which
        is what they would compute (SGLang's radix cache shares such a prefix too; each request still
        samples on its own). They report the copied tokens as ``cached_tokens``, at most all but the
        last, as SGLang counts a prefix hit, and get its routed experts with its keys and values (SGLang
        keeps them per KV slot, so a prefix hit returns the rows recorded when the slot was computed).
        """
        if self.running:
            self.stats.joined_running_batch += len(batch)
        first_time = [self._needs_all_logits(r) for r in batch]
        all_logits = any(first_time)  # such a request is prefilled alone
        batch, sources = (batch, list(range(len(batch)))) if all_logits else _copies_last(batch)
        computed = len(set(sources))
        start = len(self.running)
        for i, request in enumerate(batch):
            request.slot = start + i
        sequences = [r.input_ids + r.output_ids for r in batch]
        images = [r.images for r in batch[:computed]]
        adapters = [r.lora for r in batch[:computed]]
        record = any(r.routes is not None for r in batch)
        logits = self.runner.prefill(sequences[:computed], start, all_logits, images, adapters, record)
        copies = [(start + sources[i], start + i, len(sequences[i])) for i in range(computed, len(batch))]
        self.runner.cache.copy_rows(copies)
        self.running.extend(batch)
        self.stats.prefill_batches += 1
        self.stats.prefill_tokens += sum(len(s) for s in sequences[:computed])
        self.stats.prefill_copied_requests += len(copies)
        self.stats.max_running_seen = max(self.stats.max_running_seen, len(self.running))
        last = []
        for i, (request, seq) in enumerate(zip(batch, sequences, strict=True)):
            request.kv_len = len(seq)
            if record:  # a re-prefill after a retraction records its positions again
                request.record_routes(0, self.runner.last_routes[sources[i]])
            row_logits = logits[sources[i]]
            if all_logits:
                if first_time[i]:
                    self._record_input_logprobs(request, row_logits)
                row_logits = row_logits[-1]
            elif i >= computed and request.num_retractions == 0:
                request.cached_tokens = len(request.input_ids) - 1
            last.append(row_logits)
        zero_budget = [r for r in batch if r.max_new_tokens == 0]
        self._remove_running(zero_budget)
        for request in zero_budget:
            self._finish(request, protocol.finish_length(0))
        rows = [i for i, r in enumerate(batch) if r.max_new_tokens > 0]
        if rows:
            self._sample_and_advance([batch[i] for i in rows], torch.stack([last[i] for i in rows]))

    def _record_input_logprobs(self, request: Request, logits: torch.Tensor) -> None:
        """SGLang's input_token_logprobs: from logprob_start_len on, the first entry None (raw logits)."""
        start = request.logprob_start_len
        ids = request.input_ids
        targets = torch.tensor(ids[start + 1 :], dtype=torch.long, device=logits.device)
        values = torch.log_softmax(logits[start : len(ids) - 1], dim=-1).gather(1, targets[:, None])[:, 0]
        request.input_logprobs = [None, *values.tolist()]

    def _decode(self) -> None:
        device = self.runner.device
        tokens = torch.tensor([r.output_ids[-1] for r in self.running], dtype=torch.long, device=device)
        lengths = [r.kv_len for r in self.running]
        positions = torch.tensor(lengths, dtype=torch.long, device=device)
        deltas = [r.images.rope_delta if r.images is not None else 0 for r in self.running]
        record = any(r.routes is not None for r in self.running)
        logits = self.runner.decode(
            tokens, positions, max(lengths) + 1, deltas, [r.lora for r in self.running], record
        )
        for i, request in enumerate(self.running):
            if record:
                request.record_routes(request.kv_len, self.runner.last_routes[i])
            request.kv_len += 1
        self.stats.decode_steps += 1
        self._sample_and_advance(list(self.running), logits)

    def _sample_and_advance(self, requests: list[Request], logits: torch.Tensor) -> None:
        banned = [r.banned_until_min if len(r.output_ids) < r.params.min_new_tokens else [] for r in requests]
        ban_tokens(logits, banned)
        want_logprobs = any(r.return_logprob for r in requests)
        rows: list[RowSampling] = []
        for r in requests:
            assert r.sampling is not None  # every admitted request has its sampling
            rows.append(r.sampling)
        tokens, logprobs = sample(logits, rows, self.generator, want_logprobs)
        values = logprobs.tolist() if logprobs is not None else [None] * len(requests)
        finished = []
        for request, token, logprob in zip(requests, tokens.tolist(), values, strict=True):
            request.output_ids.append(token)
            if request.return_logprob:
                request.output_logprobs.append(logprob)
            reason = self._check_finished(request, token)
            if reason is not None:
                finished.append((request, reason))
        self.stats.decode_tokens += len(requests)
        self._throughput_window.append((time.perf_counter(), len(requests)))
        self._remove_running([request for request, _ in finished])
        for request, reason in finished:
            self._finish(request, reason)

    def _check_finished(self, request: Request, token: int) -> dict[str, Any] | None:
        params = request.params
        if params.stop:
            tail = self.runner.tokenizer.decode(request.output_ids[-request.stop_tail_tokens :])
            for stop in params.stop:
                if stop in tail:
                    return protocol.finish_stop_str(stop)
        if token in request.stop_ids:
            return protocol.finish_stop_token(token)
        if len(request.output_ids) >= request.max_new_tokens:
            return protocol.finish_length(request.max_new_tokens)
        return None

    def _remove_running(self, leaving: list[Request]) -> None:
        """Free the slots of ``leaving``; running requests past the new end move into the holes below
        it, all in one copy per layer (rows stay contiguous: the model sees views, never copies)."""
        if not leaving:
            return
        gone = {r.slot for r in leaving}
        end = len(self.running) - len(gone)
        holes = sorted(slot for slot in gone if slot < end)
        movers = [r for r in self.running[end:] if r.slot not in gone]
        moves = []
        for hole, request in zip(holes, movers, strict=True):
            moves.append((request.slot, hole, request.kv_len))
            self.running[hole] = request
            request.slot = hole
        del self.running[end:]
        for request in leaving:
            request.slot = -1
        self.runner.cache.copy_rows(moves)

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        request.finish_reason = reason
        self.stats.finished_requests += 1
        if reason["type"] == "abort":
            self.stats.aborted_requests += 1
        if request.on_finish is not None:
            request.on_finish(generate_reply(request, self.runner.tokenizer, self.weight_version))

    def internal_state(self) -> dict[str, Any]:
        """Live numbers for /get_server_info's internal_states (safe to read from any thread)."""
        window = list(self._throughput_window)
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            self.stats.last_gen_throughput = sum(n for _, n in window[1:]) / (window[-1][0] - window[0][0])
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "paused": self.paused,
            "kv_cache_bytes": self.runner.cache.nbytes(),
            **vars(self.stats),
        }


def _copies_last(batch: list[Request]) -> tuple[list[Request], list[int]]:
    """``batch`` with the first request of each distinct token sequence (and images) first and the repeats
    after, and for each the index of the first one with its tokens (the one prefilled for it)."""
    first: dict[tuple[Any, ...], int] = {}
    unique: list[Request] = []
    repeats: list[tuple[Request, int]] = []
    for request in batch:
        key = request.cache_key
        if key in first:
            repeats.append((request, first[key]))
        else:
            first[key] = len(unique)
            unique.append(request)
    return unique + [r for r, _ in repeats], list(range(len(unique))) + [i for _, i in repeats]
