"""Upstream slime's ``post`` (``slime.utils.http_utils``) over our HTTP client.

Plugins written for THUDM/slime call ``await post(url, payload)`` (and ``await get(url)``) to reach
the router. Upstream retries
every failure up to ``max_retries`` times (default 60), one second apart, then raises the last error;
this does the same on the session of ``slime.engine_client.generate.client_session`` (keep-alive
connections, the run's engine key), so a plugin's requests share the rollout's connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from slime.engine_client.generate import client_session
from slime.utils.http import HttpError

logger = logging.getLogger(__name__)

RETRY_DELAY_S = 1.0
"""Upstream's pause between attempts."""
SESSION_LIMIT = 1024
"""Connections of the session ``post`` uses: the plugin's own concurrency (``GenerateState.semaphore``)
is the bound that matters, not the pool."""


async def post(
    url: str, payload: dict[str, Any] | None, max_retries: int = 60, headers: dict[str, str] | None = None
) -> Any:
    """POSTs ``payload`` as JSON and returns the decoded JSON answer (a non-JSON answer as its text),
    retrying any failure (connection error, non-2xx answer) ``max_retries`` times in all before
    raising the last error, as upstream."""
    session, shared = client_session(SESSION_LIMIT)
    try:
        for attempt in range(1, max_retries + 1):
            try:
                # aiohttp adds the session's headers (the engine key) to the request's own
                async with session.post(url, json=payload or {}, headers=headers) as response:
                    if response.status >= 300:
                        raise HttpError("POST", url, response.status, await response.text())
                    body = await response.text()
                try:
                    return json.loads(body)
                except json.JSONDecodeError:  # upstream hands a non-JSON answer back as its text
                    return body
            except Exception as e:
                if attempt >= max_retries:
                    raise
                logger.info("POST %s failed (%s), retry %d/%d", url, e, attempt, max_retries)
                await asyncio.sleep(RETRY_DELAY_S)
    finally:
        if not shared:
            await session.close()
    raise ValueError(f"max_retries must be >= 1, got {max_retries}")


async def get(url: str) -> Any:
    """GETs ``url`` once and returns the decoded JSON answer; a non-2xx answer raises ``HttpError``
    (upstream's ``get`` does not retry)."""
    session, shared = client_session(SESSION_LIMIT)
    try:
        async with session.get(url) as response:
            body = await response.text()
            if response.status >= 300:
                raise HttpError("GET", url, response.status, body)
        return json.loads(body)
    finally:
        if not shared:
            await session.close()
