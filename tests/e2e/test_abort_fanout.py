"""The abort fan-out of a rollout, counted: ``slime.engine_client.control.EngineAborts`` and
``RolloutClient.abort`` against local aiohttp servers that stand in for the engines
(``POST /abort_request``, counting every post and the posts in flight at once) and for the router
(``GET /workers``).

Nothing tells which engine holds a rid (see ``slime.engine_client.control``), so a by-rid round costs one
post per (engine, rid); what these tests pin down is that a round sends each pair once, on one session with a
bounded number of posts in flight per engine, skips an engine that is gone, stops at the by-rid
phase's deadline, and that the rollout's abort stops repeating rounds once their posts reach
``ABORT_BY_RID_ROUNDS`` full rounds and escalates to ``abort_all``. Before, a full round of
synchronous posts went out again every ``ABORT_RETRY_S`` until ``ABORT_ESCALATE_S``: for the 100
lost aborts on 4 engines below, 1600 posts (4 rounds) and 3.4 s to ``abort_all``; now 800 and 1.3 s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from slime.config.settings.rollout import (
    BatchSettings,
    EngineSettings,
    RewardSettings,
    RolloutSettings,
    SamplingSettings,
)
from slime.config.settings.router import RouterSettings
from slime.engine_client.control import ABORT_CONNECTIONS_PER_ENGINE, EngineAborts
from slime.rollout import sglang_rollout
from slime.rollout.rewards.scoring import RewardChoice
from slime.rollout.router import Router
from slime.rollout.sglang_rollout import RolloutClient
from slime.utils.http import HttpError, free_port
from tests.support.configs import fault_tolerance_settings

ENGINES = 4
RIDS = 100


class Engine:
    """One stand-in engine: counts abort posts and ends the requests it holds as SGLang would, by rid
    (unless ``lose_rid_aborts``: a request held while paused) or by ``abort_all``."""

    def __init__(self, delay_s: float = 0.0, lose_rid_aborts: bool = False, status: int = 200) -> None:
        self.delay_s, self.lose_rid_aborts, self.status = delay_s, lose_rid_aborts, status
        self.rid_posts: collections.Counter[str] = collections.Counter()
        self.all_posts = 0
        self.open = self.peak = 0
        self.held: dict[str, asyncio.Future] = {}
        self.url = ""

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.open -= 1
        if body.get("abort_all"):
            self.all_posts += 1
            ended = list(self.held)
        else:
            self.rid_posts[body["rid"]] += 1
            ended = [] if self.lose_rid_aborts or body["rid"] not in self.held else [body["rid"]]
        for rid in ended:
            self.held.pop(rid).set_result(rid)
        return web.Response(status=self.status)


@contextlib.asynccontextmanager
async def serving(*apps: web.Application) -> AsyncIterator[list[str]]:
    runners = []
    try:
        for app in apps:
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
        yield [f"http://127.0.0.1:{runner.addresses[0][1]}" for runner in runners]
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def engines_and_router(engines: list[Engine]) -> AsyncIterator[str]:
    """Serves ``engines`` and a router listing them; yields the router's URL."""
    apps = []
    for engine in engines:
        app = web.Application()
        app.router.add_post("/abort_request", engine.abort_request)
        apps.append(app)
    async with serving(*apps) as urls:
        for engine, url in zip(engines, urls, strict=True):
            engine.url = url

        async def workers(request: web.Request) -> web.Response:
            return web.json_response({"workers": [{"url": url, "is_healthy": True} for url in urls]})

        router = web.Application()
        router.router.add_get("/workers", workers)
        async with serving(router) as [router_url]:
            yield router_url


def rids(n: int = RIDS) -> list[str]:
    return [
        f"slime-test-{i // 8:010d}_{i % 8}" for i in range(n)
    ]  # batches of 8, as generate_turns names them


def test_a_round_posts_each_rid_once_to_each_engine_with_bounded_posts_in_flight() -> None:
    engines = [Engine(delay_s=0.002) for _ in range(ENGINES)]

    async def scenario() -> list[bool]:
        async with engines_and_router(engines):
            urls = [engine.url for engine in engines]
            async with EngineAborts(urls, max_rid_calls=2 * ENGINES * RIDS, rid_phase_s=30.0) as aborts:
                sent = [await aborts.by_rid(rids())]
                assert aborts.rid_calls == ENGINES * RIDS  # 400 posts: one per (engine, rid)
                sent += [await aborts.by_rid(rids()), await aborts.by_rid(rids()[:1])]
                assert aborts.rid_calls == 2 * ENGINES * RIDS  # the third round would pass the bound
                return sent

    assert asyncio.run(scenario()) == [True, True, False]
    for engine in engines:
        assert engine.rid_posts == collections.Counter({rid: 2 for rid in rids()})
        assert 1 < engine.peak <= ABORT_CONNECTIONS_PER_ENGINE
        assert engine.all_posts == 0


def test_an_engine_that_refuses_the_connection_gets_no_more_rids_and_an_error_answer_is_raised() -> None:
    engines = [Engine() for _ in range(2)]
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def scenario() -> None:
        async with engines_and_router(engines):
            urls = [engines[0].url, gone, engines[1].url]
            async with EngineAborts(urls, max_rid_calls=10 * len(urls) * RIDS, rid_phase_s=30.0) as aborts:
                assert await aborts.by_rid(rids())
                assert aborts.gone == {gone}
                first = aborts.rid_calls  # the gone engine's workers each tried once at most
                assert 2 * RIDS < first <= 2 * RIDS + ABORT_CONNECTIONS_PER_ENGINE
                assert await aborts.by_rid(rids())
                assert aborts.rid_calls == first + 2 * RIDS  # the next round skips it
                await aborts.abort_all()  # a refused abort_all is no error either
                assert aborts.all_calls == 3
                engines[1].status = 500
                with pytest.raises(HttpError, match="answered HTTP 500"):
                    await aborts.by_rid(rids()[:4])

    asyncio.run(scenario())
    assert [engine.all_posts for engine in engines] == [1, 1]
    assert all(engine.rid_posts[rid] == 2 for engine in engines for rid in rids()[4:])


def test_a_round_still_running_at_the_phase_deadline_is_cut_and_the_phase_is_over() -> None:
    """One engine answers 8 posts per 50 ms, so a round of 200 rids would take 1.25 s: it stops at the
    0.3 s the by-rid phase has, and no further round goes out."""
    engines = [Engine(delay_s=0.05)]

    async def scenario() -> tuple[float, int, bool]:
        async with (
            engines_and_router(engines),
            EngineAborts([engines[0].url], max_rid_calls=10_000, rid_phase_s=0.3) as aborts,
        ):
            start = time.monotonic()
            assert not await aborts.by_rid(rids(200))  # cut: the phase is over
            elapsed, calls = time.monotonic() - start, aborts.rid_calls
            return elapsed, calls, await aborts.by_rid(rids(200))

    elapsed, calls, again = asyncio.run(scenario())
    assert elapsed < 0.6 and calls < 100 and not again
    assert sum(engines[0].rid_posts.values()) <= calls


def rollout_client(router_url: str) -> RolloutClient:
    settings = RolloutSettings(
        sampling=SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1, max_response_len=8),
        batch=BatchSettings(
            rollout_batch_size=1,
            n_samples_per_prompt=1,
            over_sampling_batch_size=1,
            concurrency=RIDS * ENGINES,
        ),
        reward=RewardSettings(rm_type="exact"),
        engine=EngineSettings(backend="torch", hf_checkpoint="/unused", seed=0, num_gpus=ENGINES),
        router=RouterSettings(),
        rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
    )
    fault_tolerance = fault_tolerance_settings(trainer_call_timeout_s=0.0)
    args = argparse.Namespace()
    return RolloutClient(args, router_url, settings, fault_tolerance, reward=RewardChoice(rm_type="exact"))


async def abort_requests_on(engines: list[Engine], router_url: str) -> tuple[list, RolloutClient, float]:
    """``RIDS`` requests of one rollout spread over ``engines`` (each held by one of them, as the router
    would place them), then ``RolloutClient.abort``: the groups it returned, the client, the seconds."""
    client = rollout_client(router_url)
    try:

        async def request(rid: str, engine: Engine) -> list[str]:
            engine.held[rid] = asyncio.get_running_loop().create_future()
            client.context.in_flight.add(rid)
            try:
                return [await engine.held[rid]]
            finally:
                client.context.in_flight.discard(rid)

        pending = {
            asyncio.ensure_future(request(rid, engines[i % len(engines)])) for i, rid in enumerate(rids())
        }
        await asyncio.sleep(0)  # every request is on its engine
        start = time.monotonic()
        groups = await client.abort(pending)
        return groups, client, time.monotonic() - start
    finally:
        await client.close()


async def with_engines(engines: list[Engine]) -> tuple[list, RolloutClient, float]:
    async with engines_and_router(engines) as router_url:
        return await abort_requests_on(engines, router_url)


def test_the_rollout_abort_ends_its_requests_in_one_round_of_aborts_by_rid() -> None:
    engines = [Engine() for _ in range(ENGINES)]
    groups, client, _ = asyncio.run(with_engines(engines))
    assert sorted(rid for group in groups for rid in group) == rids() and not client.context.in_flight
    assert sum(sum(engine.rid_posts.values()) for engine in engines) == ENGINES * RIDS  # 400, one round
    assert sum(engine.all_posts for engine in engines) == 0  # nobody else's requests were ended


def test_lost_aborts_by_rid_escalate_to_abort_all_after_two_rounds() -> None:
    """Requests whose abort by rid is lost (held by a paused engine): the by-rid posts stop at
    ``ABORT_BY_RID_ROUNDS`` rounds (800 here) instead of going out every ``ABORT_RETRY_S`` until
    ``ABORT_ESCALATE_S`` (1600 measured before), and ``abort_all`` ends them sooner."""
    engines = [Engine(lose_rid_aborts=True) for _ in range(ENGINES)]
    groups, client, elapsed = asyncio.run(with_engines(engines))
    assert sorted(rid for group in groups for rid in group) == rids() and not client.context.in_flight
    rid_posts = sum(sum(engine.rid_posts.values()) for engine in engines)
    assert rid_posts == sglang_rollout.ABORT_BY_RID_ROUNDS * ENGINES * RIDS == 800
    assert all(engine.rid_posts == collections.Counter({rid: 2 for rid in rids()}) for engine in engines)
    assert [engine.all_posts for engine in engines] == [1] * ENGINES
    assert elapsed < sglang_rollout.ABORT_ESCALATE_S


def test_the_by_rid_phase_bounds_every_rollout_abort_in_time(monkeypatch) -> None:
    """Engines too slow to take one round of by-rid aborts within ``ABORT_ESCALATE_S``: the round is cut
    there and ``abort_all`` goes out at once and ends the rest, so the abort lasts about that long, not
    a round's length (0.6 s here) nor a retry wait more."""
    monkeypatch.setattr(sglang_rollout, "ABORT_ESCALATE_S", 0.3)
    engines = [Engine(delay_s=0.05, lose_rid_aborts=True) for _ in range(ENGINES)]
    groups, client, elapsed = asyncio.run(with_engines(engines))
    assert len(groups) == RIDS and not client.context.in_flight
    assert sum(sum(engine.rid_posts.values()) for engine in engines) < ENGINES * RIDS
    assert [engine.all_posts for engine in engines] == [1] * ENGINES
    assert elapsed < 0.3 + sglang_rollout.ABORT_RETRY_S


@pytest.mark.e2e
def test_the_sglang_router_names_no_worker_in_a_generate_reply(tmp_path) -> None:
    """Why the aborts go to every engine: a real sglang-router (0.3.2) in front of two stand-in engines
    adds no header naming the worker to a ``/generate`` reply (it passes the worker's own headers and
    echoes ``X-Request-ID``; SGLang's server sets none of its own), and ``X-SMG-Target-Worker``, a
    header its binary knows, does not pin a ``/generate`` under ``round_robin``."""
    seen: list[tuple[str, str]] = []

    def stand_in(name: str) -> web.Application:
        async def ok(request: web.Request) -> web.Response:
            return web.json_response(
                {"model_path": str(tmp_path), "is_generation": True, "version": "0.5.23"}
            )

        async def generate(request: web.Request) -> web.Response:
            rid = (await request.json())["rid"]
            seen.append((name, rid))
            meta = {"id": rid, "finish_reason": {"type": "stop"}}
            return web.json_response({"text": "", "output_ids": [], "meta_info": meta})

        app = web.Application()
        for path in ("/health", "/get_model_info", "/model_info", "/get_server_info", "/server_info"):
            app.router.add_get(path, ok)
        app.router.add_post("/generate", generate)
        return app

    async def scenario() -> list[CIMultiDict[str]]:
        async with serving(stand_in("a"), stand_in("b")) as urls:
            router = Router(tmp_path)
            await asyncio.to_thread(router.start)
            try:
                ids = [await asyncio.to_thread(router.add_worker, url) for url in urls]
                headers = []
                async with aiohttp.ClientSession() as session:
                    for i in range(4):
                        payload = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "rid": f"r{i}"}
                        pin = {"X-SMG-Target-Worker": urls[1], "X-Request-ID": f"x{i}"}
                        async with session.post(f"{router.url}/generate", json=payload, headers=pin) as reply:
                            assert reply.status == 200
                            headers.append(reply.headers.copy())  # case-insensitive
            finally:
                await asyncio.to_thread(router.shutdown)
        names = {*urls, *ids, *(url.rsplit(":", 1)[1] for url in urls)}
        assert not [value for reply in headers for value in reply.values() if any(n in value for n in names)]
        return headers

    headers = asyncio.run(scenario())
    assert [reply.get("x-request-id") for reply in headers] == ["x0", "x1", "x2", "x3"]
    assert {name for name, _ in seen} == {"a", "b"}  # round robin, the pin notwithstanding
