"""Calls from a trainer rank to rollout engines (SGLang's native HTTP API) that must overlap a collective.

A weight-update call does not answer until the engine has received the broadcast that follows it,
so the trainer issues the calls from threads and broadcasts while they are in flight. A refusal
(``success: false``, or a non-2xx answer) becomes one ``EngineCallError`` naming the engine, the
endpoint and the engine's own message.

From SGLang 0.5.21 on, ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` only
run inside a weight-update session (``/begin_weight_update`` ... ``/end_weight_update``):
``weight_update_session`` opens one on every engine that has them and closes it on every path out.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from slime.utils.engine_api import engine_api
from slime.utils.http import HttpError, post_json_sync

logger = logging.getLogger(__name__)

# Closing a session must not wait as long as a transfer may: it only runs the post-load step. After a
# failed push an engine may be stuck in a broadcast that never ends: then do not wait on it long.
END_SESSION_TIMEOUT_S = 120.0
ERROR_PATH_TIMEOUT_S = 10.0


class EngineCallError(RuntimeError):
    """An engine refused a call: answered ``success: false`` or a non-2xx status."""

    def __init__(self, url: str, path: str, message: str, status: int | None = None) -> None:
        status_text = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"engine {url} refused {path}{status_text}: {message}")
        self.url, self.path, self.engine_message, self.status = url, path, message, status

    def __reduce__(self) -> tuple:  # crosses Ray actor boundaries intact
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


def post(url: str, path: str, payload: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
    """One POST to an engine; raises ``EngineCallError`` when it refuses (``OSError`` when it is gone)."""
    try:
        reply = post_json_sync(url.rstrip("/") + path, payload, timeout)
    except HttpError as exc:
        raise EngineCallError(url, path, _message_of(exc.body), exc.status) from None
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineCallError(url, path, str(reply.get("message", "failed")))
    return reply


def post_all(
    urls: list[str], path: str, payloads: list[dict] | dict | None = None, timeout: float = 300.0
) -> list[Future]:
    """The same call on every engine at once; a future per engine (``.result()`` re-raises)."""
    if not isinstance(payloads, list):
        payloads = [payloads or {}] * len(urls)
    calls = [
        functools.partial(post, url, path, payload, timeout)
        for url, payload in zip(urls, payloads, strict=True)
    ]
    return call_all(calls)


def call_all(calls: list[Callable[[], Any]]) -> list[Future]:
    """Runs every call in a thread of its own, at once; a future per call."""
    pool = ThreadPoolExecutor(max_workers=max(len(calls), 1))
    futures = [pool.submit(call) for call in calls]
    pool.shutdown(wait=False)
    return futures


def first_failure(futures: list[Future], wait_s: float = 0.0) -> BaseException | None:
    """The error of the first call that has failed, if any, waiting at most ``wait_s`` for them."""
    if wait_s > 0:
        concurrent.futures.wait(futures, timeout=wait_s)
    for future in futures:
        if future.done() and future.exception() is not None:
            return future.exception()
    return None


def wait_all(futures: list[Future]) -> list[Any]:
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


@contextlib.contextmanager
def weight_update_session(urls: list[str], timeout: float) -> Iterator[None]:
    """A weight-update session on every engine of ``urls`` that has them (SGLang >= 0.5.21).

    One session per push, opened by the one caller that drives the push (every pipeline stage sends
    inside it: SGLang keeps one session per engine). ``/begin_weight_update {"selector": "all"}``
    first; ``/end_weight_update`` afterwards, also when the update failed (an engine left inside a
    session refuses the next begin), then with a short timeout and only logged, so that the update's
    own error is the one raised. A session still open from a push that never finished is closed and
    opened again, with a warning.
    """
    with_sessions = [url for url in urls if engine_api(url).weight_update_sessions]
    begun = call_all([functools.partial(_begin_session, url, timeout) for url in with_sessions])
    opened = [url for url, future in zip(with_sessions, begun, strict=True) if future.exception() is None]
    try:
        wait_all(begun)
        yield
    except BaseException:
        _end_sessions(opened, ERROR_PATH_TIMEOUT_S, raise_errors=False)
        raise
    _end_sessions(opened, END_SESSION_TIMEOUT_S, raise_errors=True)


def _begin_session(url: str, timeout: float) -> None:
    try:
        post(url, "/begin_weight_update", {"selector": "all"}, timeout)
    except EngineCallError as exc:
        if "already open" not in exc.engine_message:
            raise
        logger.warning(
            "engine %s still had a weight-update session open (an unfinished push); closing it", url
        )
        post(url, "/end_weight_update", {}, timeout)
        post(url, "/begin_weight_update", {"selector": "all"}, timeout)


def _end_sessions(urls: list[str], timeout: float, raise_errors: bool) -> None:
    try:
        wait_all(post_all(urls, "/end_weight_update", {}, timeout))
    except Exception as exc:
        if raise_errors:
            raise
        logger.warning("closing the weight-update sessions after a failed update: %s", exc)
