"""Control of the engines: pause and continue generation, abort requests, count them, read the context length.

``pause`` and ``resume`` post SGLang's ``/pause_generation {"mode"}`` and ``/continue_generation`` to
every engine of a list at once (the rollout manager's engines, or the external ones), and raise the
first refusal as ``EngineCallError`` once every engine has answered.

Dynamic sampling stops as soon as enough groups are kept, and the requests still running would
otherwise keep the engines busy into the weight update. ``EngineAborts`` sends SGLang's
``POST /abort_request``: ``{"rid"}`` for each of a rollout's requests, or ``{"abort_all": true}``;
the aborted requests answer with ``finish_reason`` ``abort`` and what they generated so far.

Why every rid goes to every engine: nothing tells which engine holds a request while it runs.
sglang-router 0.3.2 has no abort of its own and adds no header naming the worker (measured against
a real router: it echoes ``X-Request-ID`` and passes the worker's own headers through, and ignores
``X-SMG-Target-Worker`` on ``/generate`` under ``round_robin``; ``tests/e2e/test_abort_fanout.py``
checks it); SGLang's ``/generate`` names no
engine in its headers or reply (``entrypoints/http_server.py``, 0.5.19-0.5.23), and a non-streaming
reply only arrives once the request has ended anyway, when there is nothing left to abort. No
engine route lists the rids it holds, and the router may retry a request on another worker. An
engine drops the abort of a rid it does not know (``TokenizerManager.abort_request``: an exact
``rid_to_state`` key with one tokenizer worker), so the one that holds it ends it and the others
do nothing; and the rid must be each input's own (``<rid>_<i>`` of a batch, see ``generate_utils``),
since a batch's rid is not a key there.

What keeps that fan-out affordable (16 engines x 8k requests is 131k posts a round):
- one aiohttp session per abort, on the rollout's loop, with at most ``ABORT_CONNECTIONS_PER_ENGINE``
  posts in flight to each engine (an engine answers on one event loop; more only queue there), and
  a session of its own so the aborts never wait for a connection the rollout's generate requests
  hold (they end only once aborted);
- an engine that refuses the connection gets no more rids: its requests ended with it;
- the by-rid phase is bounded in time (``rid_phase_s``: a round still running then is cut) and in
  posts (``max_rid_calls``); after that the caller falls back to ``abort_all``, which ends every
  request an engine's scheduler holds, other clients' too.

``num_requests`` reads an engine's load: ``GET /v1/loads`` (running + waiting requests of every DP
rank; every supported SGLang has it), or ``GET /get_load`` on an engine without it (removed in
SGLang 0.5.21). ``context_length`` and ``num_requests`` are synchronous (a handful
of calls per rollout): async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import aiohttp

from slime.engine_client.calls import post_all, wait_all
from slime.engine_client.protocol import engine_api
from slime.engine_client.timeouts import ABORT_POST_TIMEOUT_S, CONTROL_TIMEOUT_S, READ_TIMEOUT_S
from slime.utils.http import HttpError, auth_headers, get_json

ABORT_CONNECTIONS_PER_ENGINE = 8  # abort posts in flight to one engine at a time


def pause(urls: list[str], mode: str = "abort", timeout: float = CONTROL_TIMEOUT_S) -> None:
    """``/pause_generation`` on every engine of ``urls`` (SGLang modes: abort, retract, in_place)."""
    wait_all(post_all(urls, "/pause_generation", {"mode": mode}, timeout))


def resume(urls: list[str], timeout: float = CONTROL_TIMEOUT_S) -> None:
    """``/continue_generation`` on every engine of ``urls``."""
    wait_all(post_all(urls, "/continue_generation", {}, timeout))


def context_length(urls: list[str]) -> int | None:
    """The smallest context length of the engines at ``urls``: ``max_model_len`` of ``GET /v1/models``,
    the limit SGLang's tokenizer manager checks ``prompt + max_new_tokens`` against (a request over
    it is an HTTP 400; ``entrypoints/http_server.py`` ``available_models``, 0.5.19-0.5.23). None when
    no engine reports one (a server without the route). An engine that does not answer is left out:
    it died since the router listed it, and its requests fail (or are sent elsewhere) on their own."""

    def one(url: str) -> int | None:
        try:
            cards = get_json(f"{url}/v1/models", timeout=READ_TIMEOUT_S)["data"]
        except (HttpError, OSError):
            return None
        lengths = [card["max_model_len"] for card in cards if card.get("max_model_len")]
        return min(lengths, default=None)

    return min((n for n in _each(one, urls) if n is not None), default=None)


def _each(fn: Any, items: list[Any]) -> list[Any]:
    """``fn`` of every item, concurrently (one thread per item)."""
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(fn, items))


class EngineAborts:
    """One rollout's aborts on the engines at ``urls``, on one aiohttp session (``async with``).

    ``by_rid`` sends rounds of by-rid aborts while the by-rid phase lasts: ``rid_phase_s`` from
    ``async with``, and no round that would take the by-rid posts past ``max_rid_calls``. It answers
    False once the phase is over (then it sends nothing), or when the deadline cut its round (rids it
    did not send are aborted by no one else), and the caller escalates to ``abort_all``; a round that
    sent everything answers True even past the deadline, so the requests it aborted get the caller's
    wait to come back before ``abort_all`` ends other clients' requests too.
    ``rid_calls`` and ``all_calls`` count the posts sent (tried, answered or not).
    """

    def __init__(
        self,
        urls: list[str],
        max_rid_calls: int,
        rid_phase_s: float,
        connections_per_engine: int = ABORT_CONNECTIONS_PER_ENGINE,
    ) -> None:
        self.urls = list(urls)
        self.max_rid_calls = max_rid_calls
        self.rid_phase_s = rid_phase_s
        self.connections_per_engine = connections_per_engine
        self.rid_calls = 0
        self.all_calls = 0
        self.gone: set[str] = set()
        """Engines that refused a connection: by-rid rounds skip them (their requests ended with them)."""
        self._rid_deadline = 0.0
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineAborts:
        self._rid_deadline = time.monotonic() + self.rid_phase_s
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(1, len(self.urls)) * self.connections_per_engine),
            timeout=aiohttp.ClientTimeout(total=ABORT_POST_TIMEOUT_S),
            headers=auth_headers(),
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()

    async def by_rid(self, rids: list[str]) -> bool:
        """One round: ``POST /abort_request {"rid"}`` for each of ``rids`` to each engine still up (the
        route takes one rid). False when it sent nothing (the phase is over) or not everything."""
        now = time.monotonic()
        live = [url for url in self.urls if url not in self.gone]
        if now >= self._rid_deadline or self.rid_calls + len(live) * len(rids) > self.max_rid_calls:
            return False
        workers = []
        for url in live:
            todo = iter(rids)  # shared by the engine's workers: each rid is posted to it once
            workers += [
                asyncio.ensure_future(self._engine_rids(url, todo))
                for _ in range(min(self.connections_per_engine, len(rids)))
            ]
        late = set(workers)
        try:
            if workers:
                _, late = await asyncio.wait(workers, timeout=self._rid_deadline - now)
        finally:
            for task in workers:  # the phase's time is up: what this round did not send, abort_all ends
                task.cancel()
            outcomes = await asyncio.gather(*workers, return_exceptions=True)
        _raise_first(outcomes)
        return not late

    async def abort_all(self) -> None:
        """``POST /abort_request {"abort_all": true}`` to every engine (a refused one is skipped)."""
        self.all_calls += len(self.urls)
        _raise_first(
            await asyncio.gather(
                *(self._post(url, {"abort_all": True}) for url in self.urls), return_exceptions=True
            )
        )

    async def _engine_rids(self, url: str, todo: Iterator[str]) -> None:
        for rid in todo:
            if url in self.gone:
                return
            self.rid_calls += 1
            await self._post(url, {"rid": rid})

    async def _post(self, url: str, payload: dict[str, Any]) -> None:
        """An engine's error answer is raised; a refused connection marks the engine gone; a post that
        timed out or broke is lost, and the next round (or ``abort_all``) repeats what it would do."""
        assert self._session is not None, "use EngineAborts with async with"
        try:
            async with self._session.post(f"{url}/abort_request", json=payload) as response:
                if response.status >= 300:
                    raise HttpError("POST", f"{url}/abort_request", response.status, await response.text())
        except aiohttp.ClientConnectorError:
            self.gone.add(url)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass


def _raise_first(outcomes: list[Any]) -> None:
    """Raises the first error among ``gather(..., return_exceptions=True)`` outcomes (a cancelled post
    is no error: its round ran out of time)."""
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome


def num_requests(url: str) -> int:
    """Requests an engine's scheduler holds (running + waiting, summed over its DP ranks)."""
    path = engine_api(url).load_path
    if path == "/v1/loads":
        return requests_in_loads(get_json(f"{url}/v1/loads?include=core", timeout=READ_TIMEOUT_S))
    return requests_in_get_load(get_json(f"{url}{path}", timeout=READ_TIMEOUT_S))


def requests_in_loads(reply: dict[str, Any]) -> int:
    """``GET /v1/loads``: ``{"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}``
    (``sglang/srt/entrypoints/v1_loads.py``, ``LoadSnapshot`` in ``managers/load_snapshot.py``)."""
    return sum(int(load["num_running_reqs"]) + int(load["num_waiting_reqs"]) for load in reply["loads"])


def requests_in_get_load(reply: list[dict[str, Any]] | dict[str, Any]) -> int:
    """``GET /get_load`` (SGLang <= 0.5.20): one ``{"dp_rank", "num_reqs", "num_waiting_reqs",
    "num_tokens"}`` per DP rank, where ``num_reqs`` counts running and waiting requests."""
    entries = reply if isinstance(reply, list) else [reply]
    return sum(int(entry["num_reqs"]) for entry in entries)
