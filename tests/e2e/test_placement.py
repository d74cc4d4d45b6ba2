"""Where Ray put each bundle, and the order ranks and engines take them in (real Ray, logical GPUs)."""

from __future__ import annotations

import psutil
import pytest
import ray
from ray._private import services
from ray._private.node import Node

from slime.config import parse_args
from slime.config.settings.cluster import ClusterSettings
from slime.config.settings.rollout import EngineSettings
from slime.ray.cluster import (
    LEAN_HEAD_SKIPS,
    bundle_order,
    create_placement_group,
    lean_head,
    locate_bundles,
    release_placement_group,
)
from slime.ray.engines import EnginePool, EngineStartError


def _ray_scripts() -> set[str]:
    """The Python scripts of this process's Ray processes (``monitor.py``, ``log_monitor.py``, ...)."""
    names = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            names.update(arg.rsplit("/", 1)[-1] for arg in proc.cmdline() if arg.endswith(".py"))
        except psutil.Error:
            continue
    return names


@pytest.mark.e2e
def test_a_cluster_of_its_own_starts_without_monitor_and_api_server(ray_cluster) -> None:
    """The session's cluster started under ``lean_head`` (as ``start_ray`` starts a run's own): Ray's
    autoscaler monitor and API server never started, its log monitor (actor output to the driver)
    did, actors run, and ``Node`` has its own methods back."""
    scripts = _ray_scripts()
    assert "log_monitor.py" in scripts
    assert not {"monitor.py", "dashboard.py"} & scripts

    @ray.remote(num_cpus=0)
    def square(x: int) -> int:
        return x * x

    assert ray.get(square.remote(7)) == 49
    with lean_head():
        assert all(getattr(Node, name).__name__ == "_skip_service" for name in LEAN_HEAD_SKIPS)
        assert services.get_node.__name__ == "wait_then_get"
    assert [getattr(Node, name).__name__ for name in LEAN_HEAD_SKIPS] == list(LEAN_HEAD_SKIPS)
    assert services.get_node.__name__ == "get_node"


@pytest.mark.e2e
def test_bundles_are_located_and_ordered_by_node_and_gpu(ray_cluster) -> None:
    pg = create_placement_group(4)
    try:
        locations = locate_bundles(pg, range(4))
        assert [loc.index for loc in locations] == [0, 1, 2, 3]
        assert {loc.node_ip for loc in locations} == {ray.util.get_node_ip_address()}
        gpus = [loc.gpu_id for loc in locations]
        assert len(set(gpus)) == 4 and all(0 <= gpu < 8 for gpu in gpus)
        order = bundle_order(pg, 4)
        assert sorted(order) == [0, 1, 2, 3]
        assert [gpus[index] for index in order] == sorted(gpus)
    finally:
        release_placement_group(pg)


@pytest.mark.e2e
def test_a_two_gpu_engine_gets_both_bundles_gpus_and_a_refusal_stops_it(ray_cluster, tiny_models, tmp_path):
    """The multi-GPU path of the pool on CPU: bundles located and packed, then the torch engine (one
    device only) refuses ``--tp-size 2`` and the pool stops with its one-line reason."""
    args = parse_args(
        [
            "--hf-checkpoint", str(tiny_models["qwen2"]), "--rollout-batch-size", "1",
            "--num-rollout", "1", "--debug-rollout-only", "--rollout-backend", "torch",
            "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
        ]
    )  # fmt: skip
    pg = create_placement_group(2)
    pool = EnginePool(
        EngineSettings.from_args(args), ClusterSettings.from_args(args), pg, [0, 1], str(tmp_path)
    )
    try:
        (node,) = pool.nodes
        assert (node.num_gpus, node.nnodes, len(node.gpu_ids)) == (2, 1, 2)
        assert list(node.gpu_ids) == sorted(node.gpu_ids) and len(set(node.gpu_ids)) == 2
        with pytest.raises(EngineStartError, match="--tp-size 2 is not supported by the torch engine"):
            pool.start(timeout_s=120)
        assert pool.actors == []
    finally:
        pool.shutdown()
        release_placement_group(pg)
