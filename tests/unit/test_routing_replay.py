"""MoE routing replay's layout: per-sample routes laid out as ``batching`` lays out tokens, and back."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from slime.backends.megatron.batching import make_micro_batches
from slime.config.errors import ConfigError
from slime.config.validate import _check_routing_replay
from slime.utils.device import import_megatron_core

import_megatron_core()  # what a trainer rank does first

from slime.backends.megatron.routing_replay import (  # noqa: E402  (after megatron-core's import above)
    RoutingReplayError,
    SequenceShard,
    check_rollout_routes,
    collect_routes,
    engine_routes,
    layout_routes,
    moe_layer_indices,
)

LAYERS, TOPK = 3, 2
CPU = torch.device("cpu")


def _data(prompts: list[list[int]], responses: list[list[int]]) -> dict:
    tokens = [p + r for p, r in zip(prompts, responses, strict=True)]
    return {
        "tokens": tokens,
        "response_lengths": [len(r) for r in responses],
        "loss_masks": [[1] * len(r) for r in responses],
        "loss_weights": [1.0] * len(tokens),
    }


def _routes(data: dict) -> torch.Tensor:
    """Per token of every sample a route naming it: ``[k * 1000 + t * 10 + layer, ... + 1]``."""
    rows = []
    for k, seq in enumerate(data["tokens"]):
        t = torch.arange(len(seq))[:, None, None]
        layer = torch.arange(LAYERS)[None, :, None]
        rows.append(k * 1000 + t * 10 + layer + torch.arange(TOPK)[None, None, :] * 10_000)
    return torch.cat(rows)


def _expected(batch, routes: torch.Tensor) -> torch.Tensor:
    """What the routers must see, written token by token: sample token ``(row, column)`` at
    ``column * b + row`` (a position shared by several, the first one's), experts 0 .. k-1 elsewhere."""
    b, s = batch.tokens.shape
    out = torch.arange(TOPK).expand(s * b, LAYERS, TOPK).clone()
    seen = set()
    for i, (row, column) in enumerate(batch.token_positions.tolist()):
        if column * b + row not in seen:
            seen.add(column * b + row)
            out[column * b + row] = routes[i]
    return out.transpose(0, 1)


PROMPTS = [[5, 6, 7], [8, 9], [5, 6, 7]]
RESPONSES = [[10, 11], [12, 13, 14], [15]]


@pytest.mark.parametrize("packed", [True, False])
def test_routes_follow_the_tokens_in_packed_and_padded_micro_batches(packed):
    data = _data(PROMPTS, RESPONSES)
    (batch,) = make_micro_batches(data, [[0, 1, 2]], CPU, packed=packed, pad_to_multiple=4)
    routes = _routes(data)
    laid, mismatches = layout_routes(batch.token_positions, batch.tokens.shape, routes)
    b, s = batch.tokens.shape
    assert laid.shape == (LAYERS, b * s, TOPK) and mismatches == 0
    assert torch.equal(laid, _expected(batch, routes))
    # Every token of every sample lies where its own token id is: the positions are the batch's.
    flat = batch.tokens.T.reshape(-1)  # the routers' order: [s, b] flattened
    ids = torch.tensor([t for seq in data["tokens"] for t in seq])
    rows, columns = batch.token_positions.unbind(1)
    assert torch.equal(flat[columns * b + rows], ids)
    if packed:  # the pad segment (16 tokens padded from 14) routes to experts 0 and 1
        assert s == 16 and torch.equal(laid[:, 14:], torch.arange(TOPK).expand(LAYERS, 2, TOPK))


def test_a_shared_prompt_replays_the_first_samples_routes_and_counts_the_others_that_differ():
    data = _data(PROMPTS, RESPONSES)
    (batch,) = make_micro_batches(data, [[0, 1, 2]], CPU, packed=True, share_prompts=True)
    assert batch.tokens.shape[1] == 3 + 2 + 1 + 2 + 3  # samples 0 and 2 share [5, 6, 7]
    routes = _routes(data)
    offsets = [0, 5, 10]
    for t in range(3):  # the engine routed the shared prompt alike for both samples...
        routes[offsets[2] + t] = routes[offsets[0] + t]
    laid, mismatches = layout_routes(batch.token_positions, batch.tokens.shape, routes)
    assert mismatches == 0 and torch.equal(laid[:, :3], routes[:3].transpose(0, 1))
    routes[offsets[2] + 1, 2, 0] += 1  # ...but for one token of one layer
    laid, mismatches = layout_routes(batch.token_positions, batch.tokens.shape, routes)
    assert mismatches == 1 and torch.equal(laid[:, :3], routes[:3].transpose(0, 1))
    # Sample 2's response follows sample 0's in the shared segment and keeps its own routes.
    assert torch.equal(laid[:, 5], routes[offsets[2] + 3])


def test_sequence_parallel_ranks_take_contiguous_slices_of_the_routers_order():
    even = _data([[5, 6, 7], [8, 9]], [[10, 11, 12], [13, 14]])  # padded to 6 columns: 3 per rank
    for data, packed in ((_data(PROMPTS, RESPONSES), True), (even, False)):
        (batch,) = make_micro_batches(
            data, [list(range(len(data["tokens"])))], CPU, packed=packed, pad_to_multiple=2
        )
        shape, routes = batch.tokens.shape, _routes(data)
        whole, _ = layout_routes(batch.token_positions, shape, routes)
        shards = [layout_routes(batch.token_positions, shape, routes, SequenceShard(r, 2))[0] for r in (0, 1)]
        assert torch.equal(torch.cat(shards, dim=1), whole)
    data = _data(PROMPTS, RESPONSES)
    (batch,) = make_micro_batches(data, [[0, 1, 2]], CPU, packed=True, pad_to_multiple=1)
    with pytest.raises(RoutingReplayError, match="14 positions does not split over 3"):
        layout_routes(batch.token_positions, batch.tokens.shape, _routes(data), SequenceShard(0, 3))


@pytest.mark.parametrize("share", [False, True])
def test_recorded_routes_go_back_to_every_sample_token_and_replay_identically(share):
    data = _data(PROMPTS, RESPONSES)
    (batch,) = make_micro_batches(data, [[0, 1, 2]], CPU, packed=True, pad_to_multiple=2, share_prompts=share)
    shape = batch.tokens.shape
    routed = torch.randint(0, 8, (LAYERS, shape[0] * shape[1], TOPK))  # what the routers picked
    back = collect_routes(batch.token_positions, shape, routed)
    assert back.dtype == torch.int32 and back.shape == (sum(map(len, data["tokens"])), LAYERS, TOPK)
    if share:  # both samples of the shared prompt got its routes
        assert torch.equal(back[10:13], back[0:3])
    laid, mismatches = layout_routes(batch.token_positions, shape, back.long())
    real = batch.token_positions[:, 1].unique()
    assert mismatches == 0 and torch.equal(laid[:, real], routed[:, real])
    # Under sequence parallelism each rank gets back its own tokens, -1 for the other rank's.
    halves = [
        collect_routes(batch.token_positions, shape, routed[:, r * shape[1] // 2 : (r + 1) * shape[1] // 2],
                       SequenceShard(r, 2))
        for r in (0, 1)
    ]  # fmt: skip
    assert torch.equal(torch.maximum(*halves), back) and ((halves[0] < 0) != (halves[1] < 0)).all()


def test_engine_routes_keep_the_moe_layers_and_pad_the_last_token():
    engine = np.arange(4 * 5 * 2, dtype=np.int32).reshape(4, 5, 2)  # 5 tokens, 5 HF layers, top-2
    routes = engine_routes(engine, [1, 3])
    assert routes.shape == (5, 2, 2)
    assert torch.equal(routes[:4], torch.from_numpy(engine[:, [1, 3]]))
    assert routes[4].tolist() == [[0, 1], [0, 1]]


def test_moe_layers_of_a_layer_pattern():
    assert moe_layer_indices(4, 1) == [0, 1, 2, 3]
    assert moe_layer_indices(4, 2) == [0, 2]
    assert moe_layer_indices(3, [0, 1, 1]) == [1, 2]  # DeepSeek-V3's first dense layer


def test_engine_routes_are_checked_against_the_model_naming_the_sample_and_layer():
    data = _data([[1, 2, 3]], [[4, 5]])
    data["positions"] = [7]
    good = np.tile(np.array([0, 3], dtype=np.int32), (4, 3, 1))  # layers 0 (dense) .. 2
    good[:, 0] = 0
    check_rollout_routes({**data, "rollout_routed_experts": [good]}, 3, [1, 2], 2, 4)
    cases = [
        (good[:, :2], r"sample 7 .*shape \(4, 2, 2\), expected .* = \(4, 3, 2\)"),
        (good[:3], r"shape \(3, 3, 2\)"),
        (good + 1, "expert 4; --num-experts is 4"),
        (np.concatenate([good[:, :2], np.zeros((4, 1, 2), np.int32)], 1), "MoE layer 2 has all-zero routes"),
    ]
    for routes, message in cases:
        with pytest.raises(RoutingReplayError, match=message):
            check_rollout_routes({**data, "rollout_routed_experts": [routes]}, 3, [1, 2], 2, 4)
    with pytest.raises(RoutingReplayError, match="no 'rollout_routed_experts'"):
        check_rollout_routes(data, 3, [1, 2], 2, 4)


def _replay_args(**changes) -> argparse.Namespace:
    base = dict(
        use_rollout_routing_replay=False, use_routing_replay=True, num_experts=4,
        moe_router_load_balancing_type="aux_loss", loss_type="policy_loss", use_rollout_logprobs=False,
        rollout_external_engine_addrs=None,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **changes})


@pytest.mark.parametrize(
    ("changes", "flag", "needle"),
    [
        (dict(num_experts=None), "--use-routing-replay", "no experts"),
        (
            dict(use_rollout_routing_replay=True, num_experts=None),
            "--use-rollout-routing-replay",
            "no experts",
        ),
        (dict(moe_router_load_balancing_type="sinkhorn"), "--use-routing-replay", "sinkhorn"),
        (dict(loss_type="sft_loss"), "--use-routing-replay", "--loss-type sft_loss"),
        (dict(use_rollout_logprobs=True), "--use-routing-replay", "--use-rollout-logprobs skips"),
    ],
)
def test_routing_replay_flags_are_refused_where_they_cannot_work(changes, flag, needle):
    with pytest.raises(ConfigError) as error:
        _check_routing_replay(_replay_args(**changes))
    assert error.value.flag == flag and needle in str(error.value)
    # R3 replays the engine's routes, which need no old-log-prob pass.
    _check_routing_replay(_replay_args(use_rollout_routing_replay=True, use_rollout_logprobs=True))


def _route(replay, logits: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's own top-k routing, asking ``replay`` for the experts."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(logits, 2, router_replay=replay, **kwargs)


@pytest.mark.parametrize(
    "routing",
    [
        dict(score_function="softmax"),
        dict(score_function="softmax", use_pre_softmax=True),
        dict(score_function="sigmoid", expert_bias=torch.tensor([5.0, 0.0, 0.0, 0.0]), scaling_factor=2.5),
    ],
)
def test_replayed_experts_are_weighted_by_the_live_router_logits_which_get_gradients(routing):
    """The replayed experts replace the choice only: their weights come from the live logits as the
    score function weights the experts it picks (with DeepSeek-V3's expert bias, which only chooses,
    from the unbiased sigmoid), so the router logits get a gradient through them."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from slime.backends.megatron.routing_replay import LayerReplay

    before = len(RouterReplay.global_router_replay_instances)
    logits = torch.tensor([[0.1, 2.0, 1.0, -1.0], [3.0, 0.5, 0.4, 0.3]], requires_grad=True)
    replay = LayerReplay(layer=1, recomputed=True)
    assert len(RouterReplay.global_router_replay_instances) == before  # owned by the trainer alone
    given = torch.tensor([[2, 3], [1, 2]])
    replay.set_target_indices(given)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, routing_map = _route(replay, logits, **routing)
    assert torch.equal(routing_map, torch.zeros(2, 4, dtype=torch.bool).scatter(1, given, True))
    # Their weights, from the live logits: as each score function weights the experts it picks.
    picked = logits.detach().gather(1, given)
    if routing.get("use_pre_softmax"):
        weights = logits.detach().softmax(-1).gather(1, given)
    elif routing["score_function"] == "softmax":
        weights = picked.softmax(-1)
    else:
        weights = picked.sigmoid() / picked.sigmoid().sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(probs.gather(1, given), weights)
    probs.pow(2).sum().backward()
    assert logits.grad is not None and (logits.grad[routing_map] != 0).all()
    # A recomputation gets the forward's experts back; one more than the forwards is an error.
    replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    _, again = _route(replay, logits.detach(), **routing)
    assert torch.equal(again, routing_map) and (replay.forwards, replay.recomputes) == (1, 1)
    with pytest.raises(RoutingReplayError, match="layer 1 was recomputed more often"):
        _route(replay, logits.detach(), **routing)


def test_replayed_routes_must_cover_the_routers_tokens():
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from slime.backends.megatron.routing_replay import LayerReplay

    replay = LayerReplay(layer=3, recomputed=False)
    replay.set_target_indices(torch.tensor([[0, 1]]))
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(
        RoutingReplayError, match=r"layer 3 routes 2 tokens to 2 experts but was given \[1, 2\]"
    ):
        _route(replay, torch.zeros(2, 4))


def test_r2_keeps_the_old_logprob_pass_that_records_the_routes():
    from slime.backends.megatron.loss import old_log_probs_are_current
    from tests.support.trainers import bare_settings

    skip = dict(loss_type="policy_loss", num_steps_per_rollout=1, advantage_estimator="grpo")
    assert old_log_probs_are_current(bare_settings(**skip))
    assert old_log_probs_are_current(bare_settings(**skip, use_rollout_routing_replay=True))
    assert not old_log_probs_are_current(bare_settings(**skip, use_routing_replay=True))
