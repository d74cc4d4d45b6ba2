"""The rollouts' async transport for ``/generate``: sessions that outlive a rollout, and the post.

The rollout's hot path posts on ``aiohttp`` sessions kept per event loop (``run_on_thread_loop``,
``client_session``): a fresh session per rollout opened a TCP connection per request. Every session
sends the run's engine key (``slime.utils.http.auth_headers``). A non-2xx answer is raised as the
transport's ``HttpError``: the rollout acts on its status (a 5xx through the router is retried).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp

from slime.engine_client.timeouts import GENERATE_CONNECT_TIMEOUT_S
from slime.utils.http import HttpError, auth_headers

_thread_loops = threading.local()
T = TypeVar("T")


def run_on_thread_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on one event loop kept per thread, so that the sessions of ``client_session``
    (their keep-alive connections) serve the next rollout too: a fresh session per rollout opened a
    TCP connection per request, a third of the rollout manager's time on the quickstart
    (``bench/step_profile.py``). Each call runs as a task of its own, in a copy of the caller's
    context, as under ``asyncio.run``."""
    loop: asyncio.AbstractEventLoop | None = getattr(_thread_loops, "loop", None)
    if loop is None:
        loop = _thread_loops.loop = asyncio.new_event_loop()
        _thread_loops.sessions = {}
    return loop.run_until_complete(coroutine)


def client_session(limit: int) -> tuple[aiohttp.ClientSession, bool]:
    """A client session with at most ``limit`` connections and whether it is shared: on the loop of
    ``run_on_thread_loop`` the loop's own (never closed by its users; aiohttp closes connections idle
    for 15 s, so a slow step pays reconnects and a fast one none), elsewhere a new one the caller
    closes. No total timeout: a long generation is not an error. It sends the run's engine key."""
    shared = asyncio.get_running_loop() is getattr(_thread_loops, "loop", None)
    session = _thread_loops.sessions.get(limit) if shared else None
    if session is None or session.closed:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=GENERATE_CONNECT_TIMEOUT_S),
            headers=auth_headers(),
        )
        if shared:
            _thread_loops.sessions[limit] = session
    return session, shared


async def post_json(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> Any:
    """POST on the shared session; raises ``HttpError`` with the server's message on a non-2xx answer."""
    async with session.post(url, json=payload) as response:
        if response.status >= 300:
            raise HttpError("POST", url, response.status, await response.text())
        return await response.json(content_type=None)


def one_off_session() -> aiohttp.ClientSession:
    """A session for one call outside a rollout (no session to share); the caller closes it
    (``async with``). It sends the run's engine key."""
    return aiohttp.ClientSession(headers=auth_headers())
