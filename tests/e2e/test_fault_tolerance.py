"""Engines that fail mid-run: the health cycle, the monitor, request retries, the torch engine's fault
hook, and whole runs with and without ``--use-fault-tolerance``."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from slime.ray.engine_health import EngineHealth, EngineState, HealthMonitor
from slime.ray.engines import engine_problem
from slime.rollout.errors import EngineFailure
from slime.rollout.generate_utils import RolloutContext, _post_with_retries
from slime.utils.http import HttpError, post_json_sync
from tests.support.http_servers import with_http_server
from tests.support.train_runs import crash_env


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

    def probe(engine, live_only):
        assert not live_only
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
    engines[1].fail(clock.now, "its restart failed")  # what on_failure leaves when the restart fails
    assert monitor.tick() == [engines[1]] and failures[-1] == (1, "its restart failed")  # tried again


def test_a_round_probes_16_slow_engines_at_once_and_a_pause_never_waits_for_it():
    """SGLang's ``/health_generate`` takes at least a second (it polls once a second,
    ``entrypoints/http_server.py`` 0.5.19-0.5.23): 16 real HTTP engines answering in 1 s are probed
    concurrently, not one after the other; ``pause`` during the round returns at once and the round's
    answers are thrown away (a probe of an engine being paused may fail for that reason alone)."""
    in_flight, most = [0], [0]

    async def slow_health(request: web.Request) -> web.Response:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(1.0)
        in_flight[0] -= 1
        return web.Response(status=503 if request.match_info["n"] == "3" else 200)

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/e{n}/health_generate", slow_health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            await probe_rounds([EngineHealth(n, f"{base}/e{n}") for n in range(16)])
        finally:
            await runner.cleanup()

    async def probe_rounds(engines: list[EngineHealth]) -> None:
        failures = []
        monitor = HealthMonitor(
            engines,
            lambda e, live_only: engine_problem(e.url, [None], timeout_s=10, generate=not live_only),
            lambda e, why: failures.append((e.rank, why)),
            interval_s=60,
            first_wait_s=0,
        )
        started = time.monotonic()
        assert await asyncio.to_thread(monitor.tick) == [engines[3]]
        elapsed = time.monotonic() - started
        assert most[0] == 16 and elapsed < 8, (most, elapsed)  # serial: 16 s
        assert failures == [(3, "answered GET /health_generate with HTTP 503")]
        ticking = asyncio.create_task(asyncio.to_thread(monitor.tick))
        await asyncio.sleep(0.3)  # the round's probes are in flight
        started = time.monotonic()
        monitor.pause()
        assert time.monotonic() - started < 0.1
        assert await ticking == [] and len(failures) == 1  # answers of a paused round are void

    asyncio.run(run())


def test_a_forced_round_while_paused_only_checks_liveness_and_waits_for_a_round_only_so_long():
    """Before a push the engines may be paused or released (``--colocate``): a forced round then
    probes without generating. A round held up by a restart is waited for at most ``wait_s``."""
    engines = [EngineHealth(0, "http://a")]
    seen = []
    release = threading.Event()

    def probe(engine, live_only):
        seen.append(live_only)
        return None

    monitor = HealthMonitor(engines, probe, lambda e, why: release.wait(10), 60, first_wait_s=0)
    monitor.pause()
    assert monitor.tick(force=True) == [] and seen == [True]
    monitor.resume()
    assert monitor.tick(force=True) == [] and seen == [True, False]
    engines[0].state = EngineState.FAILED  # its restart (on_failure) hangs until released
    holder = threading.Thread(target=monitor.tick)
    holder.start()
    time.sleep(0.2)
    started = time.monotonic()
    assert monitor.tick(force=True, wait_s=0.5) == []
    assert 0.4 < time.monotonic() - started < 5
    release.set()
    holder.join(10)


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

    async def run(url: str):
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

    asyncio.run(with_http_server("/generate", generate, run))


def test_a_batch_is_in_flight_under_the_rids_sglang_gives_its_inputs_and_is_retried_whole():
    """One rid per attempt for the batch; while it is out its inputs are in flight as ``<rid>_<i>``
    (the names SGLang and the torch engine give them, the ones an abort must name), each counted
    as a retried request."""
    seen: list[tuple[str, list[str]]] = []
    holder: list[RolloutContext] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((body["rid"], sorted(holder[0].in_flight)))
        if len(seen) == 1:
            return web.json_response({"error": "upstream died"}, status=502)
        return web.json_response([{"n": i} for i in range(len(body["input_ids"]))])

    async def run(url: str):
        async with aiohttp.ClientSession() as session:
            context = RolloutContext(session, retries=1, retry_wait_s=0.01)
            holder.append(context)
            reply = await _post_with_retries(context, url, {"input_ids": [[1], [2]]})
            assert reply == [{"n": 0}, {"n": 1}]
            assert context.retried == 2 and not context.in_flight

    asyncio.run(with_http_server("/generate", generate, run))
    (first, first_flight), (second, second_flight) = seen
    assert first != second
    assert first_flight == [f"{first}_0", f"{first}_1"] and second_flight == [f"{second}_0", f"{second}_1"]


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _ignore_errors(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # the engine dies under this request: its connection breaks
        print(f"expected: {exc}", file=sys.stderr)


FAST_PROBES = {
    "use_fault_tolerance": True,
    "rollout_health_check_interval": "0.5",
    "rollout_health_check_timeout": "5",
    "rollout_health_check_first_wait": "0",
}
"""Probes twice a second from the start (the defaults wait 300 s first, for large models)."""
TWO_ENGINES = {"rollout_num_gpus": 2, "actor_num_gpus_per_node": 1, "log_level": "INFO"}


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_engine_stops_a_plain_run_in_one_line_and_a_tolerant_run_goes_on(tiny_run_flags, tmp_path):
    """Rollouts of 4 prompts × 2 samples on 2 engines, a batched /generate per prompt group: 2
    requests per engine per rollout, so the 3rd request of an engine comes in rollout 1. Without the
    flag the run stops there in one line naming the engine, checkpointed; resumed with the flag (and
    an engine killed again at its 2nd request, in the first rollout) it finishes: every rollout full,
    one restart, every sample generated with the then-current weights (a restarted engine serving
    its start-up weights would give "1")."""
    import torch

    from tests.support.train_runs import read_events, run_train

    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    common = ["--save", str(ckpt), "--save-interval", "10"]  # no regular save before the last rollout
    flags = tiny_run_flags(*common, **TWO_ENGINES, num_rollout=4)
    result = run_train(flags, exit_code=1, env=crash_env(tmp_path, "first", 3))
    lines = [line for line in result.stderr.splitlines() if "was killed by SIGKILL" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert re.search(r"engine \d \(http://[\d.:]+\) was killed by SIGKILL", lines[0]), lines
    assert "add --use-fault-tolerance" in lines[0] and "Traceback" not in result.stderr
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved in (0, 1)  # rollout 1 failed while generating (0 trained) or at its push (1 trained)
    assert f"checkpointed rollout {saved} before stopping" in result.stderr
    assert (ckpt / "rollout" / f"data_source_{saved}.json").is_file()

    debug = tmp_path / "rollout_{rollout_id}.pt"
    flags = tiny_run_flags(
        *common, "--load", str(ckpt), "--tb-dir", str(tb), "--save-debug-rollout-data", str(debug),
        **TWO_ENGINES, **FAST_PROBES, num_rollout=saved + 3,
    )  # fmt: skip
    result = run_train(flags, env=crash_env(tmp_path, "second", 2))
    assert f"at rollout {saved + 1}" in result.stderr
    scalars = read_events(tb)
    rollouts = [saved + 1, saved + 2]  # the kill in the first, the restarted engine serving in the second
    assert [step for step, _ in scalars["rollout/num_samples"]] == rollouts
    assert all(value == 8 for _, value in scalars["rollout/num_samples"])
    assert sum(value for _, value in scalars["fault/engine_restarts"]) == 1
    for rollout_id in rollouts:  # the weights of rollout k's generation are version k + 1
        data = torch.load(str(debug).format(rollout_id=rollout_id), weights_only=False)
        assert len(data["tokens"]) == 8
        assert {v for versions in data["weight_versions"] for v in versions} == {str(rollout_id + 1)}


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_hung_engine_and_an_erroring_one_are_replaced_and_serve_again_after_a_push(
    ray_cluster, tiny_run_flags, tmp_path
):
    """Detected within interval + timeout, out of the router at once, restarted on the same bundle at
    a new URL, kept out of the router until the weights were pushed (no trainer here: the push is only
    announced), then a full rollout on both."""
    import ray

    from slime.config import parse_args
    from slime.rollout.router import list_workers
    from tests.support.rollouts import running_rollout_manager

    probes = {**FAST_PROBES, "rollout_health_check_timeout": "2"}
    args = parse_args(tiny_run_flags(**TWO_ENGINES, **probes))
    with running_rollout_manager(args, tmp_path) as (manager, _, router_url):

        def routed() -> list[str]:
            return sorted(worker["url"] for worker in list_workers(router_url))

        def serving() -> list[str]:
            return ray.get(manager.serving_engine_urls.remote())

        for rank, mode in ((0, "hang"), (1, "error")):
            old = serving()[rank]
            post_json_sync(f"{old}/slime/inject_fault", {"mode": mode, "after_requests": 0})
            # Out of the router after two failed probes in a row (+ slack for a loaded machine).
            wait_for(lambda old=old: old not in routed(), 2 * (0.5 + 2) + 5, f"the {mode} engine taken out")
            up = wait_for(lambda old=old: len(s := serving()) == 2 and old not in s and s, 120, "a restart")
            assert up[rank] not in routed()  # stale: it has not received the weights yet
            assert ray.get(manager.rejoin_router.remote(up)) == [rank]
            assert routed() == sorted(up)
        generated = ray.get(manager.generate.remote(0))
        assert generated.metrics["rollout/num_samples"] == 8
        assert ray.get(manager.engine_urls.remote()) == up


@pytest.mark.e2e
def test_without_the_flag_a_hung_engine_ends_the_rollout_in_one_line_naming_it(
    ray_cluster, tiny_run_flags, tmp_path
):
    """A plain run probes its engines too: a hung engine would otherwise hold its requests for good
    (the rollout sets no total timeout). It is stopped and the rollout fails with one line."""
    import ray

    from slime.config import parse_args
    from tests.support.rollouts import running_rollout_manager

    probes = {**FAST_PROBES, "use_fault_tolerance": None, "rollout_health_check_timeout": "2"}
    args = parse_args(tiny_run_flags(**probes, rollout_num_gpus=1))
    with running_rollout_manager(args, tmp_path) as (manager, urls, _):
        [pid] = ray.get(manager.pids.remote())["engines"]
        post_json_sync(f"{urls[0]}/slime/inject_fault", {"mode": "hang", "after_requests": 2})
        started = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            ray.get(manager.generate.remote(0), timeout=120)
        assert time.monotonic() - started < 60
        assert isinstance(raised.value.cause, EngineFailure)
        message = str(raised.value.cause)
        assert message == (
            f"engine 0 ({urls[0]}) did not answer GET /health_generate within 2 s; "
            "add --use-fault-tolerance to restart failed engines and retry their requests"
        ), message
        # Stopped, not left hanging (its requests may fail while it is still exiting).
        wait_for(lambda: not _alive(pid), 30, f"engine process {pid} stopped")


# ---- the real server's behaviour: health checks that generate, held restarts, bounded starts ------


class _Pool:
    """An ``EnginePool``'s surface as ``EngineRecovery`` uses it, recording each call."""

    def __init__(self, restart=None) -> None:
        self.urls = ["http://a", "http://b"]
        self.start_timeout_s, self.scheduling_allowance_s = 1.0, 1.0
        self.calls: list[tuple[str, int]] = []
        self._restart = restart or (lambda rank: f"http://new{rank}")

    def exit_codes(self, rank: int) -> list:
        return [None]

    def stop(self, rank: int) -> None:
        self.calls.append(("stop", rank))

    def restart(self, rank: int) -> str:
        self.calls.append(("restart", rank))
        return self._restart(rank)


class _Router:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove_worker(self, url: str) -> None:
        self.removed.append(url)


def _recovery(pool: _Pool):
    from slime.ray.engine_recovery import EngineRecovery
    from tests.support.configs import fault_tolerance_settings

    fault_tolerance = fault_tolerance_settings(
        enabled=True,
        health_check_interval_s=60.0,
        health_check_timeout_s=1.0,
        health_check_first_wait_s=0.0,
        trainer_call_timeout_s=0.0,
    )
    recovery = EngineRecovery(fault_tolerance, pool, _Router())
    recovery.monitor.probe = lambda engine, live_only: None  # the engines that run answer well
    return recovery


def test_a_failure_found_while_the_engines_are_released_restarts_only_after_the_resume():
    """``--colocate``: while the engines are paused or released the trainer holds the GPUs, and a fresh
    engine takes its whole memory share at start. The failed engine leaves the router and is stopped
    at once; its restart waits for the resume (and the round the resume starts)."""
    pool = _Pool()
    recovery = _recovery(pool)
    recovery.monitor.pause()
    recovery._on_failure(recovery.engines[0], "was killed by SIGKILL")
    assert pool.calls == [("stop", 0)] and recovery.router.removed == ["http://a"]
    assert recovery.engines[0].state is EngineState.FAILED
    recovery.check_now()  # the push's round while released: live-only probes, still no restart
    assert pool.calls == [("stop", 0)]
    recovery.monitor.resume()
    assert recovery.monitor._wake.is_set()  # the monitor's thread runs a round now, not an interval later
    recovery.monitor.tick()
    assert pool.calls == [("stop", 0), ("restart", 0)]
    assert recovery.engines[0].state is EngineState.STALE and recovery.serving_urls() == [
        "http://new0",
        "http://b",
    ]


def test_a_restart_whose_actor_dies_is_failed_not_restarting_and_given_up_after_three():
    """Any error of a restart (a dead actor is a ``RayActorError``, not an ``EngineStartError``) leaves
    the engine FAILED for the next round; after ``MAX_FAILED_RESTARTS`` in a row it is given up and
    the run goes on with the others."""
    from slime.ray.engine_recovery import MAX_FAILED_RESTARTS

    def dies(rank: int) -> str:
        raise RuntimeError("The actor died unexpectedly before finishing this task.")

    pool = _Pool(restart=dies)
    recovery = _recovery(pool)
    engine = recovery.engines[1]
    recovery._on_failure(engine, "was killed by SIGKILL")
    assert engine.state is EngineState.FAILED and engine.failed_restarts == 1
    died = "The actor died unexpectedly before finishing this task."
    assert engine.reason == f"was killed by SIGKILL; its restart failed: {died}"
    for _ in range(5):
        recovery.monitor.tick()
    assert pool.calls.count(("restart", 1)) == MAX_FAILED_RESTARTS == 3
    assert recovery.serving_urls() == ["http://a"]


@pytest.mark.e2e
def test_an_engine_start_that_cannot_be_placed_or_whose_actor_dies_is_one_error_in_bounded_time(
    ray_cluster, tiny_run_flags, tmp_path
):
    """A lost node's bundles are never placed: the restart gives up after the start timeout plus the
    placement allowance instead of hanging the run. An actor killed while its server starts is an
    ``EngineStartError`` saying so, not a raw Ray error."""
    import ray

    from slime.config import parse_args
    from slime.config.settings.cluster import ClusterSettings
    from slime.config.settings.rollout import EngineSettings
    from slime.ray.cluster import create_placement_group, release_placement_group
    from slime.ray.engines import EngineActor, EnginePool, EngineStartError

    args = parse_args(tiny_run_flags(rollout_num_gpus=1))
    engine = EngineSettings.from_args(args)
    pg = create_placement_group(1)
    pool = EnginePool(engine, ClusterSettings.from_args(args), pg, [0], str(tmp_path))
    pool.urls = ["http://never-started"]
    pool.start_timeout_s, pool.scheduling_allowance_s = 2.0, 2.0
    real_actor = pool._actor
    try:
        pool._actor = lambda node: EngineActor.options(num_cpus=0, resources={"a_lost_node": 1}).remote(
            engine, node, str(tmp_path)
        )
        started = time.monotonic()
        with pytest.raises(
            EngineStartError, match=r"engine 0 did not come up within 4 s .*to place its actor"
        ):
            pool.restart(0)
        assert time.monotonic() - started < 30 and pool.restarting_since(0) is None

        def kill_once_starting(node):
            actor = real_actor(node)
            threading.Timer(1.0, lambda: ray.kill(actor)).start()
            return actor

        pool._actor = kill_once_starting
        pool.start_timeout_s = 120.0
        with pytest.raises(EngineStartError, match="engine 0: its actor died while starting"):
            pool.restart(0)
    finally:
        pool.shutdown()
        release_placement_group(pg)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_train_step_longer_than_the_routers_failure_window_keeps_every_engine_routed(
    tiny_run_flags, tmp_path
):
    """The engines are paused for the whole train step, checkpoint and push, and SGLang's ``/health``
    (a generation) answers 503 while paused: a router probing every second, failing a worker after
    one probe of 1 s, would drop both engines during the checkpoint (≈ 3 s) and the next rollout would
    get 503 ``no_available_workers`` (seen with the health checks on). slime runs the router with its
    health checks off, so every rollout finishes."""
    from slime.utils.startup import STARTUP_LOG_ENV, read_marks
    from tests.support.train_runs import run_train

    router = "--health-check-interval-secs 1 --health-failure-threshold 1 --health-check-timeout-secs 1"
    flags = tiny_run_flags(
        "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--router-extra-args", router,
        **TWO_ENGINES, num_rollout=3,
    )  # fmt: skip
    marks_log = tmp_path / "startup.jsonl"
    result = run_train(flags, env={STARTUP_LOG_ENV: str(marks_log)})
    assert "no_available_workers" not in result.stderr
    assert int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text()) == 2
    # Every process marked its start-up (bench/step_profile.py's split): each engine's server, each
    # trainer rank, and the first request only once both engines joined the router.
    marks = read_marks(marks_log)
    pids: dict[str, set[int]] = {}
    for m in marks:
        pids.setdefault(m["what"], set()).add(m["pid"])
    assert len(pids["engine server: model loaded"]) == 2
    assert pids["trainer: ready"] == pids["trainer: actor up"] and pids["trainer: ready"]
    reached = {m["what"]: m["t"] for m in marks}
    order = ["driver: ray up", "rollout manager: up", "engine actor: up", "engine server: model loaded",
             "rollout manager: engines in the router", "rollout: first /generate sent"]  # fmt: skip
    assert [reached[what] for what in order] == sorted(reached[what] for what in order)


@pytest.mark.e2e
@pytest.mark.slow
def test_colocated_fault_tolerant_run_never_sends_a_generation_to_a_released_engine(tiny_run_flags, tmp_path):
    """``--colocate --use-fault-tolerance``: the probes and the router's admission never generate on an
    engine whose memory is released (each engine logs any such request), and an engine killed in
    rollout 1 is restarted and serves again; every rollout finishes."""
    from tests.support.train_runs import read_events, run_train

    logs_root = Path(tempfile.gettempdir()) / "slime_logs"
    before = set(logs_root.glob("*")) if logs_root.exists() else set()
    tb = tmp_path / "tb"
    flags = tiny_run_flags(
        "--colocate", "--tb-dir", str(tb), **FAST_PROBES, actor_num_gpus_per_node=2, num_rollout=3
    )
    run_train(flags, env=crash_env(tmp_path, "colocated", 3))
    scalars = read_events(tb)
    assert [value for _, value in scalars["rollout/num_samples"]] == [8, 8, 8]
    assert sum(value for _, value in scalars["fault/engine_restarts"]) == 1
    # This run's engine logs: the new log directory whose engine was killed by the injected fault.
    [run_logs] = [
        new for new in set(logs_root.glob("*")) - before
        if any("injected fault: crash" in log.read_text() for log in new.glob("engine_*.log"))
    ]  # fmt: skip
    logs = sorted(run_logs.glob("engine_*.log"))
    assert len(logs) == 2
    for log in logs:
        assert "while its memory is released" not in log.read_text(), log
