"""One synchronous call to an engine (SGLang's native HTTP API), its error, and calls to many at once.

A refusal (``success: false``, or a non-2xx answer) becomes one ``EngineCallError`` naming the
engine, the path and the engine's own message, whatever the call. The calls of a weight push must
overlap a collective (an update does not answer until the engine has received the broadcast that
follows it), so ``post_all`` issues them from threads and hands back futures.

The reads that only look (``protocol``, ``control``'s load and context length, ``health``) and the
async transports (``generate``, ``control.EngineAborts``) keep the transport's ``HttpError``: their
callers act on the HTTP status itself (a 404 is a missing route, a 5xx through the router is
retried, a 400 is the request's own fault).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from slime.engine_client.timeouts import CALL_TIMEOUT_S
from slime.utils.http import HttpError, post_json_sync


class EngineCallError(RuntimeError):
    """An engine refused a call: answered ``success: false`` or a non-2xx status."""

    def __init__(self, url: str, path: str, message: str, status: int | None = None) -> None:
        status_text = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"engine {url} refused {path}{status_text}: {message}")
        self.url, self.path, self.engine_message, self.status = url, path, message, status

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray actor boundaries intact
        return type(self), (self.url, self.path, self.engine_message, self.status)


def _message_of(body: str) -> str:
    """The engine's own words from an error body: SGLang's ``{"message"}`` or ``{"error": {"message"}}``."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.strip()[:2000]
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in parsed:
            return str(parsed["message"])
    return body.strip()[:2000]


def post(url: str, path: str, payload: dict[str, Any] | None = None, timeout: float = CALL_TIMEOUT_S) -> Any:
    """One POST to an engine; raises ``EngineCallError`` when it refuses (``OSError`` when it is gone)."""
    try:
        reply = post_json_sync(url.rstrip("/") + path, payload, timeout)
    except HttpError as exc:
        raise EngineCallError(url, path, _message_of(exc.body), exc.status) from None
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineCallError(url, path, str(reply.get("message", "failed")))
    return reply


def post_all(
    urls: list[str],
    path: str,
    payloads: list[dict[str, Any]] | dict[str, Any] | None = None,
    timeout: float = CALL_TIMEOUT_S,
) -> list[Future[Any]]:
    """The same call on every engine at once; a future per engine (``.result()`` re-raises)."""
    if not isinstance(payloads, list):
        payloads = [payloads or {}] * len(urls)
    calls = [
        functools.partial(post, url, path, payload, timeout)
        for url, payload in zip(urls, payloads, strict=True)
    ]
    return call_all(calls)


def call_all(calls: Sequence[Callable[[], Any]]) -> list[Future[Any]]:
    """Runs every call in a thread of its own, at once; a future per call."""
    pool = ThreadPoolExecutor(max_workers=max(len(calls), 1))
    futures = [pool.submit(call) for call in calls]
    pool.shutdown(wait=False)
    return futures


def first_failure(futures: list[Future[Any]], wait_s: float = 0.0) -> BaseException | None:
    """The error of the first call that has failed, if any, waiting at most ``wait_s`` for them."""
    if wait_s > 0:
        concurrent.futures.wait(futures, timeout=wait_s)
    for future in futures:
        if future.done() and future.exception() is not None:
            return future.exception()
    return None


def wait_all(futures: list[Future[Any]]) -> list[Any]:
    """Every call's answer; raises the first failure after all have finished (none is left running)."""
    results, failure = [], None
    for future in futures:
        try:
            results.append(future.result())
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
    return results


def failures(urls: list[str], futures: list[Future[Any]]) -> list[tuple[str, Exception]]:
    """Each engine whose call failed, with its error, in the order of ``urls``, once all have finished."""
    failed = []
    for url, future in zip(urls, futures, strict=True):
        try:
            future.result()
        except Exception as exc:
            failed.append((url, exc))
    return failed
