"""Starting (or joining) the Ray cluster and placing work on GPU bundles.

On a CPU-only machine Ray is started with logical GPUs, so placement groups, bundles and actor
scheduling are exactly those of a GPU cluster.
"""

from __future__ import annotations

import argparse
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from slime.utils.device import has_gpu


def trainer_gpus(args: argparse.Namespace) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def total_gpus(args: argparse.Namespace) -> int:
    """Bundles the run needs: trainers and engines share them when colocated."""
    rollout = 0 if args.debug_train_only else (args.rollout_num_gpus or 0)
    if args.colocate:
        return max(trainer_gpus(args), rollout)
    return trainer_gpus(args) + rollout


def start_ray(args: argparse.Namespace) -> None:
    """Joins ``--ray-address`` or starts a local cluster (with logical GPUs when there are none)."""
    if ray.is_initialized():
        return
    if args.ray_address:
        ray.init(address=args.ray_address)
        return
    # Token auth guards shared clusters; a cluster this process starts for itself needs none.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    num_gpus = None if has_gpu() else total_gpus(args)
    ray.init(num_gpus=num_gpus, include_dashboard=False, logging_level="warning", log_to_driver=True)


def create_placement_group(num_bundles: int) -> PlacementGroup:
    """One GPU per bundle, packed onto as few nodes as possible; waits until it is placed."""
    pg = placement_group([{"GPU": 1}] * num_bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    return pg


def release_placement_group(pg: PlacementGroup | None) -> None:
    if pg is not None:
        remove_placement_group(pg)
