"""Disaggregated weight sync: trainer → engines over a dedicated process group (NCCL, or gloo on CPU).

Per pipeline stage, the stage's first rank (data-, context- and tensor-parallel rank 0) opens one
group with every engine rank (``/init_weights_update_group``, SGLang's protocol: the trainer is rank
0). For each bucket of ``--update-weight-buffer-size`` bytes of full HF tensors it announces names,
dtypes and shapes (``/update_weights_from_distributed``) and broadcasts the tensors; the engines
load them by HF name. Only the tensor-parallel group that holds that first rank gathers shards; the
other replicas skip the sync entirely. Every call and collective has a timeout: a failed sync raises.
"""

from __future__ import annotations

import argparse
import time

import ray
import torch
from megatron.core import parallel_state as mpu

from slime.utils.device import distributed_backend
from slime.utils.http import free_port
from slime.weight_sync.bucketing import iter_buckets
from slime.weight_sync.engine_client import post_all
from slime.weight_sync.process_group import broadcast_from_rank0, create_weight_update_group


class DistributedWeightUpdater:
    def __init__(self, args: argparse.Namespace, trainer) -> None:
        self.args = args
        self.trainer = trainer
        self.timeout = float(args.update_weights_timeout)
        self.engine_urls: list[str] = []
        self.group = None
        self.group_name = f"slime-pp{mpu.get_pipeline_model_parallel_rank()}"

    @property
    def _in_sending_replica(self) -> bool:
        return mpu.get_data_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0

    @property
    def _is_sender(self) -> bool:
        return self._in_sending_replica and mpu.get_tensor_model_parallel_rank() == 0

    def connect(self, engine_urls: list[str], ranks_per_engine: int) -> None:
        """Opens this stage's group with every engine; both sides block until all have joined."""
        self.engine_urls = list(engine_urls)
        if not self._is_sender:
            return
        address = ray.util.get_node_ip_address()
        port = free_port()
        world_size = 1 + len(engine_urls) * ranks_per_engine
        backend = distributed_backend()
        payloads = [
            {
                "master_address": address,
                "master_port": port,
                "rank_offset": 1 + i * ranks_per_engine,
                "world_size": world_size,
                "group_name": self.group_name,
                "backend": backend,
            }
            for i in range(len(engine_urls))
        ]
        replies = post_all(engine_urls, "/init_weights_update_group", payloads, self.timeout)
        self.group = create_weight_update_group(
            address, port, 0, world_size, self.group_name, backend, timeout_s=self.timeout
        )
        for reply in replies:
            reply.result()

    def update(self, weight_version: str) -> dict[str, float]:
        """Pushes every weight to every engine; the engines report ``weight_version`` afterwards."""
        if not self._in_sending_replica:
            return {}
        start = time.perf_counter()
        num_bytes = 0
        buckets = iter_buckets(self.trainer.iter_hf_weights(), self.args.update_weight_buffer_size)
        pending = None
        for bucket in buckets:
            if not self._is_sender:
                continue  # the other tensor-parallel ranks only take part in the gathers
            if pending is not None:
                self._send(pending, version=None)
            pending = bucket
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if self._is_sender and pending is not None:
            self._send(pending, version=weight_version)  # the version flips with the last bucket
        return {"update_weights_bytes": float(num_bytes), "update_weights_time": time.perf_counter() - start}

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        payload = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": version is not None,
        }
        if version is not None:
            payload["weight_version"] = version
        replies = post_all(self.engine_urls, "/update_weights_from_distributed", payload, self.timeout)
        for _, tensor in bucket:
            broadcast_from_rank0(self.group, tensor.contiguous(), self.timeout)
        for reply in replies:
            reply.result()

    def disconnect(self) -> None:
        if self._is_sender and self.group is not None:
            for reply in post_all(
                self.engine_urls, "/destroy_weights_update_group", {"group_name": self.group_name}, 60
            ):
                reply.result()
            self.group = None
