"""Rollout engines on GPU bundles: one Ray actor per engine, each owning one engine server process.

An engine spans ``--rollout-num-gpus-per-engine`` consecutive bundles of the placement group. Its
actor holds the first bundle's GPU and the other bundles stay reserved for the engine's other GPUs,
so no trainer or second engine is ever placed on them. The actor starts the server as a child
process (``slime.utils.http.ServerProcess``: own process group, log file, killed with the actor)
and reports its URL once ``GET /health_generate`` succeeds, i.e. once it really generates.

Which server runs is decided in one place, ``engine_command``: SGLang on GPU nodes, the in-repo
torch engine elsewhere (DESIGN.md §1). Both speak the same HTTP protocol, so nothing after
start-up knows which one it talks to.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.utils.http import ServerProcess, ServerStartError, free_port, is_ok, post_json_sync

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 300.0
# --sglang-* options slime sets itself for every engine; a user value would break the placement.
MANAGED_SERVER_ARGS = ("model_path", "host", "port", "tp_size")


class EngineStartError(RuntimeError):
    """An engine that did not come up; the message carries the tail of its log."""


def resolve_backend(args: argparse.Namespace) -> str:
    """``--rollout-backend``, or when unset: SGLang if it imports and a GPU is visible, else torch."""
    if args.rollout_backend is not None:
        return args.rollout_backend
    from slime.backends import sglang

    if not sglang.is_available():
        return "torch"
    from slime.utils.device import has_gpu

    return "sglang" if has_gpu() else "torch"


def server_flags(server_args: dict[str, Any]) -> list[str]:
    """``args.sglang_server_args`` back into command-line flags (``{"a_b": "1"}`` -> ``--a-b 1``)."""
    flags: list[str] = []
    for name, value in server_args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            flags += [flag, *(str(v) for v in value)]
        else:
            flags += [flag, str(value)]
    return flags


def torch_engine_command(
    args: argparse.Namespace, host: str, port: int, *, engine_rank: int, num_gpus: int
) -> list[str]:
    """``python -m slime.backends.torch_engine`` with slime's settings, then every ``--sglang-*`` option.

    The torch engine honours the SGLang options it implements and exits with status 2 naming any
    other, so an unsupported option fails start-up instead of being dropped silently.
    """
    passed = dict(args.sglang_server_args or {})
    managed = sorted(name for name in MANAGED_SERVER_ARGS if name in passed)
    if managed:
        flags = ", ".join("--sglang-" + name.replace("_", "-") for name in managed)
        raise EngineStartError(
            f"{flags} is set by slime for each engine (from --hf-checkpoint, the placement and "
            "--rollout-num-gpus-per-engine); drop it"
        )
    argv = [sys.executable, "-m", "slime.backends.torch_engine"]
    argv += ["--model-path", str(Path(args.hf_checkpoint).resolve())]
    argv += ["--host", host, "--port", str(port)]
    if num_gpus != 1:
        argv += ["--tp-size", str(num_gpus)]  # refused by the torch engine with a clear line
    passed.setdefault("random_seed", args.rollout_seed + engine_rank)
    passed.setdefault("log_level", str(getattr(args, "log_level", "info")).lower())
    return argv + server_flags(passed)


def engine_command(
    args: argparse.Namespace, host: str, port: int, *, backend: str, engine_rank: int, num_gpus: int
) -> list[str]:
    """The one switch between the engine backends: the argv of one engine server."""
    if backend == "torch":
        return torch_engine_command(args, host, port, engine_rank=engine_rank, num_gpus=num_gpus)
    if backend == "sglang":
        from slime.backends import sglang

        return sglang.server_command(args, host, port, engine_rank=engine_rank, num_gpus=num_gpus)
    raise ValueError(f"unknown rollout backend {backend!r}; expected sglang or torch")


@ray.remote(num_gpus=1)
class EngineActor:
    """One engine: starts its server on this node, reports the URL, stops it on ``shutdown``."""

    def __init__(self, args: argparse.Namespace, rank: int, num_gpus: int, log_dir: str) -> None:
        self.args, self.rank, self.num_gpus = args, rank, num_gpus
        self.log_path = Path(log_dir) / f"engine_{rank}.log"
        self.server: ServerProcess | None = None
        self.url: str | None = None

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> str:
        """Starts the server and waits until it generates; returns its URL (raises with the log tail)."""
        host = ray.util.get_node_ip_address()
        port = free_port()
        backend = resolve_backend(self.args)
        argv = engine_command(
            self.args, host, port, backend=backend, engine_rank=self.rank, num_gpus=self.num_gpus
        )
        self.server = ServerProcess(f"{backend} engine {self.rank}", argv, self.log_path, dict(os.environ))
        self.server.start()
        url = f"http://{host}:{port}"
        try:
            self.server.wait_ready(lambda: is_ok(f"{url}/health_generate", timeout=10), timeout_s)
        except ServerStartError as exc:
            raise EngineStartError(str(exc)) from None
        self.url = url
        return url

    def pid(self) -> int | None:
        return None if self.server is None else self.server.pid

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()


class EnginePool:
    """The engines of one placement group: placed together, started together, stopped together.

    No bundles, no engines: runs that generate nothing (SFT, train-only debugging) use an empty pool.
    """

    def __init__(
        self, args: argparse.Namespace, pg: PlacementGroup, bundle_indices: list[int], log_dir: str
    ) -> None:
        per_engine = args.rollout_num_gpus_per_engine
        if len(bundle_indices) % per_engine:
            raise ValueError(
                f"{len(bundle_indices)} rollout bundles do not split into engines of "
                f"--rollout-num-gpus-per-engine {per_engine}"
            )
        from slime.utils.device import worker_env

        num_engines = len(bundle_indices) // per_engine
        per_node = max(1, min(num_engines, args.num_gpus_per_node // per_engine))
        env = worker_env(processes_per_node=per_node)
        self.actors = [
            EngineActor.options(
                num_cpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=bundle_indices[rank * per_engine]
                ),
                runtime_env={"env_vars": env},
            ).remote(args, rank, per_engine, log_dir)
            for rank in range(num_engines)
        ]
        self.urls: list[str] = []

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> list[str]:
        """Starts every engine; the first failure stops them all and raises ``EngineStartError``."""
        if not self.actors:
            return []
        refs = [actor.start.remote(timeout_s) for actor in self.actors]
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done[0])
        except ray.exceptions.RayTaskError as exc:
            self.shutdown()
            cause = exc.cause if exc.cause is not None else exc
            raise EngineStartError(str(cause)) from None
        self.urls = ray.get(refs)
        return list(self.urls)

    def pids(self) -> list[int | None]:
        return ray.get([actor.pid.remote() for actor in self.actors])

    def post_all(self, path: str, payload: dict[str, Any] | None = None, timeout: float = 60.0) -> list:
        """The same POST to every engine, in parallel; answers in engine order."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.urls))) as pool:
            return list(pool.map(lambda url: post_json_sync(f"{url}{path}", payload, timeout), self.urls))

    def pause(self, mode: str = "abort") -> None:
        """``/pause_generation`` on every engine (SGLang modes: abort, retract, in_place)."""
        self.post_all("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self.post_all("/continue_generation")

    def shutdown(self) -> None:
        """Stops every server, then the actors; safe to call twice."""
        if not self.actors:
            return
        refs = [actor.shutdown.remote() for actor in self.actors]
        try:
            ray.get(refs, timeout=60)
        except Exception as exc:  # the actor died or hangs: killing it kills its server (parent-death signal)
            logger.warning("engine shutdown did not finish cleanly (%s); killing the actors", exc)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        self.urls = []
