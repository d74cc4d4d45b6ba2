"""One Megatron trainer rank: model, optimizer and the calls the Ray trainer group makes on it.

The same code runs on a GPU (NCCL) and on the CPU (gloo); ``slime.utils.device`` is the only place
that knows which.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from slime.algorithms.mismatch import per_scored_token
from slime.backends.megatron import checkpoint
from slime.backends.megatron.batching import (
    MicroBatch,
    consecutive_groups,
    even_groups,
    interleaved_count,
    make_micro_batches,
    min_bin_count,
    pad_to_shape,
    partition_by_token_budget,
)
from slime.backends.megatron.config import padded_vocab_size, transformer_config
from slime.backends.megatron.conversion import ModelConverter, get_converter
from slime.backends.megatron.conversion.base import ModelShape
from slime.backends.megatron.hf_checkpoint import (
    HFCheckpointWriter,
    iter_hf_weights,
    load_hf_weights,
    stream_hf_weights,
)
from slime.backends.megatron.logprobs import token_logprobs_and_entropy
from slime.backends.megatron.lora.layers import attach_lora
from slime.backends.megatron.lora.peft_io import (
    gather_lora_weights,
    iter_lora_weights,
    load_peft_adapter,
    write_peft_adapter,
)
from slime.backends.megatron.loss import LossFn, build_loss_fn, old_log_probs_are_current
from slime.backends.megatron.model import build_model_chunks, build_optimizer, wrap_for_training
from slime.backends.megatron.mrope_positions import read_mrope_config
from slime.backends.megatron.offload import TrainerMemory
from slime.backends.megatron.packed_attention import packed_seq_params, shared_prompt_layouts
from slime.backends.megatron.routing_replay import RoutingMode, RoutingReplay
from slime.backends.megatron.value_head import attach_value_heads
from slime.config.settings.trainer import TrainerSettings
from slime.rollout.train_data import TrainData
from slime.utils.device import distributed_backend, setup_device
from slime.utils.http import listening_socket_fd
from slime.utils.startup import mark

logger = logging.getLogger(__name__)
# megatron-core still calls the old names of these collectives; the warning is not actionable here.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def converter_for(settings: TrainerSettings) -> ModelConverter:
    """The HF<->Megatron converter for ``--hf-checkpoint``'s architecture and this run's vocab padding."""
    hf_config = json.loads((Path(settings.checkpoint.hf_checkpoint) / "config.json").read_text())
    model = settings.model
    shape = ModelShape(
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        head_dim=model.kv_channels,
        hidden_size=model.hidden_size,
        vocab_size=model.vocab_size,
        padded_vocab_size=padded_vocab_size(settings),
        tie_word_embeddings=not model.untie_embeddings_and_output_weights,
    )
    return get_converter(hf_config["model_type"], shape=shape)


def model_state_tensors(chunks: list[torch.nn.Module]) -> list[torch.Tensor]:
    """What the model computes with: its parameters and its persistent buffers, such as the MoE
    router's ``expert_bias`` (aux-loss-free load balancing updates it every step, so a reference
    policy that kept only parameters would route with the current policy's bias). Non-persistent
    buffers (token counters, rotary caches) are left out, as a checkpoint leaves them out."""
    tensors: list[torch.Tensor] = []
    for chunk in chunks:
        tensors += list(chunk.parameters())
        for module in chunk.modules():
            skip = module._non_persistent_buffers_set
            buffers = module.named_buffers(recurse=False)
            tensors += [b for name, b in buffers if b is not None and name not in skip]
    return tensors


class MegatronTrainer:
    """A rank of the trainer world: builds the model from the HF checkpoint and trains it.

    ``plugin_args``, the run's namespace, goes to a ``--custom-loss-function-path`` plugin only."""

    def __init__(
        self,
        settings: TrainerSettings,
        plugin_args: argparse.Namespace,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ):
        self.settings = settings
        parallel = settings.parallel
        self.device = setup_device(rank)
        timeout = timedelta(minutes=parallel.distributed_timeout_minutes)
        # The rendezvous listens on master_addr alone: a store started from a tcp:// init_method
        # listens on every interface.
        store = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            master_listen_fd=listening_socket_fd(master_addr, master_port) if rank == 0 else None,
        )
        dist.init_process_group(
            backend=distributed_backend(), store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=settings.virtual_stages,
            context_parallel_size=parallel.context_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            distributed_timeout_minutes=parallel.distributed_timeout_minutes,
        )
        torch.manual_seed(settings.seed)
        model_parallel_cuda_manual_seed(settings.seed)
        mark("trainer: process groups")

        self.config = transformer_config(settings)
        self.converter = converter_for(settings)
        # A vision-language model: its micro-batches carry 3-D RoPE positions and the images' patches.
        self.mrope = read_mrope_config(settings.checkpoint.hf_checkpoint)
        chunks = build_model_chunks(settings, self.config, self.device)
        mark("trainer: model built")
        # MoE routing replay (--use-rollout-routing-replay, --use-routing-replay): idle without them.
        self.routing = RoutingReplay(chunks, settings, self.config, self.device)
        gated = settings.model.swiglu
        load_hf_weights(chunks, settings.checkpoint.hf_checkpoint, self.converter, gated=gated)
        mark("trainer: weights loaded")
        lora = settings.lora
        if lora.enabled:  # before DDP: the frozen base gets no gradient buffer and no optimizer state
            attach_lora(chunks, lora, settings.seed, gated)
            if lora.adapter_path is not None:
                load_peft_adapter(chunks, lora.adapter_path, self.converter, gated, lora)
        self.is_critic = settings.is_critic
        if self.is_critic:
            attach_value_heads(chunks, settings.model.hidden_size)
        self.model = wrap_for_training(settings, self.config, chunks)
        mark("trainer: DDP wrapped")
        self.optimizer, self.scheduler = build_optimizer(settings, self.model)
        mark("trainer: optimizer built")
        self.memory = TrainerMemory(self.model, self.optimizer)  # --colocate: offloaded between trainings
        self.loss_fn: LossFn = build_loss_fn(settings, plugin_args)
        self.old_is_current = old_log_probs_are_current(settings)
        self.step = 0
        self.num_micro_batches = 0  # of the last forward/backward pass, for logs and tests
        # The reference policy for KL (as a loss or as reward shaping): the initial weights, kept off
        # the model; refreshed from the policy every --ref-update-interval rollouts.
        self.ref_weights = self._snapshot() if settings.loss.needs_reference else None
        self.rollouts_seen = 0

    # ---- forward helpers -------------------------------------------------------------------------

    def _response_outputs(
        self, batch: MicroBatch, with_entropy: bool
    ) -> Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
        """On the last stage: a micro-batch's logits -> per-sample response log-probs (and entropy).

        The critic's "logits" are values ``[b, s, 1]``; position ``t`` values the state before token ``t+1``,
        aligned with the log-prob of that token."""
        if self.is_critic:
            return lambda values: (batch.response_slices(values[..., 0].float()), None)

        def from_logits(logits: torch.Tensor):
            logprobs, entropy = token_logprobs_and_entropy(
                batch.at_predictors(logits)[None],
                batch.targets[None],
                self.settings.model.vocab_size,
                self.settings.temperature,
                with_entropy,
            )
            return batch.split_responses(logprobs[0]), (
                batch.split_responses(entropy[0]) if entropy is not None else None  # None: not with_entropy
            )

        return from_logits

    def _micro_batches(self, data: TrainData) -> list[MicroBatch]:
        """This rank's micro-batches: packed unless ``--qkv-format bshd``; with
        ``--use-dynamic-batch-size`` cut by token budget into as many as the data-parallel rank that
        needs the most, so every rank runs the same schedule. Virtual pipeline stages need a multiple
        of the pipeline size of them, all of one shape."""
        batching = self.settings.batch
        interleaved = self.settings.virtual_stages is not None
        num_samples, pipeline = len(data["tokens"]), mpu.get_pipeline_model_parallel_world_size()
        if batching.use_dynamic_batch_size:
            budget = batching.max_tokens_per_gpu
            assert budget is not None  # checked: --use-dynamic-batch-size needs --max-tokens-per-gpu
            lengths = [len(tokens) for tokens in data["tokens"]]
            most = torch.tensor(min_bin_count(lengths, budget), device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group())
            count = interleaved_count(int(most), num_samples, pipeline) if interleaved else int(most)
            groups = partition_by_token_budget(lengths, budget, count)
        else:
            groups = consecutive_groups(num_samples, batching.micro_batch_size)
            if interleaved:
                groups = even_groups(num_samples, interleaved_count(len(groups), num_samples, pipeline))
        batches = make_micro_batches(
            data,
            groups,
            self.device,
            packed=batching.qkv_format == "thd",
            pad_to_multiple=mpu.get_tensor_model_parallel_world_size(),
            share_prompts=batching.share_prompts_in_train,
            mrope=self.mrope,
        )
        if interleaved:
            rows = max(b.tokens.shape[0] for b in batches)
            length = max(b.tokens.shape[1] for b in batches)
            batches = [pad_to_shape(b, rows, length) for b in batches]
        self.num_micro_batches = len(batches)
        return batches

    def _run(
        self,
        data: TrainData,
        loss_of: Callable[[MicroBatch, list[torch.Tensor], list[torch.Tensor] | None], tuple],
        forward_only: bool,
        with_entropy: bool,
        routing: RoutingMode = RoutingMode.OFF,
    ) -> list[dict]:
        """Runs Megatron's schedule over ``data``; ``loss_of`` returns a micro-batch's share of the
        global loss (its loss weights normalise over the global batch). ``routing``: what the MoE
        routers do (``routing_replay``)."""
        batches = self._micro_batches(data)
        # Megatron divides each micro-batch loss by this rank's count and DDP averages over
        # data-parallel ranks; undo both so the gradient is that of the summed shares.
        scale = len(batches) * mpu.get_data_parallel_world_size()

        def forward_step(iterator, model):
            batch = next(iterator)
            chunk = next(i for i, candidate in enumerate(self.model) if candidate is model)
            self.routing.before_forward(chunk, batch)
            images = {}  # a VLM's micro-batch with images only: text models get the plain call
            if batch.pixel_values is not None:
                images = {
                    "pixel_values": batch.pixel_values,
                    "image_grid_thw": batch.image_grid_thw,
                    "image_mask": batch.image_mask,
                }
            output = model(
                batch.tokens, batch.position_ids, None, packed_seq_params=packed_seq_params(batch), **images
            )
            self.routing.after_forward(chunk)
            outputs_of = self._response_outputs(batch, with_entropy)

            def scaled_loss(logits):
                loss, metrics = loss_of(batch, *outputs_of(logits))
                return loss * scale, metrics

            return output, scaled_loss

        with shared_prompt_layouts(batches), self.routing.routing(routing, data, training=not forward_only):
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(batches) for _ in self.model],
                model=self.model,
                num_microbatches=len(batches),
                seq_length=max(b.tokens.shape[1] for b in batches),
                micro_batch_size=max(b.tokens.shape[0] for b in batches),
                forward_only=forward_only,
            )

    # ---- calls made by the trainer group ---------------------------------------------------------

    def compute_log_probs(self, data: TrainData) -> list[torch.Tensor] | None:
        """Per-sample log-probs of the response tokens (on the last pipeline stage; None elsewhere), at
        the training temperature (``TrainerSettings.temperature``). The policy's forward over rollout
        data: under routing replay it replays the engine's routes (R3) or records its own (R2)."""
        assert not self.is_critic, "the critic has a value head, not log-probs: compute_values"
        return self._response_forward(data, self.routing.old_pass_mode)

    def compute_values(self, data: TrainData) -> list[torch.Tensor] | None:
        """The critic's value of the state before every response token, per sample (on the last pipeline
        stage; None elsewhere): the baseline PPO's GAE needs."""
        assert self.is_critic, "only the critic has a value head (--advantage-estimator ppo)"
        return self._response_forward(data)

    @torch.no_grad()
    def _response_forward(
        self, data: TrainData, routing: RoutingMode = RoutingMode.OFF
    ) -> list[torch.Tensor] | None:
        """A forward pass without gradients; the model's per-response-token output of every sample, in
        the data's order (the last pipeline stage; None elsewhere)."""
        for chunk in self.model:
            chunk.eval()

        def collect(batch, outputs, _entropy):
            kept = {"outputs": [out.float().cpu() for out in outputs], "indices": batch.indices}
            return torch.zeros((), device=self.device), kept

        stored = self._run(data, collect, forward_only=True, with_entropy=False, routing=routing)
        if not mpu.is_pipeline_last_stage():
            return None
        # Dynamic micro-batches hold samples out of order; put them back in the data's order.
        ordered: list[torch.Tensor | None] = [None] * len(data["tokens"])
        for item in stored:
            for index, output in zip(item["indices"], item["outputs"], strict=True):
                ordered[index] = output
        found = [output for output in ordered if output is not None]
        assert len(found) == len(ordered)  # the micro-batches cover every sample once
        return found

    def _gather_params(self) -> None:
        """Completes the parameter all-gather of the last optimizer step before parameters are read
        outside a forward pass (push, checkpoint, export, reference snapshot).

        With ``--overlap-param-gather`` the distributed optimizer updates only each rank's own shard
        and leaves the all-gather to the forward pre-hooks of the next step, so until then a rank's
        parameters mix its new shard with the others' old ones. A synchronous gather here is what
        Megatron's own training loop does before it saves or evaluates.
        """
        if self.settings.parallel.overlap_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def _snapshot(self) -> list[torch.Tensor]:
        self._gather_params()
        return [t.detach().to("cpu", copy=True) for t in model_state_tensors(self.model)]

    @torch.no_grad()
    def _load_snapshot(self, weights: list[torch.Tensor]) -> None:
        for tensor, value in zip(model_state_tensors(self.model), weights, strict=True):
            tensor.copy_(value)

    def add_policy_inputs(self, shards: list[TrainData]) -> None:
        """Adds ``old_log_probs`` (and ``ref_log_probs``) to every step's shard of a rollout.

        All are computed before the first optimizer step of the rollout, so step 0 is exactly
        on-policy (ratio 1) and later steps see the rollout policy as "old". With
        ``--use-rollout-logprobs`` the engine's log-probs are the old policy's (no recomputation); when
        ``old_log_probs_are_current``, the loss takes them from its own forward and none are added.
        """
        interval = self.settings.loss.ref_update_interval
        if interval and self.rollouts_seen and self.rollouts_seen % interval == 0:
            self.ref_weights = self._snapshot()
        self.rollouts_seen += 1
        for shard in shards if not self.old_is_current else ():
            if self.settings.loss.use_rollout_logprobs:
                if mpu.is_pipeline_last_stage():
                    shard["old_log_probs"] = [torch.as_tensor(r).float() for r in shard["rollout_log_probs"]]
                continue
            old = self.compute_log_probs(shard)
            if old is not None:
                shard["old_log_probs"] = old
        if self.ref_weights is None:
            return
        current = self._snapshot()
        self._load_snapshot(self.ref_weights)
        try:
            for shard in shards:  # the reference routes for itself: no engine ran it (routing_replay)
                ref = self._response_forward(shard)
                if ref is not None:
                    shard["ref_log_probs"] = ref
        finally:
            self._load_snapshot(current)

    def train_step(self, data: TrainData) -> dict[str, float]:
        """One optimizer step on this rank's share of a global batch; returns global metrics, and this
        rank's wall-clock seconds of Megatron's forward/backward schedule and of the optimizer step
        (on a GPU the optimizer's grad-norm read waits for the queued work, so the split is honest)."""
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_of(batch, log_probs, entropy):
            loss, metrics = self.loss_fn(batch, log_probs, entropy)
            metrics = {"loss": loss.detach().clone(), **{k: v.detach().clone() for k, v in metrics.items()}}
            return loss, metrics

        start = time.perf_counter()
        stored = self._run(
            data, loss_of, forward_only=False, with_entropy=True, routing=self.routing.train_mode
        )
        ran = time.perf_counter()
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        self.step += 1
        metrics = per_scored_token(self._reduce_metrics(stored))
        metrics["perf/train_forward_backward_time"] = ran - start
        metrics["perf/train_optimizer_time"] = time.perf_counter() - ran
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["skipped"] = float(not updated)
        metrics.update(self.routing.step_metrics())
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
        self._gather_params()
        return iter_hf_weights(self.model, self.converter, gated=self.settings.model.swiglu)

    def stream_hf_weights(
        self, bucket_bytes: int, consume: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> None:
        """Every HF tensor of every pipeline stage, in buckets of at most ``bucket_bytes``
        (``WeightSyncSettings.bucket_bytes``), handed to ``consume`` on global rank 0 (a collective:
        every rank calls it)."""
        self._gather_params()
        gated = self.settings.model.swiglu
        stream_hf_weights(self.model, self.converter, gated, bucket_bytes, self.device, consume)

    def hf_state_dict(self, bucket_bytes: int) -> dict[str, torch.Tensor] | None:
        """All HF weights, collected on global rank 0 (None elsewhere); for checks and small models."""
        merged: dict[str, torch.Tensor] = {}
        self.stream_hf_weights(
            bucket_bytes, lambda bucket: merged.update((name, t.clone()) for name, t in bucket)
        )
        return merged if dist.get_rank() == 0 else None

    def iter_lora_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's LoRA adapters as full HF PEFT tensors (``base_model.model.<module>
        .lora_A.weight`` / ``.lora_B.weight``; a collective over tensor-parallel ranks)."""
        self._gather_params()
        return iter_lora_weights(self.model, self.converter, gated=self.settings.model.swiglu)

    def lora_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every pipeline stage's adapters on global rank 0 (None elsewhere; a collective)."""
        self._gather_params()
        return gather_lora_weights(self.model, self.converter, gated=self.settings.model.swiglu)

    def save_lora_hf(self, directory: str) -> str | None:
        """Writes the adapter as HF PEFT does (``adapter_config.json``, ``adapter_model.safetensors``)
        from rank 0 (a collective); its path on rank 0."""
        weights = self.lora_state_dict()
        if weights is None:
            return None
        return write_peft_adapter(
            directory, weights, self.settings.lora, self.settings.checkpoint.hf_checkpoint
        )

    def save_hf(self, directory: str, bucket_bytes: int) -> str | None:
        """Writes an HF checkpoint from rank 0, bucket by bucket (collective); its path on rank 0.

        With LoRA the adapter instead: the frozen base is ``--hf-checkpoint`` bit for bit, and the
        adapter's ``base_model_name_or_path`` names it (PEFT and transformers load the pair)."""
        if self.settings.lora.enabled:
            return self.save_lora_hf(directory)
        hf_checkpoint = self.settings.checkpoint.hf_checkpoint
        writer = HFCheckpointWriter(hf_checkpoint, directory) if dist.get_rank() == 0 else None
        self.stream_hf_weights(bucket_bytes, writer.add if writer is not None else lambda bucket: None)
        return writer.close() if writer is not None else None

    def save(self, directory: str, rollout_id: int) -> str:
        self._gather_params()
        return checkpoint.save(directory, rollout_id, self.model, self.optimizer, self.scheduler, self.step)

    def load(self, directory: str) -> int | None:
        """Loads ``--ckpt-step`` (default: the latest) from ``directory``; returns its rollout id or None."""
        ckpt = self.settings.checkpoint
        state = checkpoint.load(
            directory,
            self.model,
            None if ckpt.no_load_optim else self.optimizer,
            None if ckpt.no_load_optim else self.scheduler,
            rollout_id=ckpt.ckpt_step,
        )
        if state is None:
            return None
        self.step = state["step"]
        self.rollouts_seen = state["rollout_id"] + 1
        if self.settings.loss.ref_update_interval and self.ref_weights is not None:
            self.ref_weights = self._snapshot()  # the refreshed reference is not saved: restart from here
        return state["rollout_id"]

    def close(self) -> None:
        if dist.is_initialized():
            mpu.destroy_model_parallel()
            dist.destroy_process_group()
