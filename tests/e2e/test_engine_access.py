"""Who can reach a run's engines (issue 32, item 13).

On one node everything a run opens listens on loopback: Ray (started on 127.0.0.1), the engines, the
router, the trainers' and the weight update's rendezvous. A run that other hosts can reach has an
engine key instead: engines refuse what comes without it (401, as SGLang's ``--api-key`` does), and
every slime client, the router included, sends it; it is never written to a log.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import ipaddress
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import ray
import requests

from slime.backends.engine_server import EngineServer, start_engine_server
from slime.backends.torch_engine.launcher import serving
from slime.config.settings.metrics import run_config
from slime.config.settings.rollout import EngineSettings
from slime.engine_client.control import EngineAborts
from slime.engine_client.generate import client_session, post_json
from slime.ray import cluster
from slime.ray.engines import engine_problem
from slime.rollout.router import Router
from slime.utils.http import (
    ENGINE_API_KEY_ENV,
    get_json,
    post_json_sync,
    redact_argv,
)
from tests.support.configs import cluster_settings
from tests.support.paths import REPO

KEY = "0123456789abcdef" * 4
UNAUTHORIZED = {"error": "Unauthorized"}  # SGLang's 401 body (srt/utils/auth.py, 0.5.19-0.5.23)
GENERATE = {"input_ids": [5, 17, 40], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


# ---- the key and its carriers ----------------------------------------------------------------------


def test_a_servers_logged_command_line_hides_secret_flag_values():
    argv = ["serve", "--api-key", KEY, "--port", "1", "--admin-api-key=x", "--api-key=y", "--host", "h"]
    assert redact_argv(argv) == [
        "serve", "--api-key", "<redacted>", "--port", "1", "--admin-api-key=<redacted>",
        "--api-key=<redacted>", "--host", "h",
    ]  # fmt: skip


def test_a_run_key_is_the_users_or_a_new_one_unless_the_run_is_on_loopback():
    assert cluster.run_api_key(None, loopback=True) is None
    made = {cluster.run_api_key(None, loopback=False) for _ in range(2)}
    assert len(made) == 2 and all(re.fullmatch("[0-9a-f]{64}", key) for key in made)  # never "-..."
    assert (
        cluster.run_api_key("theirs", loopback=True)
        == cluster.run_api_key("theirs", loopback=False)
        == "theirs"
    )
    given = argparse.Namespace(sglang_server_args={"api_key": "theirs"})
    assert run_config(given)["sglang_server_args"] == {"api_key": "<redacted>"}  # what wandb records


@pytest.mark.parametrize(
    ("addr", "loopback"),
    [("127.0.0.1:30000", True), ("http://localhost:1", True), ("[::1]:5", True), ("127.3.2.1:9", True),
     ("10.0.0.5:30000", False), ("http://node-3:30000", False)],
)  # fmt: skip
def test_which_external_engine_addresses_are_loopback(addr, loopback):
    assert cluster.is_loopback(addr) is loopback


def test_both_engine_backends_get_the_run_key_as_sglangs_api_key(monkeypatch):
    from slime.backends import sglang
    from slime.backends.torch_engine import launcher

    args = EngineSettings(
        backend="sglang", hf_checkpoint="/models/m", seed=1, torch_engine_sglang_release="0.5.23"
    )
    commands = {
        "sglang": lambda: sglang.server_command(args, "h", 1, engine_rank=0, num_gpus=1, nccl_port=2),
        "torch": lambda: launcher.server_command(args, "h", 1, engine_rank=0, num_gpus=1),
    }
    for name, command in commands.items():
        monkeypatch.delenv(ENGINE_API_KEY_ENV, raising=False)
        assert "--api-key" not in command(), name
        monkeypatch.setenv(ENGINE_API_KEY_ENV, KEY)
        argv = command()
        assert argv[argv.index("--api-key") + 1] == KEY, name


def test_a_joined_cluster_gets_a_new_key_in_the_jobs_runtime_env(monkeypatch):
    """Every actor of the job gets the key from Ray's job runtime_env, this process from its environment."""
    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: inits.append(kwargs))
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "left by an earlier run")  # and removed after this test
    with socket.create_server(("", 0)) as gcs:  # a GCS port that accepts connections (Ray resolves 127.0.0.1)
        cluster.start_ray(cluster_settings(ray_address=f"127.0.0.1:{gcs.getsockname()[1]}"))
    key = os.environ[ENGINE_API_KEY_ENV]
    assert re.fullmatch("[0-9a-f]{64}", key)
    assert inits[0]["runtime_env"] == {"env_vars": {ENGINE_API_KEY_ENV: key}}


def test_a_cluster_of_its_own_starts_on_loopback_without_a_key(monkeypatch):
    """Its processes inherit the environment Ray starts with (no runtime_env, which would keep Ray from
    reusing its idle workers): gloo on loopback then, and this process's environment as before after."""
    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: inits.append((kwargs, dict(os.environ))))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # what start_ray sets for a cluster of its own
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "left by an earlier run")
    cluster.start_ray(cluster_settings())
    assert ENGINE_API_KEY_ENV not in os.environ
    kwargs, env_at_init = inits[0]
    assert kwargs["_node_ip_address"] == "127.0.0.1"
    assert "runtime_env" not in kwargs
    assert env_at_init["GLOO_SOCKET_IFNAME"] == "lo" and ENGINE_API_KEY_ENV not in env_at_init
    assert "GLOO_SOCKET_IFNAME" not in os.environ


# ---- an engine with a key, and slime's clients ----------------------------------------------------


def start_engine(model: Path, log: Path, *flags: str, host: str = "127.0.0.1") -> EngineServer:
    command = serving(model, "--log-level", "warning", *flags)
    return start_engine_server(
        "torch engine", command, log, timeout_s=120, host=host, env={"OMP_NUM_THREADS": "1"}
    )


@pytest.fixture(scope="module")
def keyed_engine(tiny_models, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """A torch engine started with ``--api-key KEY``: its URL and its log file."""
    log = tmp_path_factory.mktemp("keyed_engine") / "engine.log"
    server = start_engine(tiny_models["qwen2"], log, "--api-key", KEY)
    try:
        yield server.url, log
    finally:
        server.stop()


@pytest.mark.e2e
def test_an_engine_with_a_key_answers_401_without_it_as_sglang(keyed_engine, tiny_models):
    url, log = keyed_engine
    calls = [
        ("/generate", GENERATE),
        ("/update_weights_from_disk", {"model_path": str(tiny_models["qwen2"])}),  # another path: theirs
        ("/pause_generation", {"mode": "abort"}),
    ]
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}]
    for path, body in calls:
        for headers in wrong:
            reply = requests.post(f"{url}{path}", json=body, headers=headers, timeout=30)
            assert (reply.status_code, reply.json()) == (401, UNAUTHORIZED), (path, headers)
    for path in ("/health", "/health_generate"):  # open, as on SGLang: probes need no secret
        assert requests.get(f"{url}{path}", timeout=30).status_code == 200
    assert requests.get(f"{url}/model_info", timeout=30).status_code == 401
    with_key = {"Authorization": f"Bearer {KEY}"}
    for path, body in [*calls, ("/continue_generation", {})]:
        reply = requests.post(f"{url}{path}", json=body, headers=with_key, timeout=60)
        assert reply.status_code == 200, (path, reply.text)
    assert KEY not in log.read_text()  # "$ ... --api-key <redacted>", the key in no line


@pytest.mark.e2e
def test_slime_clients_and_the_router_send_the_run_key(keyed_engine, tmp_path, monkeypatch):
    """The health probe, the JSON client, the rollout's aiohttp session and its aborts send the run's
    key; the router gets it too, demands it of its own clients and sends it to the engines it routes to
    (it reads their model info with it)."""
    url, _ = keyed_engine
    assert engine_problem(url, [None], 30, generate=False) == "answered GET /model_info with HTTP 401"
    monkeypatch.setenv(ENGINE_API_KEY_ENV, KEY)
    assert engine_problem(url, [None], 30, generate=False) is None
    assert engine_problem(url, [None], 30) is None
    post_json_sync(f"{url}/pause_generation", {"mode": "abort"})
    post_json_sync(f"{url}/continue_generation")

    async def rollout_post(target: str) -> dict:
        session, shared = client_session(4)  # what a rollout's generate calls post on
        try:
            return await post_json(session, f"{target}/generate", GENERATE)
        finally:
            if not shared:
                await session.close()

    async def abort_all() -> None:
        async with EngineAborts([url], max_rid_calls=10, rid_phase_s=1.0) as aborts:
            await aborts.abort_all()  # raises the engine's 401, if that is its answer

    asyncio.run(abort_all())
    assert len(asyncio.run(rollout_post(url))["output_ids"]) == 2
    router = Router(tmp_path)
    router.start()
    try:
        router.add_worker(url)
        model_path = get_json(f"{url}/model_info")["model_path"]
        assert get_json(f"{router.url}/workers")["workers"][0]["model_id"] == model_path
        assert len(asyncio.run(rollout_post(router.url))["output_ids"]) == 2
        bare = requests.post(f"{router.url}/generate", json=GENERATE, timeout=30)
        assert bare.status_code == 401  # the router demands the key of its own clients too
    finally:
        router.shutdown()
    assert KEY not in (tmp_path / "router.log").read_text()


# ---- whole runs ------------------------------------------------------------------------------------


def is_loopback_address(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def routable_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
        except OSError:
            return None
        ip = probe.getsockname()[0]
    return None if ipaddress.ip_address(ip).is_loopback else ip


class RunWatch:
    """``train.py`` with ``flags``, and every TCP socket its processes listen on while it runs (all
    descendants of the driver: Ray's own, actors, engines, router), polled until it exits."""

    def __init__(self, flags: list[str]) -> None:
        env = {name: value for name, value in os.environ.items() if name != ENGINE_API_KEY_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "train.py", *flags],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.listening: dict[tuple[str, int], tuple[str, int]] = {}  # (ip, port) -> (command line, pid)
        self.engine_logs: set[Path] = set()  # where the run's engine servers write (their stdout)

    def poll(self) -> None:
        try:
            driver = psutil.Process(self.proc.pid)
            tree = {p.pid: p for p in [driver, *driver.children(recursive=True)]}
        except psutil.NoSuchProcess:
            return
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status != psutil.CONN_LISTEN or conn.pid not in tree:
                continue
            try:
                cmdline = " ".join(tree[conn.pid].cmdline())
            except psutil.NoSuchProcess:
                continue
            self.listening[(conn.laddr.ip, conn.laddr.port)] = (cmdline, conn.pid)
            if "slime.backends.torch_engine" in cmdline:
                with contextlib.suppress(OSError):
                    self.engine_logs.add(Path(os.readlink(f"/proc/{conn.pid}/fd/1")))

    def wait(
        self, during: Callable[[RunWatch], None] | None = None, timeout_s: float = 600
    ) -> tuple[str, str]:
        """Polls until the run exits (``during(self)`` after each poll); its stdout and stderr."""
        deadline = time.monotonic() + timeout_s
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            output = pool.submit(self.proc.communicate)
            while self.proc.poll() is None and time.monotonic() < deadline:
                self.poll()
                if during is not None:
                    during(self)
                time.sleep(0.5)
            if self.proc.poll() is None:
                self.proc.kill()
            out, err = output.result(timeout=60)
        assert self.proc.returncode == 0, err[-3000:]
        return out, err


LISTENERS = ("gcs_server", "raylet", "slime.backends.torch_engine", "sglang::router", "ray::TrainerActor")
"""What a one-node run listens with, by command line (sglang-router 0.3.2 names its process this way)."""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_single_node_run_listens_on_loopback_only(tiny_run_flags):
    """Every socket a one-node run listens on (Ray's, the engine's, the router's, the trainer's and
    the weight update's rendezvous) is on loopback, and the run has no key."""
    watch = RunWatch(tiny_run_flags(rollout_num_gpus=1, actor_num_gpus_per_node=1))
    watch.wait()
    commands = {addr: cmd for addr, (cmd, _) in watch.listening.items()}
    outside = {addr: cmd[:100] for addr, cmd in commands.items() if not is_loopback_address(addr[0])}
    assert not outside, outside
    kinds = {kind for cmd in commands.values() for kind in LISTENERS if kind in cmd}
    assert kinds == set(LISTENERS), kinds
    assert not [cmd for cmd in commands.values() if "--api-key" in cmd]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_other_hosts_can_reach_demands_its_key_everywhere(tiny_models, tiny_run_flags, tmp_path):
    """An engine on another host (here: this host's routable address) makes the run reachable: Ray
    and the run's own engine listen on the node's address, and the engine demands the run's key, the
    external engine's, given with --sglang-api-key (a key the run makes itself travels the same way:
    ``test_a_run_key_is_the_users_or_a_new_one_unless_the_run_is_on_loopback``). The run still rolls
    out through the router and pushes its weights to both engines, and the key is in no log."""
    host = routable_address()
    if host is None:
        pytest.skip("this machine has no routable address")
    external = start_engine(tiny_models["qwen2"], tmp_path / "external.log", "--api-key", KEY, host=host)
    keys: list[str] = []  # the run's key, as its engine server has it

    def probe_own_engine(watch: RunWatch) -> None:  # once, while the run's engine is up
        for (ip, port), (cmd, pid) in list(watch.listening.items()):
            if keys or "slime.backends.torch_engine" not in cmd or f"--port {port} " not in cmd:
                continue
            assert not is_loopback_address(ip), (ip, port)
            try:
                key = psutil.Process(pid).environ()[ENGINE_API_KEY_ENV]
                bare = requests.get(f"http://{ip}:{port}/model_info", timeout=10)
            except (psutil.NoSuchProcess, requests.RequestException):
                return  # not serving yet, or gone
            keyed = requests.get(f"http://{ip}:{port}/model_info", headers=bearer(key), timeout=10)
            assert (bare.status_code, keyed.status_code) == (401, 200)
            keys.append(key)

    try:
        flags = tiny_run_flags(
            "--sglang-api-key", KEY, rollout_num_gpus=1, actor_num_gpus_per_node=1,
            rollout_external_engine_addrs=external.url.removeprefix("http://"),
        )  # fmt: skip
        watch = RunWatch(flags)
        out, err = watch.wait(during=probe_own_engine)
        assert len(keys) == 1 and keys[0] == KEY
        info = requests.get(f"{external.url}/model_info", headers=bearer(KEY), timeout=30).json()
        assert info["weight_version"] not in ("default", None)  # the trainer's pushes reached it
    finally:
        external.stop()
    (log_dir,) = {log.parent for log in watch.engine_logs}
    assert "--api-key <redacted>" in (log_dir / "engine_0.log").read_text()
    logs = [path.read_text(errors="replace") for path in log_dir.iterdir() if path.is_file()]
    assert not [text for text in (out, err, *logs) if keys[0] in text]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
