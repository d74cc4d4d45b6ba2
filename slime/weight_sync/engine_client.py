"""Calls from a trainer rank to rollout engines (SGLang's native HTTP API) that must overlap a collective.

A weight-update call does not answer until the engine has received the broadcast that follows it,
so the trainer issues the calls from threads and broadcasts while they are in flight.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from slime.utils.http import post_json_sync


class EngineCallError(RuntimeError):
    """An engine answered ``success: false`` (SGLang's way of refusing an update)."""


def post(url: str, path: str, payload: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
    reply = post_json_sync(url.rstrip("/") + path, payload, timeout)
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineCallError(f"{url}{path}: {reply.get('message', 'failed')}")
    return reply


def post_all(
    urls: list[str], path: str, payloads: list[dict] | dict | None = None, timeout: float = 300.0
) -> list[Future]:
    """The same call on every engine at once; a future per engine (``.result()`` re-raises)."""
    if not isinstance(payloads, list):
        payloads = [payloads or {}] * len(urls)
    pool = ThreadPoolExecutor(max_workers=max(len(urls), 1))
    futures = [
        pool.submit(post, url, path, payload, timeout) for url, payload in zip(urls, payloads, strict=True)
    ]
    pool.shutdown(wait=False)
    return futures
