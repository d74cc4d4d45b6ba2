"""How slime runs sglang-router: its health checks, circuit breaker and retries off, a request timeout
of hours, the user's extra flags checked before anything starts.

The behaviour these settings rely on is sglang-router 0.3.2's, checked here against the real router
process; the worker is a small HTTP server whose ``/health`` turns 503, as SGLang's does while an
engine is paused (its ``/health`` is a generation that waits on the pause, ``http_server.py``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from slime.config import parse_args
from slime.config.settings.router import DEFAULT_REQUEST_TIMEOUT_S, RouterSettings
from slime.rollout.router import Router
from slime.utils.http import get_json, post_json_sync


def test_slime_decides_health_checks_retries_and_the_timeout_and_the_user_may_add_flags(tiny_run_flags):
    args = parse_args(tiny_run_flags("--router-extra-args", "--policy cache_aware", rollout_num_gpus=1))
    settings = RouterSettings.from_args(args)
    argv = settings.argv()
    assert {"--disable-health-check", "--disable-circuit-breaker", "--disable-retries"} <= set(argv)
    assert argv[argv.index("--request-timeout-secs") + 1] == str(round(DEFAULT_REQUEST_TIMEOUT_S)) == "21600"
    assert argv[-2:] == ["--policy", "cache_aware"] and settings.check() is None
    flags = tiny_run_flags("--router-request-timeout", "90", rollout_num_gpus=1)
    timeout = parse_args(flags).router_request_timeout
    assert RouterSettings(request_timeout_s=timeout).argv()[4] == "90"


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ("--polcy cache_aware", "sglang-router refuses them: unrecognized arguments: --polcy cache_aware"),
        ("--policy nope", "sglang-router refuses them: argument --policy: invalid choice: 'nope'"),
        ("--policy 'cache_aware", "cannot be split into flags: No closing quotation"),
    ],
)
def test_router_flags_it_would_refuse_are_one_line_before_start(tiny_run_flags, capsys, extra, problem):
    with pytest.raises(SystemExit):
        parse_args(tiny_run_flags("--router-extra-args", extra, rollout_num_gpus=1))
    message = capsys.readouterr().err
    assert message.startswith("error: --router-extra-args: ") and problem in message, message
    assert message.count("\n") == 1


@pytest.mark.parametrize("health_checks_off", [True, False])
def test_a_worker_whose_health_turns_503_stays_routed_only_with_the_health_checks_off(
    tmp_path, health_checks_off
):
    """A router probing every second and failing a worker after one failed probe: with slime's settings
    the worker stays healthy and routed while ``/health`` answers 503 (the router probes it once, when
    it is added); with the router's own health checks on it is dropped and ``/generate`` gets 503
    ``no_available_workers``, which is what a long train step did to every engine."""
    fast = (
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        "--health-check-timeout-secs",
        "1",
    )
    settings = RouterSettings(extra_args=fast)
    if not health_checks_off:
        settings = _with_health_checks(settings)
    outcome = asyncio.run(_route_through_a_pause(tmp_path, settings))
    if health_checks_off:
        assert outcome == {"healthy": [True], "generate": "routed"}
    else:
        assert outcome["healthy"] in ([False], []) and "no_available_workers" in outcome["generate"]


class _NoOwnChecks(RouterSettings):
    def argv(self) -> list[str]:
        return [flag for flag in super().argv() if flag != "--disable-health-check"]


def _with_health_checks(settings: RouterSettings) -> RouterSettings:
    return _NoOwnChecks(request_timeout_s=settings.request_timeout_s, extra_args=settings.extra_args)


async def _route_through_a_pause(tmp_path, settings: RouterSettings) -> dict:
    health = {"status": 200}

    async def answer_health(request: web.Request) -> web.Response:
        return web.Response(status=health["status"])

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": str(tmp_path), "is_generation": True})

    async def generate(request: web.Request) -> web.Response:
        return web.json_response(
            {"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}}
        )

    app = web.Application()
    app.router.add_get("/health", answer_health)
    app.router.add_get("/health_generate", answer_health)
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        app.router.add_get(path, model_info)
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    worker = f"http://127.0.0.1:{runner.addresses[0][1]}"
    router = Router(tmp_path, settings=settings)
    try:
        await asyncio.to_thread(router.start)
        await asyncio.to_thread(router.add_worker, worker)
        health["status"] = 503  # the engine is paused for a train step
        await asyncio.sleep(4)
        healthy = [w["is_healthy"] for w in await asyncio.to_thread(router.workers)]
        try:
            await asyncio.to_thread(
                post_json_sync, f"{router.url}/generate", {"input_ids": [1], "sampling_params": {}}
            )
            routed = "routed"
        except Exception as exc:
            routed = str(exc)
        return {"healthy": healthy, "generate": routed}
    finally:
        await asyncio.to_thread(router.shutdown)
        await runner.cleanup()


def test_the_router_answers_its_worker_list_at_once_after_start(tmp_path):
    """The flags slime adds start a real sglang-router 0.3.2."""
    router = Router(tmp_path)
    try:
        started = time.monotonic()
        router.start()
        assert get_json(f"{router.url}/workers")["workers"] == []
        assert time.monotonic() - started < 60
    finally:
        router.shutdown()
