"""Disaggregated weight sync: trainer → engines over a dedicated process group (NCCL, or gloo on CPU).

Per pipeline stage, the stage's first rank (data-, context- and tensor-parallel rank 0) opens one
group with every engine rank (``/init_weights_update_group``, SGLang's protocol: the trainer is rank
0). Each bucket of ``--update-weight-buffer-size`` bytes of full HF tensors is packed into one
buffer per dtype, announced with its names, dtypes and shapes (``/update_weights_from_distributed``,
``load_format="flattened_bucket"``) and broadcast in one collective; the engines load the tensors by
HF name. Two staging buffers alternate, so packing the next bucket overlaps the current broadcast.
Only the tensor-parallel group that holds that first rank gathers shards; the other replicas
skip the sync entirely, except under expert parallelism, whose expert gathers span data-parallel
ranks: there every rank gathers and only the first sends.

The caller opens the engines' weight-update session (SGLang >= 0.5.21) around ``update``, once for
all pipeline stages (``TrainingSession.push_weights``). A push fails fast: while a broadcast is in
flight the engines' HTTP replies are polled, so an engine that refuses a bucket (its ranks never join
the broadcast) or dies stops the push within a poll interval with its own message, instead of after
``--update-weights-timeout``; on NCCL too, because the wait polls the collective's completion, not its
future (which NCCL completes when the kernel is enqueued). Engines that neither answer nor finish are
named when that timeout runs out. The group, which may still hold the broadcast, is then dropped on both
sides and a new one (a new name) is opened before the next push. An engine that had joined the
broadcast may stay blocked in it until its own timeout (a real SGLang server holds it in the
scheduler); the torch engine gives it up when the group is destroyed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.config.settings.weight_sync import WeightSyncSettings
from slime.engine_client.calls import first_failure, wait_all
from slime.engine_client.timeouts import ERROR_PATH_TIMEOUT_S
from slime.engine_client.weight_updates import destroy_group, init_group, update_from_distributed
from slime.utils.device import distributed_backend
from slime.utils.http import free_port
from slime.weight_sync.bucketing import send_pipelined
from slime.weight_sync.ipc import FlattenedBucket, StagingBuffer
from slime.weight_sync.process_group import (
    WeightGroup,
    abandon_group,
    create_weight_update_group,
    start_broadcast_from_rank0,
    wait_for_work,
)
from slime.weight_sync.senders import is_stage_leader, walks_hf_weights

logger = logging.getLogger(__name__)

# Seconds to wait for the engines' replies after a broadcast broke, for the refusal that explains it.
REFUSAL_GRACE_S = 5.0


class DistributedWeightUpdater:
    def __init__(self, settings: WeightSyncSettings, trainer) -> None:
        self.settings = settings
        self.trainer = trainer
        self.timeout = settings.timeout_s
        self.engine_urls: list[str] = []
        self.ranks_per_engine = settings.ranks_per_engine
        self.group: WeightGroup | None = None
        self.groups_opened = 0  # a group dropped after a failed push is replaced under a new name
        self.group_name = ""
        self._staging = (StagingBuffer(shared=False), StagingBuffer(shared=False))

    @property
    def _in_sending_replica(self) -> bool:
        return walks_hf_weights()

    @property
    def _is_sender(self) -> bool:
        return is_stage_leader()

    def connect(self, engine_urls: list[str]) -> None:
        """Opens this stage's group with every engine; both sides block until all have joined."""
        self.engine_urls = list(engine_urls)
        self._open_in_stage_order(self._is_sender)

    def _open_in_stage_order(self, opening: bool) -> None:
        """Opens the groups of the stages that are ``opening``, one pipeline stage after the other.

        An engine joins groups one at a time (SGLang's scheduler and the torch engine handle
        ``/init_weights_update_group`` in turn, each blocking until every rank has joined), so two
        stages opening at once can each hold one engine inside the other's rendezvous: a deadlock.
        Every trainer rank calls this (it takes part in the barriers); an error is raised after them.
        """
        stages = mpu.get_pipeline_model_parallel_world_size()
        if stages == 1:
            if opening:
                self._open_group()
            return
        error: Exception | None = None
        for stage in range(stages):
            if opening and stage == mpu.get_pipeline_model_parallel_rank():
                try:
                    self._open_group()
                except Exception as exc:
                    error = exc
            dist.barrier()
        if error is not None:
            raise error

    def _open_group(self) -> None:
        stage = mpu.get_pipeline_model_parallel_rank()
        self.group_name = f"slime-pp{stage}" + (f"-{self.groups_opened}" if self.groups_opened else "")
        self.groups_opened += 1
        address = ray.util.get_node_ip_address()
        port = free_port()
        world_size = 1 + len(self.engine_urls) * self.ranks_per_engine
        backend = distributed_backend()
        payloads = [
            {
                "master_address": address,
                "master_port": port,
                "rank_offset": 1 + i * self.ranks_per_engine,
                "world_size": world_size,
                "group_name": self.group_name,
                "backend": backend,
            }
            for i in range(len(self.engine_urls))
        ]
        replies = init_group(self.engine_urls, payloads, self.timeout)
        group = create_weight_update_group(
            address, port, 0, world_size, self.group_name, backend, timeout_s=self.timeout
        )
        try:
            wait_all(replies)
        except Exception:
            abandon_group(group)
            self._destroy_on_engines()
            raise
        self.group = group

    def update(self, weight_version: str) -> dict[str, float]:
        """Pushes every weight to every engine; the engines report ``weight_version`` afterwards."""
        reopen_error: Exception | None = None
        try:
            self._reopen_dropped_groups()
        except Exception as exc:  # raised below, once this rank's gathers are done
            reopen_error = exc
        if not self._in_sending_replica:
            return {}
        start = time.perf_counter()
        weights = self.trainer.iter_hf_weights()
        if not self._is_sender:
            for _ in weights:  # the other tensor-parallel ranks only take part in the gathers
                pass
            return {}
        try:
            if reopen_error is not None:
                raise reopen_error
            # The next bucket is packed while the previous one is on the wire.
            num_bytes = send_pipelined(
                weights, self.settings.bucket_bytes, self._staging, self._start_send, weight_version
            )
        except Exception:
            # The group first: on NCCL its watchdog ends this process once the pending broadcast
            # outlives the group's timeout, and the gathers below can take a while.
            self._drop_group()
            for _ in weights:  # finish the gathers the other tensor-parallel ranks are in
                pass
            raise
        return {"update_weights_bytes": float(num_bytes), "update_weights_time": time.perf_counter() - start}

    def _reopen_dropped_groups(self) -> None:
        """After a failed push: the senders whose group was dropped open a new one, in stage order
        (every rank learns whether any must, so all take part in the ordering)."""
        dropped = self._is_sender and self.group is None
        anyone: list[bool | None] = [dropped]
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            anyone = [None] * dist.get_world_size()
            dist.all_gather_object(anyone, dropped)
        if any(anyone):
            self._open_in_stage_order(dropped)

    def _start_send(self, bucket: FlattenedBucket, version: str | None) -> Callable[[], None]:
        """Announces ``bucket`` and starts its broadcast; the returned call waits for both to finish.

        SGLang's ``flattened_bucket`` form of ``/update_weights_from_distributed``: the engine
        allocates one uint8 buffer for the listed tensors, receives it in a single broadcast and
        views the tensors out of it in order.
        """
        payload = {
            "names": [m.name for m in bucket.metadata],
            "dtypes": [str(m.dtype).removeprefix("torch.") for m in bucket.metadata],
            "shapes": [list(m.shape) for m in bucket.metadata],
            "group_name": self.group_name,
            "load_format": "flattened_bucket",
            "flush_cache": version is not None,
        }
        if version is not None:
            payload["weight_version"] = version
        replies = update_from_distributed(self.engine_urls, payload, self.timeout)
        started = time.monotonic()
        assert self.group is not None  # a sender's group is open while it pushes
        work = start_broadcast_from_rank0(self.group, bucket.flattened_tensor, self.timeout)

        def wait() -> None:
            try:
                wait_for_work(
                    work, self.timeout, lambda: first_failure(replies), self._engines_named(), started
                )
            except Exception:
                # A broken broadcast usually means an engine refused (or closed its group): its own
                # words say why better than the transport's.
                refusal = first_failure(replies, wait_s=REFUSAL_GRACE_S)
                if refusal is not None:
                    raise refusal from None
                raise
            wait_all(replies)

        return wait

    def _engines_named(self) -> str:
        """The engines of the group, for a one-line error: the first few URLs and how many more."""
        shown = ", ".join(self.engine_urls[:3])
        more = len(self.engine_urls) - 3
        return f"engines {shown}" + (f" and {more} more" if more > 0 else "")

    def _drop_group(self) -> None:
        """After a failed push: the group may hold a broadcast that never ends; replace it next time."""
        if self.group is None:
            return
        abandon_group(self.group)
        self.group = None
        self._destroy_on_engines()

    def _destroy_on_engines(self, timeout: float = ERROR_PATH_TIMEOUT_S, best_effort: bool = True) -> None:
        """``/destroy_weights_update_group`` on every engine. Best effort after a failure: an engine
        that lost the group, or is gone, is reported by the next push."""
        payload = {"group_name": self.group_name}
        replies = destroy_group(self.engine_urls, payload, timeout)
        if not best_effort:
            wait_all(replies)
            return
        for url, reply in zip(self.engine_urls, replies, strict=True):
            try:
                reply.result()
            except Exception as exc:
                logger.warning("engine %s: destroying weight-update group %s: %s", url, self.group_name, exc)

    def disconnect(self, best_effort: bool = False) -> None:
        if self._is_sender and self.group is not None:
            if best_effort:  # an engine of the group may be dead: nobody would finish shutting it down
                abandon_group(self.group)
            self._destroy_on_engines(timeout=60, best_effort=best_effort)
            self.group = None
