"""The calls of a weight push, and the weight-update sessions around them.

Each call answers a future per engine (``calls.post_all``): an update does not answer until the
engine has received the broadcast that follows it, so the trainer broadcasts while they are in flight.

From SGLang 0.5.21 on, ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` only
run inside a weight-update session (``/begin_weight_update`` ... ``/end_weight_update``):
``weight_update_session`` opens one on every engine that has them and closes it on every path out.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from slime.engine_client.calls import EngineCallError, call_all, post, post_all, wait_all
from slime.engine_client.protocol import engine_api
from slime.engine_client.timeouts import END_SESSION_TIMEOUT_S, ERROR_PATH_TIMEOUT_S

logger = logging.getLogger(__name__)


def init_group(urls: list[str], payloads: list[dict[str, Any]], timeout: float) -> list[Future[Any]]:
    """``/init_weights_update_group`` on each engine, with its own payload (its rank offset)."""
    return post_all(urls, "/init_weights_update_group", payloads, timeout)


def destroy_group(urls: list[str], payload: dict[str, Any], timeout: float) -> list[Future[Any]]:
    """``/destroy_weights_update_group`` on every engine."""
    return post_all(urls, "/destroy_weights_update_group", payload, timeout)


def update_from_distributed(urls: list[str], payload: dict[str, Any], timeout: float) -> list[Future[Any]]:
    """``/update_weights_from_distributed``: the engines receive the bucket the trainer broadcasts next."""
    return post_all(urls, "/update_weights_from_distributed", payload, timeout)


def update_from_tensor(urls: list[str], payload: dict[str, Any], timeout: float) -> list[Future[Any]]:
    """``/update_weights_from_tensor``: the engines load tensors handed over in place (colocated)."""
    return post_all(urls, "/update_weights_from_tensor", payload, timeout)


def update_from_disk(urls: list[str], payload: dict[str, Any], timeout: float) -> list[Future[Any]]:
    """``/update_weights_from_disk``: the engines load a checkpoint the trainer wrote."""
    return post_all(urls, "/update_weights_from_disk", payload, timeout)


def unload_lora_adapter(urls: list[str], payload: dict[str, Any], timeout: float) -> list[Future[Any]]:
    """``/unload_lora_adapter``: the named adapter off the engines (a loaded name cannot be reloaded)."""
    return post_all(urls, "/unload_lora_adapter", payload, timeout)


def load_lora_adapter(urls: list[str], payload: dict[str, Any], timeout: float) -> list[Future[Any]]:
    """``/load_lora_adapter``: the engines load an HF PEFT adapter directory the trainer wrote."""
    return post_all(urls, "/load_lora_adapter", payload, timeout)


def load_lora_adapter_from_tensors(
    urls: list[str], payload: dict[str, Any], timeout: float
) -> list[Future[Any]]:
    """``/load_lora_adapter_from_tensors``: the whole adapter in one call, handed over in place."""
    return post_all(urls, "/load_lora_adapter_from_tensors", payload, timeout)


def check_weights(urls: list[str], payload: dict[str, Any], timeout: float) -> list[Future[Any]]:
    """``/weights_checker``: snapshot, reset_tensors or compare every engine's weights (a debug aid)."""
    return post_all(urls, "/weights_checker", payload, timeout)


def update_weight_version(urls: list[str], payload: dict[str, Any], timeout: float) -> list[Future[Any]]:
    """``/update_weight_version``: the version the engines' replies report (set by a LoRA push, whose
    loads do not carry one)."""
    return post_all(urls, "/update_weight_version", payload, timeout)


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
