"""Starting (or joining) the Ray cluster and placing work on GPU bundles.

On a CPU-only machine Ray is started with logical GPUs, so placement groups, bundles and actor
scheduling are exactly those of a GPU cluster.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.config.settings.cluster import ClusterSettings
from slime.ray.errors import RayClusterUnreachable
from slime.utils.hardware import has_gpu
from slime.utils.http import ENGINE_API_KEY_ENV


def start_ray(cluster: ClusterSettings) -> None:
    """Joins ``--ray-address`` (else ``RAY_ADDRESS``, which ``ray job submit`` sets) or starts a cluster
    of the run's own (with logical GPUs when there are none).

    A cluster of its own is started as ``address="local"``: a bare ``ray.init()`` would join the
    cluster a past ``ray start`` recorded in ``ray_current_cluster`` in Ray's temp dir, which stays
    there after that cluster dies without ``ray stop``.

    Who can reach the run: a cluster of its own is one node, so unless the run has external engines
    on other hosts it runs on 127.0.0.1 (``_on_loopback``): Ray, the engines (``EngineActor`` serves on
    the node address Ray reports), the weight-update rendezvous and gloo listen on loopback only.
    Otherwise engines listen on their node's address and the run has an engine key (``run_api_key``)
    that every engine demands and every slime client sends. The key reaches every process of the run
    as ``ENGINE_API_KEY_ENV``: this process's environment, the job's Ray runtime_env for the actors
    of a joined cluster, and the inherited environment for those of a cluster of its own.
    """
    if ray.is_initialized():
        return
    flag, address = "--ray-address", cluster.ray_address
    if not address:
        flag, address = "RAY_ADDRESS", os.environ.get("RAY_ADDRESS")
    if address:  # an unreachable cluster is one line, before this process's environment changes
        check_reachable(address, flag)
    loopback = not address and all(is_loopback(addr) for addr in cluster.external_engine_addrs)
    key = run_api_key(cluster.engine_api_key, loopback)
    env_vars = {ENGINE_API_KEY_ENV: key} if key else {}
    if key:
        os.environ[ENGINE_API_KEY_ENV] = key
    else:  # a key left by an earlier run in this process must not reach this run's engines
        os.environ.pop(ENGINE_API_KEY_ENV, None)
    if address:
        ray.init(address=address, runtime_env={"env_vars": env_vars} if env_vars else None)
        return
    # Token auth guards shared clusters; a cluster this process starts for itself needs none.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:  # else gloo listens on the hostname's address
        env_vars["GLOO_SOCKET_IFNAME"] = "lo"
    num_gpus = None if has_gpu() else cluster.total_gpus
    # The cluster's processes inherit this one's environment, so the job needs no runtime_env: with one,
    # Ray would start every worker through its runtime-env agent instead of taking the idle workers it
    # starts with (measured 2026-12-04, 2 cores: ray.init 1 s slower, each actor up 0.5-1 s later).
    with _on_loopback() if loopback else contextlib.nullcontext(), _environment(env_vars), lean_head():
        ray.init(
            address="local",
            num_gpus=num_gpus,
            include_dashboard=False,
            logging_level="warning",  # type: ignore[arg-type]  # ray also takes a level name
            log_to_driver=True,
            _node_ip_address="127.0.0.1" if loopback else None,
        )


LEAN_HEAD_SKIPS = ("start_monitor", "start_api_server")
"""What a cluster of the run's own starts without (``ray._private.node.Node`` methods): the autoscaler's
monitor (one node never scales) and the API server (job submission and the state API, for clusters
people share). The log monitor stays: it carries the actors' output to the driver."""

REGISTRATION_POLL_S = 0.02
"""How often ``lean_head`` asks the GCS whether the new raylet has registered."""

REGISTRATION_TIMEOUT_S = 30.0
"""How long it asks: Ray's own ``raylet_start_wait_time_s``, after which Ray's wait raises as before."""


@contextlib.contextmanager
def lean_head() -> Iterator[None]:
    """While a ``ray.init`` in it starts a head node, that node starts none of ``LEAN_HEAD_SKIPS`` and
    ``ray.init`` returns as soon as its raylet has registered.

    Ray 2.60 waits for the raylet in ``GlobalStateAccessor::GetNode``, which sleeps a whole second
    after each miss (``global_state_accessor.cc``); the raylet registers 0.2-0.7 s after it starts,
    so every start paid up to a second. Here ``services.get_node`` first polls the node table every
    ``REGISTRATION_POLL_S``. Measured 2026-12-05, 2 cores: ``ray.init`` 2.36 -> 1.3-2.2 s (the raylet
    itself waits for its dashboard agent, a Python process, to start), Ray's own processes 898 -> 708
    MiB RSS and 3.7 -> 2.8 CPU-s.

    A Ray without one of these names (another version) starts as it would. For the Ray dashboard or
    ``ray status``, start a cluster with ``ray start --head`` and pass ``--ray-address``."""
    from ray._private import services
    from ray._private.node import Node

    saved = {name: Node.__dict__[name] for name in LEAN_HEAD_SKIPS if name in Node.__dict__}
    for name in saved:
        setattr(Node, name, _skip_service)
    get_node = getattr(services, "get_node", None)
    if get_node is not None:
        services.get_node = _once_registered(get_node)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)
        if get_node is not None:
            services.get_node = get_node


def _skip_service(node: object, *args: object, **kwargs: object) -> None:
    """Stands in for a ``Node.start_*`` method of ``LEAN_HEAD_SKIPS``: starts nothing."""


def _once_registered(get_node: Callable[[str, str], dict]) -> Callable[[str, str], dict]:
    """``get_node`` (``ray._private.services``), called once the GCS lists the node (or after
    ``REGISTRATION_TIMEOUT_S``)."""

    def wait_then_get(gcs_address: str, node_id: str) -> dict:
        from ray._private import services, state

        try:
            table = state.GlobalState()
            table._initialize_global_state(services._get_gcs_client_options(gcs_address))
            deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
            while time.monotonic() < deadline:
                if any(node.get("NodeID") == node_id for node in table.node_table()):
                    break
                time.sleep(REGISTRATION_POLL_S)
        except Exception:  # a Ray whose internals differ: its own (slower) wait below still works
            pass
        return get_node(gcs_address, node_id)

    return wait_then_get


@contextlib.contextmanager
def _environment(env_vars: dict[str, str]) -> Iterator[None]:
    """``env_vars`` in this process's environment while Ray starts its processes, then as before."""
    saved = {name: os.environ.get(name) for name in env_vars}
    os.environ.update(env_vars)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (``HOST:PORT``, ``http://HOST:PORT``) names this machine's loopback interface."""
    host = urlsplit(addr if "://" in addr else f"http://{addr}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def run_api_key(given: str | None, loopback: bool) -> str | None:
    """The run's engine key: ``given`` (``--sglang-api-key``; external engines expect theirs), else a new
    secret for a run that other hosts can reach, else None (a run on loopback only).

    Hex, not ``token_urlsafe``: a key that starts with ``-`` would be read as a flag by the servers'
    argument parsers."""
    if given:
        return given
    return None if loopback else secrets.token_hex(32)


@contextlib.contextmanager
def _on_loopback() -> Iterator[None]:
    """Makes ``ray.init`` start its node on 127.0.0.1. Ray turns a loopback ``_node_ip_address`` into
    the node's routable address unless ``ray_constants.ENABLE_RAY_CLUSTER`` is off (its local-only
    mode, the default on macOS and Windows, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``); on a loopback node
    address Ray 2.60 binds its own servers (GCS, raylet, workers) to loopback too, and every actor's
    ``ray.util.get_node_ip_address()`` is 127.0.0.1. The switch is read only while a node starts, so
    it is put back at once (a later ``ray.init`` in this process may join a real cluster)."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


RAY_CONNECT_TIMEOUT_S = 10.0
"""How long a cluster's GCS port may take to accept a connection: ``ray.init`` itself retries an
address that does not answer for minutes, printing a warning every few seconds."""


def check_reachable(address: str, flag: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Raises ``RayClusterUnreachable``, one line naming ``flag`` and ``address``, unless the GCS port of
    the cluster there (``host:port``, ``auto`` or ``ray://host:port``) accepts a connection."""
    fix = f"start the cluster (bash scripts/ray_cluster.sh head) or fix {flag}"
    try:
        host, port = _gcs_host_port(address)
    except (ConnectionError, ValueError) as e:  # "auto" found no cluster; not HOST:PORT
        raise RayClusterUnreachable(f"{flag} {address}: {str(e).splitlines()[0]}; {fix}") from e
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:  # refused, unknown host, no answer
        reason = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else e.strerror or str(e)
        raise RayClusterUnreachable(
            f"{flag} {address}: no Ray cluster at {host}:{port} ({reason}); {fix}"
        ) from e


def _gcs_host_port(address: str) -> tuple[str, int]:
    """Where the cluster's GCS listens, as ``ray.init`` resolves ``address`` (``auto``: ``RAY_ADDRESS``,
    then the cluster ``ray start`` recorded on this node)."""
    if "://" in address:  # Ray Client: its server's port
        target = address.split("://", 1)[1]
    else:
        from ray._private.services import canonicalize_bootstrap_address_or_die

        target = canonicalize_bootstrap_address_or_die(address)
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def create_placement_group(num_bundles: int) -> PlacementGroup:
    """One GPU per bundle, packed onto as few nodes as possible; waits until it is placed."""
    pg = placement_group([{"GPU": 1}] * num_bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    return pg


def release_placement_group(pg: PlacementGroup | None) -> None:
    if pg is not None:
        remove_placement_group(pg)


@dataclass(frozen=True)
class BundleLocation:
    """Where Ray put one bundle: its node and the GPU index Ray gave it there."""

    index: int
    node_ip: str
    gpu_id: int


@ray.remote(num_cpus=0, num_gpus=0.01)
def _where() -> tuple[str, int]:
    """Node and GPU of the bundle it runs on (a sliver of a GPU, so it fits beside colocated actors)."""
    return ray.util.get_node_ip_address(), int(ray.get_gpu_ids()[0])


def locate_bundles(
    pg: PlacementGroup, indices: Iterable[int], timeout_s: float = 120.0
) -> list[BundleLocation]:
    """Node and GPU of each bundle in ``indices``: a PACK placement group says which bundles share a
    node, not in which order, and Ray numbers bundles independently of GPU indices."""
    indices = list(indices)
    refs = [
        _where.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        ).remote()
        for index in indices
    ]
    places = ray.get(refs, timeout=timeout_s)
    return [BundleLocation(index, ip, gpu) for index, (ip, gpu) in zip(indices, places, strict=True)]


def by_node_and_gpu(locations: Iterable[BundleLocation]) -> list[BundleLocation]:
    """Bundles grouped by node, GPUs ascending within a node: consecutive ranks share a node, so
    Megatron's tensor-parallel groups and an engine's GPUs stay inside one node."""
    return sorted(locations, key=lambda loc: (ipaddress.ip_address(loc.node_ip).packed, loc.gpu_id))


def bundle_order(pg: PlacementGroup, num_bundles: int) -> list[int]:
    """The placement group's bundle indices packed by node and GPU index: rank i gets entry i.

    On a one-node cluster every order keeps each group inside the node: the bundles are not probed."""
    if sum(1 for node in ray.nodes() if node["Alive"]) == 1:
        return list(range(num_bundles))
    return [loc.index for loc in by_node_and_gpu(locate_bundles(pg, range(num_bundles)))]
