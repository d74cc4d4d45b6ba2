"""The Ray cluster a run starts or joins: a stale ``ray_current_cluster`` is never joined and an
unreachable ``RAY_ADDRESS`` is one line (``--ray-address``: tests/unit/test_train_cli.py)."""

from __future__ import annotations

import pytest
import ray

from slime.ray.cluster import start_ray
from slime.ray.errors import RayClusterUnreachable
from slime.utils.http import free_port
from tests.support.configs import cluster_settings
from tests.support.train_runs import write_stale_cluster_file


def test_a_cluster_of_its_own_ignores_the_one_a_dead_ray_start_recorded(tmp_path, monkeypatch):
    """Ray's own resolver would join the recorded (dead) cluster on a bare ``ray.init()`` and refuse
    ``num_gpus``; the address ``start_ray`` passes makes it start a new one."""
    from ray._private.services import canonicalize_bootstrap_address

    stale = write_stale_cluster_file(tmp_path)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # what start_ray sets for a cluster of its own
    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: inits.append(kwargs))
    start_ray(cluster_settings())
    assert canonicalize_bootstrap_address(None).endswith(stale.rpartition(":")[2])
    assert canonicalize_bootstrap_address(inits[0]["address"]) is None
    assert inits[0]["num_gpus"] == 2


def test_a_ray_address_from_the_environment_is_checked_before_it_is_joined(monkeypatch):
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RayClusterUnreachable) as raised:
        start_ray(cluster_settings())
    message = str(raised.value)
    assert message.startswith(f"RAY_ADDRESS {address}: no Ray cluster at ") and "\n" not in message
    assert message.endswith(
        "(Connection refused); start the cluster (bash scripts/ray_cluster.sh head) or fix RAY_ADDRESS"
    )
