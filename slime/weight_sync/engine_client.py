"""Blocking JSON calls from a trainer rank to rollout engines (SGLang's native HTTP API).

The trainer side of a weight update runs inside a Ray actor that also drives collectives, so the
calls are plain blocking HTTP, issued from threads when several engines must be reached at once.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class EngineCallError(RuntimeError):
    pass


def post(url: str, path: str, payload: dict[str, Any] | None = None, timeout: float = 300.0) -> dict:
    """POSTs JSON and returns the JSON reply; an HTTP error or ``success: false`` raises EngineCallError."""
    data = json.dumps(payload or {}).encode()
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise EngineCallError(f"{url}{path}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise EngineCallError(f"{url}{path}: {e}") from None
    reply = json.loads(body) if body else {}
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineCallError(f"{url}{path}: {reply.get('message', 'failed')}")
    return reply


def post_all(urls: list[str], path: str, payloads: list[dict] | dict | None = None, timeout: float = 300.0):
    """The same call on every engine at once; returns a future per engine (``.result()`` re-raises)."""
    if not isinstance(payloads, list):
        payloads = [payloads or {}] * len(urls)
    pool = ThreadPoolExecutor(max_workers=max(len(urls), 1))
    futures = [
        pool.submit(post, url, path, payload, timeout) for url, payload in zip(urls, payloads, strict=True)
    ]
    pool.shutdown(wait=False)
    return futures
