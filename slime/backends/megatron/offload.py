"""A trainer rank's device memory under ``--colocate``: the engines use the same GPUs between trainings.

Two groups leave and come back separately: ``weights`` (the parameters, which stay for the in-place
handoff to the engines) and ``train_state`` (gradient buffers, optimizer state and its fp32 main
parameters), moved by ``slime.utils.memory.DeviceMemory``.
"""

from __future__ import annotations

import torch

from slime.utils.memory import DeviceMemory, MemoryEvent, storage_key

GROUPS = ("weights", "train_state")


class TrainerMemory:
    """The offload groups of one rank's model chunks and optimizer, read afresh at each transition
    (Adam's state only exists after the first step)."""

    def __init__(self, model: list[torch.nn.Module], optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._device_memory: DeviceMemory | None = None  # made at the first transition (--colocate only)

    @property
    def device_memory(self) -> DeviceMemory:
        if self._device_memory is None:
            self._device_memory = DeviceMemory()
        return self._device_memory

    @property
    def events(self) -> list[MemoryEvent]:
        return self.device_memory.events

    @property
    def offloaded(self) -> bool:
        return self._device_memory is not None and any(self.is_offloaded(tag) for tag in GROUPS)

    def is_offloaded(self, tag: str) -> bool:
        return self._device_memory is not None and self._device_memory.is_offloaded(tag)

    def groups(self) -> dict[str, list[torch.Tensor]]:
        """The tensors of each group; a storage shared with the weights moves with the weights."""
        params = [p for chunk in self.model for p in chunk.parameters()]
        # main_grad: the fp32 gradient buffer megatron-core's DDP attaches to each parameter
        state = [grad for p in params if (grad := getattr(p, "main_grad", None)) is not None]
        state += [b.grad_data for chunk in self.model for b in getattr(chunk, "buffers", [])]
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in inner.optimizer.param_groups:
                for param in group["params"]:
                    state.append(param)
                    state += [v for v in inner.optimizer.state.get(param, {}).values() if torch.is_tensor(v)]
        return {"weights": params, "train_state": state}

    def offload(self, tags: list[str]) -> int:
        """Moves the groups ``tags`` off the device; bytes freed (0 for a group already away)."""
        groups = self.groups()
        weights = {storage_key(t) for t in groups["weights"]}
        return sum(
            self.device_memory.offload(tag, groups[tag], claimed=None if tag == "weights" else weights)
            for tag in tags
        )

    def onload(self, tags: list[str]) -> int:
        return sum(self.device_memory.onload(tag) for tag in tags)
