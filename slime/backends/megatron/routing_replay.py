"""MoE routing replay in the trainer: R3 (``--use-rollout-routing-replay``) and R2 (``--use-routing-replay``).

Why: a router picks its top-k experts by comparing scores, so where two experts' scores are near-tied
the floating-point noise between two computations of one token (the engine's kernels and the
trainer's, or an eval-mode forward and a training forward) flips the choice, and a flipped expert
changes the token's output entirely, not by noise. Replaying a route sends each token to the experts
recorded for it while the routing *weights* still come from the live router logits, gathered at the
replayed experts, so the router keeps its gradient. R3 replays the engine's routes (train data
``rollout_routed_experts``: per sample an int32 ``[len(tokens) - 1, num_hidden_layers, topk]``, row t
the experts token t went to in every HF layer, dense ones included) in every forward of the policy;
R2 records the trainer's own routes in the old-log-prob forward and replays them in the training
forwards. The reference policy never replays: no engine ran it, and its log-probs must be those of
the fixed initial policy, not of the initial weights pushed through the current policy's routes.

Mechanism (megatron-core 0.16): ``topk_routing_with_score_function`` (``transformer/moe/moe_utils.py``)
takes its top-k from the router's ``router_replay`` (``transformer/moe/router_replay.py``). Under
REPLAY_FORWARD / REPLAY_BACKWARD that returns the given ids and the scores gathered at them: softmax
routing gathers the logits (then a softmax over the k) or, pre-softmax, the full softmax's
probabilities; sigmoid routing with an expert bias (DeepSeek-V3) uses the biased scores only to
choose and gathers the weights from the unbiased sigmoid. REPLAY_BACKWARD pops, oldest first, the ids
``set_target_indices`` appended, so a layer recomputed under ``--recompute-granularity full`` gets in
the backward pass the ids of its own forward (megatron's schedules run a chunk's backwards in the
order of its forwards). The trainer switches every router to REPLAY_BACKWARD as soon as a forward
step returns: whatever runs a router between two forward steps is a recomputation.

Each MoE router gets a :class:`LayerReplay`, owned by the trainer instead of megatron's process-wide
``RouterReplay.global_router_replay_instances`` (``moe_enable_routing_replay`` stays off), so a model
built again in the same process (a test, a second trainer) never finds the old model's layers in that
list, and the HF layer of every router is known by its layer number rather than by build order.

Layout: a micro-batch's tokens lie as ``batching`` put them (``MicroBatch.token_positions``); the
routers see the hidden states ``[s, b, h]`` flattened, position ``(row, column)`` as token
``column * b + row``, and under sequence parallelism each tensor-parallel rank only its contiguous
``s / tp`` slice. Padding gets valid filler routes (its outputs feed nothing); a prompt that
``--share-prompts-in-train`` computes once takes the routes of the group's first sample, and the
tokens where another sample's routes differ are counted (``routing_replay/shared_prompt_route_mismatches``).
Context parallelism is refused before anything starts (``validate``). Expert parallelism changes
nothing: routes are global expert ids.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_block import TransformerBlock

from slime.backends.megatron.batching import MicroBatch
from slime.config.settings.trainer import TrainerSettings
from slime.rollout.train_data import TrainData

logger = logging.getLogger(__name__)

ROLLOUT_KEY = "rollout_routed_experts"
"""R3's train data: the engine's routes of each sample (see the module docstring)."""
RECORDED_KEY = "recorded_routed_experts"
"""R2's: per sample an int32 ``[len(tokens), this stage's MoE layers, topk]`` recorded by the old-log-prob
forward, -1 for tokens that another tensor-parallel rank's sequence shard routed."""


class RoutingReplayError(RuntimeError):
    """Routes that cannot be replayed (wrong shape, unknown experts, a layer not captured) or were not
    consumed exactly once."""


class RoutingMode(Enum):
    """What the MoE routers do in one pass over a rank's data."""

    OFF = "off"
    RECORD = "record"
    REPLAY_ROLLOUT = "replay_rollout"
    REPLAY_RECORDED = "replay_recorded"


def moe_layer_indices(num_layers: int, moe_layer_freq: int | list[int]) -> list[int]:
    """The HF indices of the MoE layers (``--moe-layer-freq``: every n-th layer, or one 0/1 per layer)."""
    if isinstance(moe_layer_freq, int):
        return [i for i in range(num_layers) if i % moe_layer_freq == 0]
    return [i for i, sparse in enumerate(moe_layer_freq) if sparse]


@dataclass(frozen=True)
class SequenceShard:
    """The part of a micro-batch's sequence this rank's routers see: slice ``rank`` of ``size`` under
    sequence parallelism (size = tensor-parallel size), else all of it."""

    rank: int = 0
    size: int = 1


def _router_order(token_positions: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Each sample token's index among the ``s * b`` tokens the routers see (``[s, b]`` flattened)."""
    rows, columns = token_positions.unbind(1)
    return columns * shape[0] + rows


def _shard_bounds(shape: Sequence[int], shard: SequenceShard) -> tuple[int, int]:
    rows, length = shape
    if length % shard.size:
        raise RoutingReplayError(
            f"a micro-batch of {length} positions does not split over {shard.size} sequence-parallel ranks"
        )
    per_rank = length // shard.size * rows
    return shard.rank * per_rank, (shard.rank + 1) * per_rank


def layout_routes(
    token_positions: torch.Tensor,
    shape: Sequence[int],
    routes: torch.Tensor,
    shard: SequenceShard = SequenceShard(),
) -> tuple[torch.Tensor, int]:
    """Per-token routes ``[N, layers, topk]`` (the samples' tokens end to end) laid out as a micro-batch
    of ``shape`` = ``[b, s]`` holds its tokens: ``([layers, tokens this rank routes, topk], mismatches)``.

    A position that several sample tokens share (a shared prompt) takes the first one's routes;
    ``mismatches`` counts the others whose routes differ. Positions no token fills (padding) get the
    experts ``0 .. topk-1``.
    """
    num_tokens, num_layers, topk = routes.shape
    where = _router_order(token_positions, shape)
    first = torch.full((shape[0] * shape[1],), num_tokens, dtype=torch.long)
    first = first.scatter_reduce(0, where, torch.arange(num_tokens), reduce="amin")
    filler = torch.arange(topk, dtype=routes.dtype).expand(1, num_layers, topk)
    laid = torch.cat([routes, filler])[first]
    mismatches = int((routes != routes[first[where]]).flatten(1).any(1).sum())
    begin, end = _shard_bounds(shape, shard)
    return laid[begin:end].transpose(0, 1).contiguous(), mismatches


def collect_routes(
    token_positions: torch.Tensor,
    shape: Sequence[int],
    recorded: torch.Tensor,
    shard: SequenceShard = SequenceShard(),
) -> torch.Tensor:
    """The inverse of :func:`layout_routes`: routes recorded as ``[layers, tokens this rank routed, topk]``
    -> int32 ``[N, layers, topk]`` per sample token (every sample of a shared prompt gets the prompt's
    routes; -1 for tokens in another rank's sequence shard)."""
    num_layers, routed, topk = recorded.shape
    begin, end = _shard_bounds(shape, shard)
    if routed != end - begin:
        raise RoutingReplayError(f"{routed} routes recorded for a shard of {end - begin} tokens")
    where = _router_order(token_positions, shape)
    mine = (where >= begin) & (where < end)
    out = torch.full((len(where), num_layers, topk), -1, dtype=torch.int32)
    out[mine] = recorded.transpose(0, 1)[where[mine] - begin].to(torch.int32)
    return out


def engine_routes(routes: Any, layers: Sequence[int]) -> torch.Tensor:
    """One sample's engine routes ``[len - 1, hf layers, topk]`` -> ``[len, len(layers), topk]`` of the
    given HF layers; the last token, never forwarded by the engine, gets the experts ``0 .. topk-1``."""
    kept = torch.as_tensor(np.asarray(routes))[:, list(layers)]
    topk = kept.shape[-1]
    return torch.cat([kept, torch.arange(topk, dtype=kept.dtype).expand(1, len(layers), topk)])


def check_rollout_routes(
    data: TrainData, num_layers: int, moe_layers: Sequence[int], topk: int, num_experts: int
) -> None:
    """R3's routes against the model, when train data arrives: shape ``(len(tokens) - 1, --num-layers,
    --moe-router-topk)``, expert ids below ``--num-experts``, and every MoE layer captured (with top-k > 1
    a token never goes to expert 0 twice, so a layer of zeros is one the engine did not report)."""
    if ROLLOUT_KEY not in data:
        raise RoutingReplayError(
            f"--use-rollout-routing-replay: the train data has no {ROLLOUT_KEY!r}; the engines must return "
            "the routed experts (a rollout function that builds samples itself must set "
            "sample.rollout_routed_experts)"
        )
    names = data.get("positions", range(len(data["tokens"])))
    for name, tokens, routes in zip(names, data["tokens"], data[ROLLOUT_KEY], strict=True):
        what = f"--use-rollout-routing-replay: sample {name} of the rollout"
        expected = (len(tokens) - 1, num_layers, topk)
        array = np.asarray(routes) if routes is not None else None
        if array is None or array.shape != expected:
            shape = None if array is None else array.shape
            raise RoutingReplayError(
                f"{what} has routes of shape {shape}, expected (len(tokens) - 1, --num-layers, "
                f"--moe-router-topk) = {expected}; the engine serves another model or dropped the routes"
            )
        if array.size and (array.min() < 0 or array.max() >= num_experts):
            bad = int(array.max()) if array.max() >= num_experts else int(array.min())
            raise RoutingReplayError(f"{what} routes a token to expert {bad}; --num-experts is {num_experts}")
        for layer in moe_layers if topk > 1 else ():
            if not array[:, layer].any():
                raise RoutingReplayError(
                    f"{what}: MoE layer {layer} has all-zero routes: the engine (or its pipeline stage "
                    "holding that layer) did not capture them"
                )


class LayerReplay(RouterReplay):
    """One MoE layer's ``RouterReplay``, owned by the trainer: it checks the shape of what it hands out,
    keeps every recorded forward (R2) and counts what each pass consumed."""

    def __init__(self, layer: int, recomputed: bool) -> None:
        super().__init__()
        # megatron registers every instance process-wide for its static helpers, which slime does
        # not use: a rebuilt model would otherwise leave its old layers there.
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer = layer
        """The HF layer index."""
        self.recomputed = recomputed
        """Whether a training forward recomputes this layer in the backward pass."""
        self.recorded: list[torch.Tensor] = []
        self.sets = self.forwards = self.recomputes = 0
        self.forward_tokens = self.recomputed_tokens = 0

    def set_target_indices(self, topk_indices: torch.Tensor) -> None:
        super().set_target_indices(topk_indices)
        self.sets += 1

    def get_replay_topk(  # megatron-core's signature
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        action = self.router_replay_action
        given = None
        if action is RouterReplayAction.REPLAY_FORWARD:
            given = self.target_topk_idx
        elif action is RouterReplayAction.REPLAY_BACKWARD:
            if not self.replay_backward_list:
                raise RoutingReplayError(
                    f"routing replay: MoE layer {self.layer} was recomputed more often than it ran forward"
                )
            given = self.replay_backward_list[0]
        replaying = action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)
        if replaying and (given is None or tuple(given.shape) != (scores.shape[0], topk)):
            raise RoutingReplayError(
                f"routing replay: MoE layer {self.layer} routes {scores.shape[0]} tokens to {topk} "
                f"experts but was given {None if given is None else list(given.shape)}"
            )
        probs, indices = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if action is RouterReplayAction.RECORD:
            self.recorded.append(indices.detach().to("cpu", torch.int32))
        elif action is RouterReplayAction.REPLAY_FORWARD:
            self.forwards += 1
            self.forward_tokens += scores.shape[0]
        elif action is RouterReplayAction.REPLAY_BACKWARD:
            self.recomputes += 1
            self.recomputed_tokens += scores.shape[0]
        return probs, indices

    def reset(self) -> None:
        """Drops everything a pass left: routes, the action and the counts."""
        self.clear_indices()
        self.clear_router_replay_action()
        self.recorded = []
        self.sets = self.forwards = self.recomputes = 0
        self.forward_tokens = self.recomputed_tokens = 0


@dataclass
class _Chunk:
    routers: list[LayerReplay]
    columns: list[int]
    """Where each router's layer sits among this pipeline stage's MoE layers (``RECORDED_KEY``'s axis 1)."""
    batches: list[MicroBatch] = field(default_factory=list)
    """RECORD: the micro-batches forwarded, in order (each router recorded one route tensor for each)."""


def _recompute_pattern(config: TransformerConfig, count: int) -> list[bool]:
    """Which of a block's ``count`` layers a training forward recomputes (``_checkpointed_forward`` of
    megatron-core's TransformerBlock: every layer with the uniform method, the first
    ``recompute_num_layers`` with the block method)."""
    if config.recompute_granularity != "full":
        return [False] * count
    if config.recompute_method == "uniform":
        return [True] * count
    return [index < (config.recompute_num_layers or 0) for index in range(count)]


class RoutingReplay:
    """The trainer's side of routing replay: installs a :class:`LayerReplay` in every MoE router of this
    rank's model chunks and, pass by pass, hands each micro-batch's routes to them."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        settings: TrainerSettings,
        config: TransformerConfig,
        device: torch.device,
    ) -> None:
        loss, model = settings.loss, settings.model
        self.device = device
        self.rollout = loss.use_rollout_routing_replay and not settings.is_critic
        self.recorded = loss.use_routing_replay and not self.rollout and not settings.is_critic
        self.num_layers, self.topk = model.num_layers, model.moe_router_topk
        self.num_experts = model.num_experts or 0
        self.moe_layers = (
            moe_layer_indices(model.num_layers, model.moe_layer_freq) if model.num_experts else []
        )
        self.shard = SequenceShard()
        if config.sequence_parallel:
            tp = mpu.get_tensor_model_parallel_world_size()
            self.shard = SequenceShard(mpu.get_tensor_model_parallel_rank(), tp)
        self.chunks: list[_Chunk] = []
        self.stage_layers: list[int] = []
        for chunk in chunks:
            routers = self._install(chunk, config) if self.enabled else []
            columns = list(range(len(self.stage_layers), len(self.stage_layers) + len(routers)))
            self.stage_layers += [router.layer for router in routers]
            self.chunks.append(_Chunk(routers, columns))
        self.mode = RoutingMode.OFF
        self._training = False
        self._step_counts = torch.zeros(3, dtype=torch.float64)
        """Of the training passes since ``step_metrics`` last read them: token rows replayed by forwards,
        by recomputations, and shared-prompt tokens whose samples' routes differ."""

    @staticmethod
    def _install(chunk: torch.nn.Module, config: TransformerConfig) -> list[LayerReplay]:
        routers = []
        for block in (m for m in chunk.modules() if isinstance(m, TransformerBlock)):
            recomputed = _recompute_pattern(config, len(block.layers))
            for layer, again in zip(block.layers, recomputed, strict=True):
                if isinstance(layer.mlp, MoELayer):
                    replay = LayerReplay(layer.layer_number - 1, again)
                    layer.mlp.router.router_replay = replay
                    routers.append(replay)
        return routers

    @property
    def enabled(self) -> bool:
        return self.rollout or self.recorded

    @property
    def old_pass_mode(self) -> RoutingMode:
        """The policy's log-prob forward over rollout data (old log-probs)."""
        if self.rollout:
            return RoutingMode.REPLAY_ROLLOUT
        return RoutingMode.RECORD if self.recorded else RoutingMode.OFF

    @property
    def train_mode(self) -> RoutingMode:
        if self.rollout:
            return RoutingMode.REPLAY_ROLLOUT
        return RoutingMode.REPLAY_RECORDED if self.recorded else RoutingMode.OFF

    @contextlib.contextmanager
    def routing(self, mode: RoutingMode, data: TrainData, training: bool) -> Iterator[None]:
        """One pass of Megatron's schedule over ``data`` in ``mode``; on leaving, checks that every route
        was consumed exactly once by each forward and recomputation (RECORD: stores the routes in
        ``data[RECORDED_KEY]``), and leaves the routers as they were built whatever happened."""
        if mode is RoutingMode.OFF or not self.enabled:
            yield
            return
        if mode is RoutingMode.REPLAY_ROLLOUT:
            check_rollout_routes(data, self.num_layers, self.moe_layers, self.topk, self.num_experts)
        if mode is RoutingMode.REPLAY_RECORDED and RECORDED_KEY not in data:
            raise RoutingReplayError(
                "--use-routing-replay: these samples have no routes recorded by the old-log-prob forward"
            )
        self.mode, self._training = mode, training
        try:
            yield
            self._check_consumed(training)
            if mode is RoutingMode.RECORD:
                data[RECORDED_KEY] = self._collect(data)
        finally:
            self.mode = RoutingMode.OFF
            for chunk in self.chunks:
                chunk.batches = []
                for router in chunk.routers:
                    router.reset()

    def before_forward(self, chunk_index: int, batch: MicroBatch) -> None:
        """Before a chunk's forward step: RECORD, or the micro-batch's routes for REPLAY_FORWARD."""
        chunk = self.chunks[chunk_index]
        if self.mode is RoutingMode.OFF or not chunk.routers:
            return
        if self.mode is RoutingMode.RECORD:
            chunk.batches.append(batch)
            for router in chunk.routers:
                router.set_router_replay_action(RouterReplayAction.RECORD)
            return
        assert batch.token_positions is not None  # batching always sets it
        laid, mismatches = layout_routes(
            batch.token_positions, batch.tokens.shape, self._routes(batch, chunk), self.shard
        )
        if mismatches:
            logger.warning(
                "routing replay: %d tokens of shared prompts have routes that differ between the samples "
                "of their group; the shared prompt replays the first sample's",
                mismatches,
            )
        if (laid < 0).any():
            raise RoutingReplayError(
                "--use-routing-replay: a micro-batch holds tokens that the old-log-prob forward did not "
                "route on this rank (its micro-batches differed)"
            )
        self._step_counts[2] += mismatches if self._training else 0
        for router, routes in zip(chunk.routers, laid.to(self.device, torch.long), strict=True):
            router.set_target_indices(routes)
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, chunk_index: int) -> None:
        """After a chunk's forward step: whatever runs its routers until the next one recomputes them.
        A layer that will not be recomputed drops the routes it just used (``set_target_indices`` queued
        them for a recomputation), so only micro-batches in flight keep theirs."""
        if self.mode not in (RoutingMode.REPLAY_ROLLOUT, RoutingMode.REPLAY_RECORDED):
            return
        for router in self.chunks[chunk_index].routers:
            router.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            if not (self._training and router.recomputed):
                router.replay_backward_list.pop()

    def _routes(self, batch: MicroBatch, chunk: _Chunk) -> torch.Tensor:
        """The micro-batch's samples' routes ``[N, the chunk's MoE layers, topk]``."""
        if self.mode is RoutingMode.REPLAY_ROLLOUT:
            layers = [router.layer for router in chunk.routers]
            return torch.cat([engine_routes(routes, layers) for routes in batch.samples[ROLLOUT_KEY]])
        recorded = torch.cat([torch.as_tensor(routes) for routes in batch.samples[RECORDED_KEY]])
        return recorded[:, chunk.columns]

    def _check_consumed(self, training: bool) -> None:
        for chunk in self.chunks:
            for router in chunk.routers:
                if self.mode is RoutingMode.RECORD:
                    got, expected = (len(router.recorded), 0), (len(chunk.batches), 0)
                else:
                    again = router.sets if training and router.recomputed else 0
                    got, expected = (router.forwards, router.recomputes), (router.sets, again)
                    if training:
                        self._step_counts[0] += router.forward_tokens
                        self._step_counts[1] += router.recomputed_tokens
                if got != expected:
                    raise RoutingReplayError(
                        f"routing replay: MoE layer {router.layer} used {got[0]} forward and {got[1]} "
                        f"recomputed routes where {expected[0]} and {expected[1]} were given "
                        f"({self.mode.value}); every route must be consumed once by its forward and once "
                        "by a recomputation"
                    )

    def _collect(self, data: TrainData) -> list[torch.Tensor]:
        """The routes recorded in this pass, per sample of ``data`` (``RECORDED_KEY``)."""
        out = [
            torch.full((len(tokens), len(self.stage_layers), self.topk), -1, dtype=torch.int32)
            for tokens in data["tokens"]
        ]
        for chunk in self.chunks:
            for step, batch in enumerate(chunk.batches):
                assert batch.token_positions is not None  # batching always sets it
                recorded = torch.stack([router.recorded[step] for router in chunk.routers])
                per_token = collect_routes(batch.token_positions, batch.tokens.shape, recorded, self.shard)
                for index, routes in zip(batch.indices, per_token.split(batch.total_lengths), strict=True):
                    out[index][:, chunk.columns] = routes
        return out

    def step_metrics(self) -> dict[str, float]:
        """The training passes' route counts since the last call, summed over every rank (a collective):
        token rows replayed by forwards, by recomputations, and shared-prompt tokens whose samples'
        routes differ."""
        if not self.enabled:
            return {}
        counts = self._step_counts.to(self.device, copy=True)
        if dist.is_initialized():
            dist.all_reduce(counts)
        self._step_counts.zero_()
        replayed, recomputed, mismatched = counts.cpu().tolist()
        return {
            "routing_replay/replayed_tokens": replayed,
            "routing_replay/recomputed_tokens": recomputed,
            "routing_replay/shared_prompt_route_mismatches": mismatched,
        }
