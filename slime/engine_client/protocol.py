"""Which release of SGLang's HTTP API an engine speaks, detected once per engine.

Supported: SGLang 0.5.19 to 0.5.23 (and the torch engine, which mirrors one of them). The releases
differ where slime depends on them:

- weight-update sessions: from 0.5.21 on, ``/update_weights_from_distributed`` and
  ``/update_weights_from_tensor`` must run between ``/begin_weight_update`` and ``/end_weight_update``
  (earlier releases answer 404 on both);
- load: ``GET /v1/loads`` in every supported release; the deprecated ``GET /get_load`` until 0.5.20.

Both are probed rather than inferred from the version string, so a patched or future build is
judged by what it serves: ``GET`` on the POST-only ``/begin_weight_update`` answers 405 where the
route exists and 404 where it does not, without opening anything. The version (``/server_info``,
``/get_server_info`` before it) is logged once per engine.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from slime.engine_client.timeouts import READ_TIMEOUT_S
from slime.utils.http import HttpError, get_json, request_json

logger = logging.getLogger(__name__)

# The releases slime is checked against (pyproject's sglang extra and the Dockerfile allow these); the
# torch engine mirrors any of them (--torch-engine-sglang-release).
SUPPORTED_SGLANG = ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


@dataclass(frozen=True)
class EngineApi:
    """What one engine serves: its reported version and the protocol variants slime needs."""

    url: str
    version: str
    weight_update_sessions: bool
    load_path: str  # "/v1/loads" or "/get_load"

    def describe(self) -> str:
        sessions = "weight-update sessions" if self.weight_update_sessions else "no weight-update sessions"
        return f"SGLang {self.version} ({sessions}, load from {self.load_path})"


_known: dict[str, EngineApi] = {}
_lock = threading.Lock()


def engine_api(url: str) -> EngineApi:
    """The engine's API, probed on first use and remembered for the life of this process."""
    url = url.rstrip("/")
    with _lock:
        if url in _known:
            return _known[url]
    api = probe_engine_api(url)
    with _lock:
        _known[url] = api
    logger.info("engine %s speaks %s", url, api.describe())
    return api


def probe_engine_api(url: str) -> EngineApi:
    """Asks the engine; raises ``OSError`` when nothing answers at ``url``."""
    version = "unknown"
    for path in ("/server_info", "/get_server_info"):
        try:
            info = get_json(f"{url}{path}", timeout=READ_TIMEOUT_S)
        except HttpError as exc:
            if exc.status == 404:
                continue
            raise
        version = str(info.get("version", "unknown")) if isinstance(info, dict) else "unknown"
        break
    return EngineApi(
        url=url,
        version=version,
        weight_update_sessions=_serves(url, "/begin_weight_update"),
        load_path="/v1/loads" if _serves(url, "/v1/loads") else "/get_load",
    )


# A GET on a route that exists answers 2xx, or 405 (it takes another method), or a validation error.
_ROUTE_EXISTS = (400, 405, 422)


def _serves(url: str, path: str) -> bool:
    """Whether the engine has route ``path``: 404 says no; any other error (401, 5xx) is raised, so
    that no wrong answer is remembered."""
    try:
        request_json("GET", f"{url}{path}", timeout=READ_TIMEOUT_S)
    except HttpError as exc:
        if exc.status == 404:
            return False
        if exc.status in _ROUTE_EXISTS:
            return True
        raise
    return True


def server_info(url: str) -> dict[str, Any]:
    """``GET /get_server_info``: the engine's settings (``tp_size``, ``model_path``, ...); raises
    ``HttpError`` for an error answer and ``OSError`` when nothing answers."""
    info: dict[str, Any] = get_json(f"{url}/get_server_info", timeout=READ_TIMEOUT_S)  # a JSON object
    return info
