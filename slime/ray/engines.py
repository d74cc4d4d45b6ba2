"""Rollout engines on GPU bundles: one Ray actor per engine, each owning one engine server process.

An engine spans ``--rollout-num-gpus-per-engine`` consecutive bundles of the placement group. Its
actor holds the first bundle's GPU and the other bundles stay reserved for the engine's other GPUs,
so no trainer or second engine is ever placed on them. The actor starts the server as a child
process (``slime.backends.engine_server``: own process group, log file, killed with the actor)
and reports its URL once ``GET /health_generate`` succeeds, i.e. once it really generates.

Which server runs is decided in one place, ``engine_command``: SGLang on GPU nodes, the in-repo
torch engine elsewhere (docs/architecture.md, "One architecture, two kinds of hardware"); each
backend's ``launcher`` module writes its own argv. Both speak the same HTTP protocol, so nothing
after start-up knows which one it talks to.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.backends.engine_server import EngineServer, start_engine_server
from slime.config.settings.cluster import ClusterSettings
from slime.config.settings.rollout import EngineSettings
from slime.config.settings.weight_sync import WeightSyncSettings
from slime.engine_client import control, health
from slime.engine_client.protocol import server_info
from slime.ray.cluster import BundleLocation, by_node_and_gpu, locate_bundles
from slime.rollout.errors import EngineFailure
from slime.utils.hardware import engine_env
from slime.utils.http import HttpError, ServerStartError, free_port
from slime.utils.startup import mark

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 300.0
SCHEDULING_ALLOWANCE_S = 120.0  # how long an engine's actor may wait for its bundle (a lost node: for ever)


class EngineStartError(RuntimeError):
    """An engine that did not come up; the message carries the tail of its log."""


def exit_description(code: int | str) -> str:
    """How an engine server ended: ``exited with status 1``, ``was killed by SIGKILL``, ``actor died``."""
    if isinstance(code, str):
        return code
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


ADD_FAULT_TOLERANCE = "add --use-fault-tolerance to restart failed engines and retry their requests"


def engine_problem(
    url: str, exit_codes: list[int | str | None], timeout_s: float, generate: bool = True
) -> str | None:
    """What is wrong with the engine at ``url`` whose processes report ``exit_codes``
    (``EnginePool.exit_codes``): one ended, or the probe failed or took longer than ``timeout_s``;
    None when it answers 200 in time.

    The probe is ``GET /health_generate`` (a one-token generation), or with ``generate=False``
    ``GET /model_info``, which SGLang answers from its tokenizer manager without generating: the
    liveness check for an engine that is paused or has released its memory (0.5.19-0.5.23).
    """
    ended = [code for code in exit_codes if code is not None]
    if ended:
        return exit_description(ended[0])
    return health.probe(url, timeout_s, generate)


def engine_failure(pool: EnginePool, timeout_s: float, recovering: bool) -> EngineFailure | None:
    """The engines of ``pool`` that are down, as one ``EngineFailure`` line (None: all answer):
    each engine, how it ended, what it answered or that it is being restarted, and what to do."""
    problems = []
    for rank, url in enumerate(pool.urls):
        if (since := pool.restarting_since(rank)) is not None:
            problems.append(f"engine {rank} is being restarted (for {since:.0f} s)")
        elif (problem := engine_problem(url, pool.exit_codes(rank), timeout_s)) is not None:
            problems.append(f"engine {rank} ({url}) {problem}")
    if not problems:
        return None
    if not recovering:
        fix = ADD_FAULT_TOLERANCE
    elif len(pool.urls) == 1:
        fix = (
            "the run stops: no other engine served the rollout's requests while it restarted (use 2 or more)"
        )
    else:
        fix = "the run stops (no engine recovered in time)"
    return EngineFailure(f"{'; '.join(problems)}; {fix}")


def external_engine_url(addr: str, weight_sync: WeightSyncSettings) -> str:
    """The URL of an engine slime did not start (``--rollout-external-engine-addrs``), once
    ``/get_server_info`` shows it can take this run's weights."""
    url = addr if addr.startswith("http") else f"http://{addr}"
    try:
        info = server_info(url)
    except (OSError, HttpError) as exc:
        raise RuntimeError(f"--rollout-external-engine-addrs {addr}: no engine answers ({exc})") from None
    tp_size = int(info.get("tp_size", 1))
    per_engine = weight_sync.ranks_per_engine
    if weight_sync.transport == "distributed" and tp_size != per_engine:
        raise RuntimeError(
            f"--rollout-external-engine-addrs {addr}: tp_size {tp_size} differs from "
            f"--rollout-num-gpus-per-engine {per_engine}; use --update-weight-transport disk"
        )
    logger.info("external engine %s (%s) registered", url, info.get("model_path"))
    return url


@dataclass(frozen=True)
class EngineNode:
    """The part of one engine on one node: one actor and one server process.

    ``bundle_index`` is the bundle the actor runs on; ``gpu_ids`` are the GPUs of all the engine's
    bundles on that node (empty: just the actor's own GPU). An engine has ``nnodes`` of these.
    """

    engine_rank: int
    num_gpus: int
    bundle_index: int
    nnodes: int = 1
    node_rank: int = 0
    gpu_ids: tuple[int, ...] = ()


def engine_command(
    engine: EngineSettings, host: str, port: int, node: EngineNode, *, dist_init_addr: str | None = None
) -> list[str]:
    """The one switch between the engine backends: the argv of ``node``'s server process."""
    backend = engine.backend
    if backend == "torch":
        from slime.backends.torch_engine import launcher

        return launcher.server_command(
            engine, host, port, engine_rank=node.engine_rank, num_gpus=node.num_gpus
        )
    if backend == "sglang":
        from slime.backends import sglang

        return sglang.server_command(
            engine,
            host,
            port,
            engine_rank=node.engine_rank,
            num_gpus=node.num_gpus,
            nccl_port=free_port(),
            nnodes=node.nnodes,
            node_rank=node.node_rank,
            dist_init_addr=dist_init_addr,
        )
    raise ValueError(f"unknown rollout backend {backend!r}; expected sglang or torch")


def plan_engine_nodes(
    locations: list[BundleLocation], per_engine: int, gpus_per_node: int
) -> list[list[EngineNode]]:
    """Splits the rollout bundles into engines of ``per_engine`` GPUs, packed by node and GPU index.

    An engine larger than a node takes ``per_engine // gpus_per_node`` whole nodes (one server
    process each); a smaller one must sit on a single node. Raises ``EngineStartError`` naming the
    engine and its nodes when the bundles do not allow that.
    """
    nnodes = max(1, per_engine // gpus_per_node)
    per_node = per_engine // nnodes
    ordered = by_node_and_gpu(locations)
    engines = []
    for rank in range(len(ordered) // per_engine):
        bundles = ordered[rank * per_engine : (rank + 1) * per_engine]
        parts = [bundles[k * per_node : (k + 1) * per_node] for k in range(nnodes)]
        nodes_of_parts = [{loc.node_ip for loc in part} for part in parts]
        if any(len(ips) != 1 for ips in nodes_of_parts) or len(set().union(*nodes_of_parts)) != nnodes:
            where = ", ".join(f"{loc.node_ip}:GPU{loc.gpu_id}" for loc in bundles)
            raise EngineStartError(
                f"engine {rank} needs {per_engine} GPUs on {nnodes} node(s), {per_node} per node, but "
                f"its bundles are {where}; make --rollout-num-gpus-per-engine divide each node's rollout GPUs"
            )
        engines.append(
            [
                EngineNode(rank, per_engine, part[0].index, nnodes, k, tuple(loc.gpu_id for loc in part))
                for k, part in enumerate(parts)
            ]
        )
    return engines


@ray.remote(num_gpus=1, max_concurrency=2)  # type: ignore[call-overload]  # ray's stub lacks max_concurrency
class EngineActor:
    """One engine (or one node of a multi-node engine): starts its server on this node, reports the
    URL, stops it on ``shutdown``. Two calls at a time, so ``exit_code`` answers while ``start`` waits
    for the server (an engine busy starting is not a dead actor)."""

    def __init__(
        self, engine: EngineSettings, node: EngineNode, log_dir: str, env: dict[str, str] | None = None
    ) -> None:
        """``env``: the server's environment over this process's (``engine_env``: its CPU threads); an
        argument rather than the actor's Ray runtime_env, so that Ray can hand it an idle worker."""
        mark("engine actor: up")
        self.settings, self.node, self.env = engine, node, dict(env or {})
        self.rank = node.engine_rank
        suffix = f"_node{node.node_rank}" if node.nnodes > 1 else ""
        self.log_path = Path(log_dir) / f"engine_{self.rank}{suffix}.log"
        self.server: EngineServer | None = None

    def dist_init_addr(self) -> str:
        """``host:port`` where the server processes of a multi-node engine meet (asked of node 0)."""
        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S, dist_init_addr: str | None = None) -> str:
        """Starts the server and waits until it generates; returns its URL (raises with the log tail).

        Nodes other than an engine's first answer ``/health_generate`` once their ranks joined it.
        """
        backend, node = self.settings.backend, self.node

        def command(host: str, port: int) -> list[str]:
            return engine_command(self.settings, host, port, node, dist_init_addr=dist_init_addr)

        env = dict(self.env)
        if node.gpu_ids:  # all the engine's GPUs on this node, not only the actor's own
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.gpu_ids))
        name = f"{backend} engine {self.rank}" + (f" node {node.node_rank}" if node.nnodes > 1 else "")
        host = ray.util.get_node_ip_address()
        mark("engine actor: starting the server")
        try:
            self.server = start_engine_server(
                name, command, self.log_path, timeout_s=timeout_s, host=host, env=env
            )
        except ServerStartError as exc:
            raise EngineStartError(str(exc)) from None
        return self.server.url

    def pid(self) -> int | None:
        return None if self.server is None else self.server.process.pid

    def exit_code(self) -> int | None:
        """The server's exit status once it has exited (negative: the signal that ended it), else None."""
        return None if self.server is None else self.server.process.exit_code()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()


class EnginePool:
    """The engines of one placement group: placed together, started together, stopped together; under
    ``--use-fault-tolerance`` one engine is also stopped and started again on its own bundles.

    No bundles, no engines: runs that generate nothing (SFT, train-only debugging) use an empty pool.
    """

    def __init__(
        self,
        engine: EngineSettings,
        cluster: ClusterSettings,
        pg: PlacementGroup,
        bundle_indices: list[int],
        log_dir: str,
    ) -> None:
        per_engine = engine.num_gpus_per_engine
        if len(bundle_indices) % per_engine:
            raise ValueError(
                f"{len(bundle_indices)} rollout bundles do not split into engines of "
                f"--rollout-num-gpus-per-engine {per_engine}"
            )
        self.settings, self.cluster, self.pg, self.log_dir = engine, cluster, pg, log_dir
        num_engines = len(bundle_indices) // per_engine
        per_node = max(1, min(num_engines, engine.num_gpus_per_node // per_engine))
        self._env = engine_env(engines_per_node=per_node + cluster.cpu_neighbours["engine"])
        if per_engine == 1:  # one bundle per engine: nothing to group, no need to locate bundles
            self.engines = [[EngineNode(rank, 1, index)] for rank, index in enumerate(bundle_indices)]
        else:
            locations = locate_bundles(pg, bundle_indices)
            self.engines = plan_engine_nodes(locations, per_engine, engine.num_gpus_per_node)
        self.nodes = [node for engine in self.engines for node in engine]
        self.actors = [self._actor(node) for node in self.nodes]
        self.urls: list[str] = []
        self.start_timeout_s = DEFAULT_START_TIMEOUT_S
        self.scheduling_allowance_s = SCHEDULING_ALLOWANCE_S
        self._restarting: dict[int, float] = {}  # rank -> when its restart began (time.monotonic)

    def _actor(self, node: EngineNode):
        # ray types an @ray.remote class as the class itself, without .options
        return EngineActor.options(  # type: ignore[attr-defined]
            num_cpus=0,
            num_gpus=self.cluster.actor_gpus("engine"),  # a share of the GPU under --colocate
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=node.bundle_index
            ),
        ).remote(self.settings, node, self.log_dir, self._env)

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> list[str]:
        """Starts every engine; the first failure stops them all and raises ``EngineStartError``.

        Returns the URL of each engine's first node, the only one serving the HTTP API.
        """
        if not self.actors:
            return []
        self.start_timeout_s = timeout_s
        try:
            urls = self._start(self.nodes, self.actors, timeout_s)
        except EngineStartError:
            self.shutdown()
            raise
        self.urls = [url for node, url in zip(self.nodes, urls, strict=True) if node.node_rank == 0]
        return list(self.urls)

    def _start(self, nodes: list[EngineNode], actors: list, timeout_s: float) -> list[str]:
        """Starts the servers of ``nodes`` (all nodes of their engines) on ``actors``; each node's URL.

        Every wait is bounded: ``timeout_s`` for the servers plus ``scheduling_allowance_s`` for the
        actors to be placed (an actor whose bundle is on a lost node is never placed). Whatever goes
        wrong (a server that does not come up, an actor that dies or is never placed) is one
        ``EngineStartError`` naming the engines.
        """
        names = ", ".join(str(rank) for rank in sorted({node.engine_rank for node in nodes}))
        limit_s = timeout_s + self.scheduling_allowance_s
        deadline = time.monotonic() + limit_s
        spanning = [
            (node.engine_rank, actor)
            for node, actor in zip(nodes, actors, strict=True)
            if node.nnodes > 1 and node.node_rank == 0
        ]
        try:
            addresses = ray.get([actor.dist_init_addr.remote() for _, actor in spanning], timeout=limit_s)
            meet_at = {rank: address for (rank, _), address in zip(spanning, addresses, strict=True)}
            refs = [
                actor.start.remote(timeout_s, meet_at.get(node.engine_rank))
                for node, actor in zip(nodes, actors, strict=True)
            ]
            pending = list(refs)
            while pending:
                done, pending = ray.wait(
                    pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
                )
                if not done:
                    raise ray.exceptions.GetTimeoutError()
                ray.get(done[0])
            return ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise EngineStartError(str(cause)) from None
        except ray.exceptions.GetTimeoutError:
            raise EngineStartError(
                f"engine {names} did not come up within {limit_s:.0f} s ({timeout_s:.0f} s to start its "
                f"server, {self.scheduling_allowance_s:.0f} s to place its actor; a bundle on a lost node "
                "is never placed)"
            ) from None
        except ray.exceptions.RayError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EngineStartError(f"engine {names}: its actor died while starting ({first})") from None

    def _positions(self, rank: int) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.engine_rank == rank]

    def restart(self, rank: int) -> str:
        """Stops engine ``rank`` (every node of it) and starts it again on the same bundles; its new URL.

        Raises ``EngineStartError`` when it does not come up within the start timeout and the
        scheduling allowance (its actors are stopped then too).
        """
        positions = self._positions(rank)
        self._restarting[rank] = time.monotonic()
        try:
            self.stop(rank)
            for i in positions:
                self.actors[i] = self._actor(self.nodes[i])
            nodes, actors = [self.nodes[i] for i in positions], [self.actors[i] for i in positions]
            try:
                url = self._start(nodes, actors, self.start_timeout_s)[0]
            except EngineStartError:
                self._stop(actors, grace_s=5.0)  # an actor never placed would not answer at all
                raise
            self.urls[rank] = url
            return url
        finally:
            self._restarting.pop(rank, None)

    def restarting_since(self, rank: int) -> float | None:
        """Seconds since engine ``rank``'s restart began; None when it is not being restarted."""
        began = self._restarting.get(rank)
        return None if began is None else time.monotonic() - began

    def stop(self, rank: int) -> None:
        """Stops engine ``rank`` (every node of it); its actors are gone after this."""
        self._stop([self.actors[i] for i in self._positions(rank)])

    def exit_codes(self, rank: int) -> list[int | str | None]:
        """Per node of engine ``rank``: its server's exit status (None: running; "actor died")."""
        codes: list[int | str | None] = []
        for i in self._positions(rank):
            try:
                codes.append(ray.get(self.actors[i].exit_code.remote(), timeout=10))
            except (ray.exceptions.GetTimeoutError, TimeoutError):
                codes.append("its actor did not answer within 10 s")
            except ray.exceptions.RayError:
                codes.append("its actor died")
        return codes

    def pids(self) -> list[int | None]:
        return ray.get([actor.pid.remote() for actor in self.actors])

    def pause(self, mode: str = "abort", urls: list[str] | None = None) -> None:
        """``/pause_generation`` on every engine (or on ``urls``; SGLang modes: abort, retract, in_place)."""
        control.pause(self.urls if urls is None else urls, mode)

    def resume(self, urls: list[str] | None = None) -> None:
        control.resume(self.urls if urls is None else urls)

    def _stop(self, actors: list, grace_s: float = 60.0) -> None:
        refs = [actor.shutdown.remote() for actor in actors]
        try:
            ray.get(refs, timeout=grace_s)
        except Exception as exc:  # the actor died or hangs: killing it kills its server (parent-death signal)
            logger.warning("engine shutdown did not finish cleanly (%s); killing the actors", exc)
        for actor in actors:
            ray.kill(actor)

    def shutdown(self) -> None:
        """Stops every server, then the actors; safe to call twice."""
        if not self.actors:
            return
        self._stop(self.actors)
        self.actors = []
        self.urls = []
