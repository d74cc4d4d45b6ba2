"""The weight-update process groups of one torch engine: SGLang's ``/init_weights_update_group``,
the receiving side of ``/update_weights_from_distributed`` and ``/destroy_weights_update_group``.

Joining a group and receiving its broadcasts block, so they run on this object's one-thread executor
and decoding continues meanwhile; only the copy into the parameters pauses generation (the engine
does it on its scheduler thread). A group destroyed while a receive still waits on it (its sender
gave up) makes that receive give up; such a group, and one whose receive failed (timed out), is then
dropped rather than shut down, which would wait for the broadcast's timeout.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Any

import torch

from slime.backends.torch_engine import weights
from slime.weight_sync import ipc
from slime.weight_sync.process_group import DEFAULT_TIMEOUT_S, abandon_group, create_weight_update_group

logger = logging.getLogger(__name__)

# Seconds a weight-update collective may wait for its peer (env override for slow CI machines).
DIST_TIMEOUT_S = float(os.environ.get("SLIME_TORCH_ENGINE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
DEFAULT_GROUP = "weight_update_group"


class WeightUpdateGroups:
    """The engine's groups by name, each with its cancel flag and its reused receive buffer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-update")
        self._groups: dict[str, Any] = {}
        self._cancelled: dict[str, threading.Event] = {}
        self._given_up: set[str] = set()
        # Flattened buckets are received into one reused buffer per group: the updates of a group
        # come one at a time (the trainer waits for each answer), each loaded before it is answered.
        self._buffers: dict[str, ipc.StagingBuffer] = {}

    def init(self, body: dict[str, Any]) -> tuple[bool, str]:
        name = body.get("group_name") or DEFAULT_GROUP
        if name in self._groups:
            return False, f"Failed to initialize custom process group: group {name!r} already exists."
        try:
            group = create_weight_update_group(
                body["master_address"],
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                name,
                body.get("backend") or "nccl",
                DIST_TIMEOUT_S,
            )
        except Exception as exc:
            logger.error("init_weights_update_group failed: %s", exc)
            return False, f"Failed to initialize custom process group: {exc}."
        self._groups[name] = group
        self._cancelled[name] = threading.Event()
        return True, "Succeeded to initialize custom process group."

    def receive(self, body: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        name = body.get("group_name") or DEFAULT_GROUP
        if name not in self._groups:
            raise RuntimeError(f"group {name!r} does not exist; call /init_weights_update_group first")
        group = self._groups[name]
        nccl = isinstance(group, getattr(torch.distributed, "ProcessGroupNCCL", ()))
        try:
            return weights.receive_tensors(
                group,
                list(body["names"]),
                list(body["dtypes"]),
                [list(s) for s in body["shapes"]],
                self.device if nccl else torch.device("cpu"),
                flattened=body.get("load_format") == "flattened_bucket",
                timeout_s=DIST_TIMEOUT_S,
                staging=self._buffers.setdefault(name, ipc.StagingBuffer(shared=False)),
                stop=lambda: self._cancellation(name),
            )
        except BaseException:
            # A receive that timed out leaves its broadcast pending like a cancelled one: shutting the
            # group down would block until the transport's own timeout (a minute past DIST_TIMEOUT_S).
            self._given_up.add(name)
            raise

    def _cancellation(self, name: str) -> BaseException | None:
        cancelled = self._cancelled.get(name)
        if cancelled is not None and cancelled.is_set():
            self._given_up.add(name)
            return RuntimeError(f"weight-update group {name!r} was destroyed while receiving")
        return None

    def cancel(self, name: str) -> None:
        """Any thread: makes a receive waiting on group ``name`` give up (its peer will never send)."""
        cancelled = self._cancelled.get(name)
        if cancelled is not None:
            cancelled.set()

    def destroy(self, name: str) -> tuple[bool, str]:
        group = self._groups.pop(name, None)
        self._buffers.pop(name, None)
        self._cancelled.pop(name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        if name in self._given_up:
            self._given_up.discard(name)
            abandon_group(group)  # its broadcast may still be pending
            return True, "Succeeded to destroy custom process group."
        try:
            group.shutdown()
        except Exception as exc:  # the group is dropped either way
            logger.warning("shutting down group %s: %s", name, exc)
        return True, "Succeeded to destroy custom process group."

    def release_buffers(self) -> None:
        """``/release_memory_occupation`` of the weights: the receive buffers go with them."""
        for buffer in self._buffers.values():
            buffer.release()

    def shutdown(self) -> None:
        for name in list(self._groups):
            self.cancel(name)
            self.destroy(name)
        self.executor.shutdown(wait=False, cancel_futures=True)
