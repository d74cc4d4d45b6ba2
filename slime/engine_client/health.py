"""The fault-tolerance probe of one engine: does it answer, and in time.

``GET /health_generate`` (a one-token generation), or with ``generate=False`` ``GET /model_info``,
which SGLang answers from its tokenizer manager without generating: the liveness check for an engine
that is paused or has released its memory (0.5.19-0.5.23). What to do about a failed probe is
``slime.ray``'s (``engines.engine_problem``, ``engine_health.HealthMonitor``).
"""

from __future__ import annotations

import urllib.error

from slime.utils.http import HttpError, request_json


def probe(url: str, timeout_s: float, generate: bool = True) -> str | None:
    """None when the engine at ``url`` answers 200 within ``timeout_s``, else what it did (one line)."""
    path = "/health_generate" if generate else "/model_info"
    try:
        request_json("GET", f"{url}{path}", timeout=timeout_s)
    except HttpError as exc:
        return f"answered GET {path} with HTTP {exc.status}"
    except (TimeoutError, urllib.error.URLError) as exc:
        if isinstance(exc, TimeoutError) or isinstance(exc.reason, TimeoutError):
            return f"did not answer GET {path} within {timeout_s:.0f} s"
        return f"refused GET {path} ({exc.reason})"
    return None
