"""Engines that fail mid-run: the health cycle, the monitor, request retries, the torch engine's fault
hook, and whole runs with and without ``--use-fault-tolerance``."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from slime.ray.engine_health import EngineHealth, EngineState, HealthMonitor
from slime.ray.engines import engine_problem
from slime.rollout.generate_utils import RolloutContext, _post_with_retries
from slime.utils.http import HttpError, post_json_sync


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_engine_goes_round_the_cycle_and_counts_its_time_out_of_service():
    clock = FakeClock()
    engine = EngineHealth(0, "http://a")
    engine.fail(clock.now, "was killed by SIGKILL")
    engine.restart()
    clock.now += 7
    engine.restarted("http://b")
    assert (engine.state, engine.url, engine.restarts) == (EngineState.STALE, "http://b", 1)
    assert engine.unhealthy_seconds(clock.now) == 7
    with pytest.raises(ValueError, match="cannot restart while stale"):
        engine.restart()
    clock.now += 3  # up, but out of the router until the weights arrived
    engine.serve(clock.now)
    clock.now += 50
    assert engine.state is EngineState.HEALTHY and engine.unhealthy_seconds(clock.now) == 10
    with pytest.raises(ValueError, match="cannot serve while healthy"):
        engine.serve(clock.now)


def test_the_monitor_waits_first_skips_paused_rounds_and_probes_only_serving_engines():
    clock = FakeClock()
    engines = [EngineHealth(0, "http://a"), EngineHealth(1, "http://b"), EngineHealth(2, "http://c")]
    engines[2].state = EngineState.STALE
    answers = {"http://a": None, "http://b": "answered GET /health_generate with HTTP 500"}
    probed, failures = [], []

    def probe(engine):
        probed.append(engine.url)
        return answers[engine.url]

    monitor = HealthMonitor(
        engines, probe, lambda e, why: failures.append((e.rank, why)), 1.0, first_wait_s=30, clock=clock
    )
    assert monitor.tick() == [] and probed == []  # the first wait is not over
    clock.now += 30
    monitor.pause()
    assert monitor.tick() == [] and probed == []
    monitor.resume()
    assert monitor.tick() == [engines[1]]
    assert probed == ["http://a", "http://b"]  # the stale engine is not probed
    assert failures == [(1, "answered GET /health_generate with HTTP 500")]


def test_a_request_an_engine_failed_is_sent_again_and_a_bad_one_is_not():
    """A real HTTP server standing in for the router: 502 twice, then the reply; a 400 is final."""
    calls = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(body["rid"])
        if body["input_ids"] == [9]:
            return web.json_response({"error": "bad request"}, status=400)
        if len(calls) <= 2:
            return web.json_response({"error": "upstream died"}, status=502)
        return web.json_response({"ok": True})

    async def run():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/generate"
        async with aiohttp.ClientSession() as session:
            context = RolloutContext(session, retries=3, retry_wait_s=0.01)
            assert await _post_with_retries(context, url, {"input_ids": [1]}) == {"ok": True}
            assert context.retried == 2 and len(set(calls)) == 3  # a fresh rid per attempt
            assert not context.in_flight
            with pytest.raises(HttpError, match="HTTP 400"):
                await _post_with_retries(context, url, {"input_ids": [9]})
            assert context.retried == 2
            calls.clear()
            no_retry = RolloutContext(session, retries=0)
            with pytest.raises(HttpError, match="HTTP 502"):
                await _post_with_retries(no_retry, url, {"input_ids": [1]})
        await runner.cleanup()

    asyncio.run(run())


@pytest.mark.e2e
def test_the_torch_engine_fails_on_purpose_and_the_probe_says_how(tiny_models, tmp_path):
    """The fault hook the e2e tests use: 500 everywhere, then hung, then killed."""
    from slime.backends.engine_server import start_engine_server
    from slime.backends.torch_engine.launcher import serving

    server = start_engine_server(
        "faulty engine", serving(tiny_models["qwen2"]), tmp_path / "engine.log", timeout_s=120
    )
    url = server.url
    generate = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    try:
        assert engine_problem(url, [None], timeout_s=10) is None
        post_json_sync(f"{url}/slime/inject_fault", {"mode": "error", "after_requests": 2})
        post_json_sync(f"{url}/generate", generate)  # the first request still passes
        with pytest.raises(HttpError, match="HTTP 500"):
            post_json_sync(f"{url}/generate", generate)
        assert engine_problem(url, [None], timeout_s=10) == "answered GET /health_generate with HTTP 500"
        post_json_sync(f"{url}/slime/inject_fault", {"mode": "hang", "after_requests": 0})
        started = time.monotonic()
        assert engine_problem(url, [None], timeout_s=1) == "did not answer GET /health_generate within 1 s"
        assert time.monotonic() - started < 5
        post_json_sync(f"{url}/slime/inject_fault", {"mode": "crash", "after_requests": 1})
        threading.Thread(target=lambda: _ignore_errors(post_json_sync, f"{url}/generate", generate)).start()
        deadline = time.monotonic() + 30
        while server.process.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.process.exit_code() == -9
        assert engine_problem(url, [server.process.exit_code()], 1) == "was killed by SIGKILL"
    finally:
        server.stop()


def _ignore_errors(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # the engine dies under this request: its connection breaks
        print(f"expected: {exc}", file=sys.stderr)
