"""Colocated weight handoff: trainer ranks give the engine on their own GPU the new weights in place.

Under ``--colocate`` trainer rank ``r`` shares its GPU with TP rank ``r % k`` of engine ``r // k``
(``k = --rollout-num-gpus-per-engine``; the placement puts both on bundle ``r``). Every rank walks its
full HF weights (``iter_hf_weights`` gathers tensor-parallel shards on every rank), packs each bucket
of ``--update-weight-buffer-size`` bytes into one buffer per dtype (``slime.weight_sync.ipc``; two
staging buffers alternate, so the next bucket is packed while the engine copies the current one)
and serializes it as a handle: CUDA IPC on GPU, a shared-memory file on CPU. The engine's first
trainer rank collects its ``k`` handles and posts them as ``/update_weights_from_tensor``
(``load_format="flattened_bucket"``, one entry per engine TP rank, as SGLang expects); the engine
copies from the mapped buffers into its parameters, so the bytes never leave the machine and the
trainer holds at most two extra buckets. The last call sets ``weight_version`` and flushes the
engine's cache. The caller opens the engines' weight-update session (SGLang >= 0.5.21) around
``update`` (``TrainingSession.push_weights``). An engine that refuses a bucket ends the leader's
posting, while every rank still walks all buckets (the gathers and barriers stay matched); the
leader then raises the engine's message.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from slime.config.settings.weight_sync import WeightSyncSettings
from slime.engine_client.calls import wait_all
from slime.engine_client.weight_updates import update_from_tensor
from slime.weight_sync import ipc
from slime.weight_sync.bucketing import send_pipelined


class TensorWeightUpdater:
    def __init__(self, settings: WeightSyncSettings, trainer) -> None:
        self.settings = settings
        self.trainer = trainer
        self.timeout = settings.timeout_s
        self.engine_url: str | None = None
        self.engine_group = None  # the k trainer ranks of one multi-GPU engine (gloo, for the handles)
        self.leader = 0  # global rank that posts for this rank's engine
        self._refusal: Exception | None = None  # the leader's: its engine refused a bucket of this push
        self._staging = (ipc.StagingBuffer(), ipc.StagingBuffer())

    def connect(self, engine_urls: list[str]) -> None:
        """Pairs this rank with the engine on its GPU; every rank takes part (it builds the groups)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        ranks_per_engine = self.settings.ranks_per_engine
        if len(engine_urls) * ranks_per_engine != world:
            raise ValueError(
                f"{len(engine_urls)} engines of {ranks_per_engine} GPUs do not match the {world} trainer "
                "ranks they are colocated with"
            )
        engine = rank // ranks_per_engine
        self.engine_url = engine_urls[engine]
        self.leader = engine * ranks_per_engine
        if ranks_per_engine > 1:
            for index in range(len(engine_urls)):  # new_group is collective: every rank builds every group
                ranks = list(range(index * ranks_per_engine, (index + 1) * ranks_per_engine))
                group = dist.new_group(ranks, backend="gloo")
                if index == engine:
                    self.engine_group = group

    def update(self, weight_version: str) -> dict[str, float]:
        """Hands every weight to this rank's engine; ``weight_version`` flips with the last bucket."""
        start = time.perf_counter()
        self._refusal = None
        # The next bucket is packed while the engine copies the previous one.
        num_bytes = send_pipelined(
            self.trainer.iter_hf_weights(),
            self.settings.bucket_bytes,
            self._staging,
            self._start_hand_over,
            weight_version,
        )
        if self._refusal is not None:
            raise self._refusal
        if dist.get_rank() != self.leader:
            return {}
        return {"update_weights_bytes": float(num_bytes), "update_weights_time": time.perf_counter() - start}

    def _start_hand_over(self, bucket: ipc.FlattenedBucket, version: str | None) -> Callable[[], None]:
        """Posts ``bucket`` as one ``/update_weights_from_tensor`` call; the returned call waits until
        the engine has copied it (every rank of the engine's group: their buffers are then free)."""
        entries = [ipc.serialize(bucket.payload())]
        if self.engine_group is not None:
            gathered = (
                [None] * dist.get_world_size(self.engine_group) if dist.get_rank() == self.leader else None
            )
            dist.gather_object(entries[0], gathered, dst=self.leader, group=self.engine_group)
            entries = gathered
        replies = []
        if dist.get_rank() == self.leader and self._refusal is None:
            payload = {
                "serialized_named_tensors": entries,
                "load_format": "flattened_bucket",
                "flush_cache": version is not None,
            }
            if version is not None:
                payload["weight_version"] = version
            assert self.engine_url is not None  # the leader connected to its engine
            replies = update_from_tensor([self.engine_url], payload, self.timeout)

        def wait() -> None:
            try:
                wait_all(replies)
            except Exception as exc:
                self._refusal = exc  # no more posts; the other ranks still need the barriers
            if self.engine_group is not None:
                dist.barrier(group=self.engine_group)  # the engine has read every rank's buffer

        return wait

    def disconnect(self, best_effort: bool = False) -> None:
        self.engine_url = None
        for buffer in self._staging:  # the shared-memory files, now rather than at a killed process's end
            buffer.free()
