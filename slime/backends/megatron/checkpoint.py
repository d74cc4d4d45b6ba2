"""Megatron distributed checkpoints (torch_dist), laid out as Megatron-LM lays them out.

``DIR/iter_0000007/`` holds the sharded model and optimizer state of rollout 7, and
``DIR/latest_checkpointed_iteration.txt`` names the newest one, so ``--load DIR`` resumes from it.
The writer starts worker processes with ``spawn``: a script that saves must guard its entry point
with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from slime.backends.megatron.sharding import unwrap
from slime.utils.checkpoint_layout import TRACKER_FILE, iteration_dir, latest_rollout_id

_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _model_key(index: int, num_chunks: int) -> str:
    return "model" if num_chunks == 1 else f"model{index}"


def _model_state(model: list[torch.nn.Module]) -> dict:
    return {_model_key(i, len(model)): unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _materialize_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Gives a fresh optimizer state tensors to load into, as Megatron does for its FSDP path.

    A sharded load fills existing state in place, and torch's Adam creates its state (``step``,
    moments) only on the first step: so take one step with zero gradients. Everything it touches is
    overwritten by the load right after.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        if torch_optimizer is None or len(torch_optimizer.state) > 0:
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        torch_optimizer.step()
        torch_optimizer.zero_grad()


def _unshare_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Gives every parameter's Adam ``step`` a tensor of its own after a load.

    Without Apex or Transformer Engine (the CPU path) megatron-core 0.16's distributed optimizer loads
    one ``step`` tensor into every parameter's state; torch's Adam increments each parameter's step in
    place, so the next update took the k-th parameter's bias correction at step ``n + k``, and a resumed
    run drifted from the uninterrupted one from its first step.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for state in torch_optimizer.state.values() if torch_optimizer is not None else ():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _sharded_state(
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    is_loading: bool,
) -> dict:
    state = _model_state(model)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA
        )
    return state


def save(
    directory: str | Path,
    rollout_id: int,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    step: int,
) -> str:
    """Writes the checkpoint of ``rollout_id`` (a collective: every trainer rank calls it)."""
    target = iteration_dir(directory, rollout_id)
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["progress"] = {"rollout_id": rollout_id, "step": step}
    dist_checkpointing.save(state, str(target))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(directory) / TRACKER_FILE).write_text(str(rollout_id))
    dist.barrier()
    return str(target)


def _has_optimizer_state(target: Path) -> bool:
    return any(key.startswith("optimizer.") for key in dist_checkpointing.load_tensors_metadata(str(target)))


@torch.no_grad()
def load(
    directory: str | Path,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    rollout_id: int | None = None,
) -> dict | None:
    """Restores ``rollout_id``'s checkpoint (default: the latest) in place; returns its progress record,
    or None if there is none."""
    if rollout_id is None:
        rollout_id = latest_rollout_id(directory)
    if rollout_id is None:
        return None
    target = iteration_dir(directory, rollout_id)
    if optimizer is not None and not _has_optimizer_state(target):
        # Saved before the optimizer's first step (e.g. PPO's critic-only warm-up): nothing to restore.
        optimizer = None
    if optimizer is not None:
        _materialize_optimizer_state(optimizer)
    state = _sharded_state(model, optimizer, is_loading=True)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else {}
    state["progress"] = {}
    loaded = dist_checkpointing.load(state, str(target))
    for i, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(loaded[_model_key(i, len(model))])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    return loaded["progress"]
