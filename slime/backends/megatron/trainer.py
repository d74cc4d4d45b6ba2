"""One Megatron trainer rank: model, optimizer and the calls the Ray trainer group makes on it.

The same code runs on a GPU (NCCL) and on the CPU (gloo); ``slime.utils.device`` is the only place
that knows which.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from slime.backends.megatron import checkpoint
from slime.backends.megatron.batching import MicroBatch, TrainData, make_micro_batches
from slime.backends.megatron.config import padded_vocab_size, transformer_config_from_args
from slime.backends.megatron.conversion import ModelConverter, get_converter
from slime.backends.megatron.conversion.base import ModelShape
from slime.backends.megatron.hf_checkpoint import iter_hf_weights, load_hf_weights, write_hf_checkpoint
from slime.backends.megatron.logprobs import token_logprobs_and_entropy
from slime.backends.megatron.loss import LossFn, build_loss_fn
from slime.backends.megatron.model import build_model_chunks, build_optimizer, wrap_for_training
from slime.utils.device import distributed_backend, setup_device

logger = logging.getLogger(__name__)
# megatron-core still calls the old names of these collectives; the warning is not actionable here.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def converter_for(args: argparse.Namespace) -> ModelConverter:
    """The HF<->Megatron converter for ``--hf-checkpoint``'s architecture and this run's vocab padding."""
    hf_config = json.loads((Path(args.hf_checkpoint) / "config.json").read_text())
    shape = ModelShape(
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        head_dim=args.kv_channels,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        padded_vocab_size=padded_vocab_size(args),
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
    )
    return get_converter(hf_config["model_type"], shape=shape)


class MegatronTrainer:
    """A rank of the trainer world: builds the model from the HF checkpoint and trains it."""

    def __init__(
        self, args: argparse.Namespace, rank: int, world_size: int, master_addr: str, master_port: int
    ):
        self.args = args
        self.device = setup_device(rank)
        dist.init_process_group(
            backend=distributed_backend(),
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
        )
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)

        self.config = transformer_config_from_args(args)
        self.converter = converter_for(args)
        chunks = build_model_chunks(args, self.config)
        load_hf_weights(chunks, args.hf_checkpoint, self.converter, gated=args.swiglu)
        self.model = wrap_for_training(args, self.config, chunks)
        total_steps = (args.num_rollout or 0) * args.num_steps_per_rollout
        self.optimizer, self.scheduler = build_optimizer(args, self.model, total_steps)
        self.loss_fn: LossFn = build_loss_fn(args)
        self.step = 0
        # The frozen reference policy for --use-kl-loss: the initial weights, kept off the model.
        self.ref_weights = self._snapshot() if args.use_kl_loss else None

    # ---- forward helpers -------------------------------------------------------------------------

    def _response_outputs(
        self, batch: MicroBatch, temperature: float, with_entropy: bool
    ) -> Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
        """On the last stage: a micro-batch's logits -> per-sample response log-probs (and entropy)."""

        def from_logits(logits: torch.Tensor):
            logprobs, entropy = token_logprobs_and_entropy(
                logits[:, :-1], batch.tokens[:, 1:], self.args.vocab_size, temperature, with_entropy
            )
            return batch.response_slices(logprobs), (batch.response_slices(entropy) if with_entropy else None)

        return from_logits

    def _run(
        self,
        data: TrainData,
        loss_of: Callable[[MicroBatch, list[torch.Tensor], list[torch.Tensor] | None], tuple],
        forward_only: bool,
        with_entropy: bool,
        temperature: float,
    ) -> list[dict]:
        batches = make_micro_batches(data, self.args.micro_batch_size, self.device)

        def forward_step(iterator, model):
            batch = next(iterator)
            output = model(batch.tokens, batch.position_ids, None)
            outputs_of = self._response_outputs(batch, temperature, with_entropy)
            return output, lambda logits: loss_of(batch, *outputs_of(logits))

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in self.model],
            model=self.model,
            num_microbatches=len(batches),
            seq_length=max(b.tokens.shape[1] for b in batches),
            micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only,
        )

    # ---- calls made by the trainer group ---------------------------------------------------------

    @torch.no_grad()
    def compute_log_probs(self, data: TrainData, temperature: float = 1.0) -> list[torch.Tensor] | None:
        """Per-sample log-probs of the response tokens (on the last pipeline stage; None elsewhere)."""
        for chunk in self.model:
            chunk.eval()

        def collect(batch, log_probs, _entropy):
            return torch.zeros((), device=self.device), {"log_probs": [lp.float().cpu() for lp in log_probs]}

        stored = self._run(data, collect, forward_only=True, with_entropy=False, temperature=temperature)
        if not mpu.is_pipeline_last_stage():
            return None
        return [lp for item in stored for lp in item["log_probs"]]

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().to("cpu", copy=True) for chunk in self.model for p in chunk.parameters()]

    @torch.no_grad()
    def _load_snapshot(self, weights: list[torch.Tensor]) -> None:
        params = [p for chunk in self.model for p in chunk.parameters()]
        for param, value in zip(params, weights, strict=True):
            param.copy_(value)

    def add_policy_inputs(self, shards: list[TrainData]) -> None:
        """Adds ``old_log_probs`` (and ``ref_log_probs``) to every step's shard of a rollout.

        All are computed before the first optimizer step of the rollout, so step 0 is exactly
        on-policy (ratio 1) and later steps see the rollout policy as "old".
        """
        for shard in shards:
            old = self.compute_log_probs(shard)
            if old is not None:
                shard["old_log_probs"] = old
        if self.ref_weights is None:
            return
        current = self._snapshot()
        self._load_snapshot(self.ref_weights)
        try:
            for shard in shards:
                ref = self.compute_log_probs(shard)
                if ref is not None:
                    shard["ref_log_probs"] = ref
        finally:
            self._load_snapshot(current)

    def train_step(self, data: TrainData) -> dict[str, float]:
        """One optimizer step on this rank's share of a global batch; returns global metrics."""
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        num_micro_batches = -(-len(data["tokens"]) // self.args.micro_batch_size)
        # Megatron divides each micro-batch loss by their count and DDP averages over data-parallel
        # ranks; the loss weights already normalise over the global batch, so undo both.
        scale = num_micro_batches * mpu.get_data_parallel_world_size()

        def loss_of(batch, log_probs, entropy):
            loss, metrics = self.loss_fn(batch, log_probs, entropy)
            metrics = {"loss": loss.detach().clone(), **{k: v.detach().clone() for k, v in metrics.items()}}
            return loss * scale, metrics

        stored = self._run(data, loss_of, forward_only=False, with_entropy=True, temperature=1.0)
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        self.step += 1
        metrics = self._reduce_metrics(stored)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["skipped"] = float(not updated)
        return metrics

    def _reduce_metrics(self, stored: list[dict]) -> dict[str, float]:
        """Sums the per-micro-batch shares over data-parallel ranks; every rank gets the result."""
        payload = None
        if mpu.is_pipeline_last_stage():
            keys = sorted(stored[0]) if stored else []
            values = torch.stack([sum(item[k] for item in stored).float() for k in keys]) if keys else None
            if values is not None:
                group = mpu.get_data_parallel_group(with_context_parallel=True)
                dist.all_reduce(values, group=group)
                payload = dict(zip(keys, values.tolist(), strict=True))
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            box = [payload]
            source = mpu.get_pipeline_model_parallel_last_rank()
            dist.broadcast_object_list(box, src=source, group=mpu.get_pipeline_model_parallel_group())
            payload = box[0]
        return payload or {}

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's weights as full HF tensors (collective over tensor-parallel ranks)."""
        return iter_hf_weights(self.model, self.converter, gated=self.args.swiglu)

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """All HF weights, collected on global rank 0 (None elsewhere); for checks and small models."""
        local = {name: t.cpu() for name, t in self.iter_hf_weights()}
        if mpu.get_tensor_model_parallel_rank() != 0 or mpu.get_data_parallel_rank() != 0:
            local = {}
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if dist.get_rank() != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return merged

    def save_hf(self, directory: str) -> str | None:
        """Writes an HF checkpoint (safetensors + the source's config and tokenizer files) from rank 0."""
        state = self.hf_state_dict()
        if state is None:
            return None
        return write_hf_checkpoint(state, self.args.hf_checkpoint, directory)

    def save(self, directory: str, rollout_id: int) -> str:
        return checkpoint.save(directory, rollout_id, self.model, self.optimizer, self.scheduler, self.step)

    def load(self, directory: str) -> int | None:
        """Loads the latest checkpoint under ``directory``; returns its rollout id (None if there is none)."""
        state = checkpoint.load(
            directory,
            self.model,
            None if self.args.no_load_optim else self.optimizer,
            None if self.args.no_load_optim else self.scheduler,
        )
        if state is None:
            return None
        self.step = state["step"]
        return state["rollout_id"]

    def close(self) -> None:
        if dist.is_initialized():
            mpu.destroy_model_parallel()
            dist.destroy_process_group()
