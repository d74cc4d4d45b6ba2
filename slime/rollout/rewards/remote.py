"""Remote reward model: one HTTP POST per sample to ``--rm-url``.

Request body: ``{"prompt", "response", "label", "metadata"}`` as JSON. Reply: a JSON number, or an
object with a numeric ``"reward"``. Anything else, a non-200 status, a refused connection or no answer
within ``REMOTE_TIMEOUT_S`` raises ``RewardError`` naming the URL, which ``score_groups`` turns into a
FAILED sample instead of a crashed rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import aiohttp

from slime.config.settings.rollout import RewardSettings
from slime.rollout.plugin_args import settings_of
from slime.rollout.rewards.errors import RewardError
from slime.rollout.sample import Sample

REMOTE_TIMEOUT_S = 60.0
"""Seconds one reward request may take, connection included."""


async def post_reward(url: str, payload: dict[str, Any], timeout: float = REMOTE_TIMEOUT_S) -> float:
    """POST ``payload`` to a reward server and return the reward it answers."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.post(url, json=payload) as response,
        ):
            body = await response.text()
            status = response.status
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise RewardError(f"reward model {url} did not answer within {timeout:g} s") from e
    except aiohttp.ClientError as e:
        raise RewardError(f"cannot reach reward model {url} ({type(e).__name__}: {e})") from e
    if status != 200:
        raise RewardError(f"reward model {url} answered HTTP {status}: {body[:200]}")
    try:
        reply = json.loads(body)
    except json.JSONDecodeError as e:
        raise RewardError(f"reward model {url} answered non-JSON: {body[:200]!r}") from e
    if isinstance(reply, dict):
        reply = reply.get("reward")
    if isinstance(reply, bool) or not isinstance(reply, (int, float)):
        raise RewardError(
            f'reward model {url} answered {body[:200]}; expected a number or {{"reward": <number>}}'
        )
    return float(reply)


async def remote_reward(args: argparse.Namespace, sample: Sample) -> float:
    """The ``remote`` built-in: score ``sample`` with the reward server at ``--rm-url``."""
    payload = {
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": sample.metadata,
    }
    url = settings_of(args, RewardSettings).rm_url
    assert url is not None  # the config checks require --rm-url with the remote reward
    return await post_reward(url, payload)
