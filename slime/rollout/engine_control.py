"""Control of the engines behind a router: abort requests, count them, read the context length.

Dynamic sampling stops as soon as enough groups are kept, and the requests still running would
otherwise keep the engines busy into the weight update. ``abort_requests`` sends SGLang's
``POST /abort_request {"rid"}`` for each of a rollout's requests to every engine the router lists
(the router has no abort of its own), ``abort_all`` its ``{"abort_all": true}``; the aborted
requests answer with ``finish_reason`` ``abort`` and what they generated so far. ``num_requests``
reads an engine's load: ``GET /v1/loads`` (running + waiting requests of every DP rank; every
supported SGLang has it), or ``GET /get_load`` on an engine without it (removed in SGLang 0.5.21).
Synchronous (control calls, a handful per rollout): async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from slime.rollout.router import list_workers
from slime.utils.engine_api import engine_api
from slime.utils.http import HttpError, get_json, post_json_sync


def engine_urls(router_url: str) -> list[str]:
    """The engines the router routes to right now."""
    return [worker["url"] for worker in list_workers(router_url)]


def context_length(urls: list[str]) -> int | None:
    """The smallest context length of the engines at ``urls``: ``max_model_len`` of ``GET /v1/models``,
    the limit SGLang's tokenizer manager checks ``prompt + max_new_tokens`` against (a request over
    it is an HTTP 400; ``entrypoints/http_server.py`` ``available_models``, 0.5.19-0.5.23). None when
    no engine reports one (a server without the route). An engine that does not answer is left out:
    it died since the router listed it, and its requests fail (or are sent elsewhere) on their own."""

    def one(url: str) -> int | None:
        try:
            cards = get_json(f"{url}/v1/models")["data"]
        except (HttpError, OSError):
            return None
        lengths = [card["max_model_len"] for card in cards if card.get("max_model_len")]
        return min(lengths, default=None)

    return min((n for n in _each(one, urls) if n is not None), default=None)


def _each(fn: Any, items: list[Any], max_workers: int | None = None) -> list[Any]:
    """``fn`` of every item, concurrently (one thread per item, at most ``max_workers``)."""
    workers = max(1, len(items) if max_workers is None else min(max_workers, len(items)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def _post_unless_gone(url: str, payload: dict[str, Any]) -> None:
    """An abort to an engine that no longer answers is moot: its requests ended with it."""
    with contextlib.suppress(OSError):
        post_json_sync(f"{url}/abort_request", payload)


def abort_all(urls: list[str]) -> None:
    """Aborts every waiting and running request on each engine (still up)."""
    _each(lambda url: _post_unless_gone(url, {"abort_all": True}), urls)


def abort_requests(urls: list[str], rids: list[str]) -> None:
    """Aborts the requests ``rids`` on each engine (``POST /abort_request {"rid"}``, one per rid: the
    route takes one). An engine that does not know a rid ignores it; those that do abort it."""
    pairs = [(url, rid) for url in urls for rid in rids]
    _each(lambda pair: _post_unless_gone(pair[0], {"rid": pair[1]}), pairs, max_workers=32)


def num_requests(url: str) -> int:
    """Requests an engine's scheduler holds (running + waiting, summed over its DP ranks)."""
    path = engine_api(url).load_path
    if path == "/v1/loads":
        return requests_in_loads(get_json(f"{url}/v1/loads?include=core"))
    return requests_in_get_load(get_json(f"{url}{path}"))


def requests_in_loads(reply: dict[str, Any]) -> int:
    """``GET /v1/loads``: ``{"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}``
    (``sglang/srt/entrypoints/v1_loads.py``, ``LoadSnapshot`` in ``managers/load_snapshot.py``)."""
    return sum(int(load["num_running_reqs"]) + int(load["num_waiting_reqs"]) for load in reply["loads"])


def requests_in_get_load(reply: list[dict[str, Any]] | dict[str, Any]) -> int:
    """``GET /get_load`` (SGLang <= 0.5.20): one ``{"dp_rank", "num_reqs", "num_waiting_reqs",
    "num_tokens"}`` per DP rank, where ``num_reqs`` counts running and waiting requests."""
    entries = reply if isinstance(reply, list) else [reply]
    return sum(int(entry["num_reqs"]) for entry in entries)
