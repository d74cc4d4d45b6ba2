"""MoE routing replay on the Megatron trainer (real megatron-core on gloo ranks, one process each).

The engine's computation is transformers' forward of the same checkpoint: its routers' top-k (read
with hooks) are the routes an engine reports. The tiny Qwen3-MoE and DeepSeek-V3 checkpoints are
made near-tied (``near_tied``): two experts (Qwen3) or two expert groups (DeepSeek-V3, whose
group-limited routing then takes both experts of one group) score alike up to fp32 rounding, so the
noise between transformers' forward and Megatron's flips the choice for some tokens. Without
replay those tokens (and every later token of their sequence) get other log-probs; with the engine's
routes replayed, the trainer computes what the engine computed, to fp32 noise.

One single-rank process per model runs, in order: the gate (log-probs without and with replay, and
Megatron's own routes against the engine's), an R3 training step under full recomputation (each
route consumed twice, the router's gradient non-zero), a checkpoint saved and loaded into a second
trainer built in the same process (megatron's process-wide ``RouterReplay`` list stays empty), and on
that trainer R2 (``--use-routing-replay``): the old-log-prob forward records, and the training forward
routes exactly as recorded although the router was moved in between. A two-rank process pair runs
expert parallelism 2, tensor parallelism 2 and two pipeline stages, with the engine's routes replayed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.gloo_ranks import run_gloo_ranks
from tests.support.near_tied_moe import near_tied

pytestmark = pytest.mark.e2e

MODULE = "tests.e2e.test_routing_replay_megatron"
ARCHS = ("qwen3_moe", "deepseek_v3")
R3 = "--use-rollout-routing-replay"
RECOMPUTE = [
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
]  # fmt: skip
GRPO = ["--n-samples-per-prompt", "4", "--rollout-batch-size", "2"]
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
PP2 = ["--pipeline-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


def probe_data(num_samples: int = 6) -> dict[str, list]:
    """Whole sequences scored (every token after the first is a response token)."""
    generator = torch.Generator().manual_seed(3)
    tokens = [torch.randint(3, 99, (20 + 3 * i,), generator=generator).tolist() for i in range(num_samples)]
    return {
        "tokens": tokens,
        "response_lengths": [len(t) - 1 for t in tokens],
        "loss_masks": [[1] * (len(t) - 1) for t in tokens],
        "loss_weights": [1.0 / num_samples] * num_samples,
    }


def engine_forward(model_dir: Path, data: dict) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """transformers' routes (``[len - 1, layers, topk]`` int32, dense layers 0) and log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    captured: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(lambda _m, _i, out, index=index: captured.__setitem__(index, out[2]))
    routes, log_probs = [], []
    with torch.no_grad():
        for tokens in data["tokens"]:
            captured.clear()
            logits = model(torch.tensor([tokens])).logits[0]
            per_token = np.zeros(
                (len(tokens), config.num_hidden_layers, config.num_experts_per_tok), np.int32
            )
            for index, chosen in captured.items():
                per_token[:, index] = chosen.numpy()
            routes.append(per_token[:-1])
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
            log_probs.append(logp)
    return routes, log_probs


# ---- the ranks' side --------------------------------------------------------------------------------


def _trainer(model_dir: Path, rank: int, world: int, port: int, extra: list[str], **changes: Any):
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.config.settings.trainer import TrainerSettings
    from tests.support.trainers import trainer_args, with_fields

    args = trainer_args(model_dir, world=world, model_flags=[], extra=extra)
    settings = with_fields(TrainerSettings.from_args(args), **changes)
    return MegatronTrainer(settings, args, rank, world, "127.0.0.1", port), args


def _sorted_routes(routes: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(routes)).sort(-1).values


def _routers(trainer: Any) -> list[Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in trainer.model for m in chunk.modules() if isinstance(m, TopKRouter)]


def _gate(trainer: Any, data: dict, routes: list[np.ndarray]) -> dict[str, Any]:
    """Log-probs without and with the engine's routes, and how many token routes Megatron picks otherwise."""
    from slime.backends.megatron.routing_replay import RECORDED_KEY, RoutingMode, moe_layer_indices

    replayed = trainer.compute_log_probs({**data, "rollout_routed_experts": routes})
    own = dict(data)
    plain = trainer._response_forward(own, RoutingMode.RECORD)  # its own routes, recorded
    model = trainer.settings.model
    moe = moe_layer_indices(model.num_layers, model.moe_layer_freq)
    flipped = 0
    for engine, recorded in zip(routes, own[RECORDED_KEY], strict=True):
        ours = _sorted_routes(recorded)[:-1]  # the last token: the engine never forwards it
        flipped += int((ours != _sorted_routes(engine)[:, moe]).any(-1).sum())
    return {"plain": plain, "replayed": replayed, "flipped_routes": flipped}


def _recompute_step(trainer: Any, args: Any, data: dict, routes: list[np.ndarray]) -> dict[str, Any]:
    """An R3 SFT step with every layer recomputed: the counts and the routers' gradients."""
    from slime.backends.megatron.policy_inputs import DataParallel, PolicyInputs

    inputs = PolicyInputs(trainer.settings, DataParallel.of_megatron(trainer.device), args)
    shard = inputs.shards({**data, "rollout_routed_experts": routes})[0]
    tokens_routed = sum(b.tokens.numel() for b in trainer._micro_batches(shard))
    metrics = trainer.train_step(shard)
    grads = [router.weight.main_grad.abs().sum().item() for router in _routers(trainer)]
    return {"metrics": metrics, "tokens_routed": tokens_routed, "router_grads": grads}


def _r2_step(trainer: Any, args: Any) -> dict[str, Any]:
    """R2 on a GRPO rollout: the routes the training forward takes are the recorded ones, although the
    router moved after the old-log-prob forward (which would otherwise change some)."""
    from slime.backends.megatron.policy_inputs import DataParallel, PolicyInputs
    from slime.backends.megatron.routing_replay import RECORDED_KEY, RoutingMode, layout_routes
    from tests.support.trainers import sft_data

    data = sft_data(8)
    data["rewards"] = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    inputs = PolicyInputs(trainer.settings, DataParallel.of_megatron(trainer.device), args)
    shards = inputs.shards(data)
    trainer.add_policy_inputs(shards)
    (shard,) = shards
    recorded = shard[RECORDED_KEY]
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for router in _routers(trainer):
            router.weight.add_(0.05 * torch.randn(router.weight.shape, generator=generator))
    moved = dict(shard)
    trainer._response_forward(moved, RoutingMode.RECORD)
    changed = sum(int((a != b).any(-1).sum()) for a, b in zip(recorded, moved[RECORDED_KEY], strict=True))
    maps: list[torch.Tensor] = []
    hooks = [
        r.register_forward_hook(lambda _m, _i, out: maps.append(out[1].clone())) for r in _routers(trainer)
    ]
    metrics = trainer.train_step(shard)
    for hook in hooks:
        hook.remove()
    expected = []
    for batch in trainer._micro_batches(shard):  # per micro-batch, per layer: the recorded routes laid out
        per_sample = torch.cat([torch.as_tensor(recorded[i]) for i in batch.indices]).long()
        laid, _ = layout_routes(batch.token_positions, batch.tokens.shape, per_sample)
        for layer_routes in laid:
            routing_map = torch.zeros(len(layer_routes), trainer.settings.model.num_experts, dtype=torch.bool)
            expected.append(routing_map.scatter(1, layer_routes, True))
    return {
        "changed_by_moving": changed,
        "maps_equal": len(maps) == len(expected)
        and all(torch.equal(a, b) for a, b in zip(maps, expected, strict=False)),
        "forward_maps": len(maps),
        "metrics": metrics,
    }


def run_single(model_dir: Path, out_dir: Path, port: int) -> dict[str, Any]:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    case = torch.load(out_dir.parent / "case.pt", weights_only=False)
    data, routes = case["data"], case["routes"]
    trainer, args = _trainer(model_dir, 0, 1, port, [R3, *RECOMPUTE])
    out: dict[str, Any] = _gate(trainer, data, routes)
    out["step"] = _recompute_step(trainer, args, data, routes)
    out["after_step"] = trainer._response_forward(dict(data))
    trainer.save(str(out_dir / "ckpt"), 0)
    trainer.close()
    # The same process builds the model again, now with R2 on a policy loss, and resumes the checkpoint.
    resumed, args = _trainer(
        model_dir, 0, 1, port + 1, [R3, *GRPO], use_rollout_routing_replay=False, use_routing_replay=True,
        loss_type="policy_loss",
    )  # fmt: skip
    out["global_instances"] = len(RouterReplay.global_router_replay_instances)
    out["loaded_rollout"] = resumed.load(str(out_dir / "ckpt"))
    out["resumed"] = resumed._response_forward(dict(data))
    out["r2"] = _r2_step(resumed, args)
    resumed.close()
    return out


def run_parallel(model_dir: Path, out_dir: Path, rank: int, world: int, port: int) -> dict[str, Any]:
    """The engine's routes replayed at EP=2 (each rank its data-parallel half), TP=2 (forward only:
    training MoE under TP needs sequence parallelism, which needs Transformer Engine) and PP=2; EP=2
    trains a step, and PP=2 one with every layer recomputed (1F1B)."""
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron.policy_inputs import step_shard

    case = torch.load(out_dir.parent / "case.pt", weights_only=False)
    data = {**case["data"], "rollout_routed_experts": case["routes"]}
    out: dict[str, Any] = {}
    # Not recomputed: megatron's all-to-all allocates on the GPU inside a recomputation's backward,
    # where slime's CPU device redirect does not reach (EP > 1 with full recomputation is GPU only).
    trainer, args = _trainer(model_dir, rank, world, port, [R3, *EP2])
    dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    out["ep2"] = (dp, trainer.compute_log_probs(step_shard(data, 0, 1, *dp)))
    out["ep2_step"] = _recompute_step(trainer, args, case["data"], case["routes"])
    trainer.close()
    trainer, _ = _trainer(
        model_dir, rank, world, port + 1, [R3], tensor_model_parallel_size=2, expert_tensor_parallel_size=2
    )
    out["tp2"] = trainer.compute_log_probs(data)
    trainer.close()
    trainer, args = _trainer(model_dir, rank, world, port + 2, [R3, *PP2, *RECOMPUTE])
    out["pp2"] = trainer.compute_log_probs(data)  # each stage replays its own layers' routes
    out["pp2_step"] = _recompute_step(trainer, args, case["data"], case["routes"])
    trainer.close()
    return out


def main(mode: str, model_dir: Path, out_dir: Path, rank: int, world: int, port: int) -> None:
    from slime.utils.device import import_megatron_core

    import_megatron_core()
    if mode == "single":
        results = run_single(model_dir, out_dir, port)
    else:
        results = run_parallel(model_dir, out_dir, rank, world, port)
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("SLIME_FORCE_CPU", "1")
    mode, model, out, rank, world, port = sys.argv[1:7]
    main(mode, Path(model), Path(out), int(rank), int(world), int(port))


# ---- the tests ----------------------------------------------------------------------------------------


def _max_diff(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per architecture: the near-tied checkpoint, the probe data and the engine's routes and log-probs."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("routing_replay")
    out = {}
    for arch in ARCHS:
        # DeepSeek-V3's first layer is dense, and one dense layer computes bit for bit as transformers
        # does: its second MoE layer is the first whose input carries fp32 noise (the experts' sums).
        layers = 4 if arch == "deepseek_v3" else 2  # and two pipeline stages of two layers each
        made = make_tiny_model(root / "made" / arch, arch=arch, tie_word_embeddings=False, num_layers=layers)
        model = near_tied(made, root / arch, arch)
        data = probe_data()
        routes, log_probs = engine_forward(model, data)
        work = root / f"{arch}-run"
        work.mkdir()
        torch.save({"data": data, "routes": routes}, work / "case.pt")
        out[arch] = {"model": model, "work": work, "data": data, "routes": routes, "engine": log_probs}
    return out


@pytest.fixture(scope="module", params=ARCHS)
def single(request: pytest.FixtureRequest, cases: dict[str, dict[str, Any]]) -> tuple[dict, dict]:
    case = cases[request.param]
    (result,) = run_gloo_ranks(MODULE, ["single", str(case["model"])], case["work"] / "single", 1)
    return case, result


def test_replaying_the_engines_routes_removes_the_flipped_experts(single):
    case, result = single
    without = _max_diff(result["plain"], case["engine"])
    replayed = _max_diff(result["replayed"], case["engine"])
    print(
        f"{case['model'].name}: {result['flipped_routes']} token routes flipped by fp32 noise; "
        f"max |log-prob(Megatron) - log-prob(engine)| {without:.3g} without replay, {replayed:.3g} with"
    )
    assert result["flipped_routes"] > 0
    assert without > 1e-3
    assert replayed < 1e-5


def test_full_recomputation_consumes_every_route_twice_and_the_router_trains(single):
    _, result = single
    step = result["step"]
    metrics, moe_layers = step["metrics"], len(step["router_grads"])
    assert moe_layers > 0
    assert metrics["routing_replay/replayed_tokens"] == step["tokens_routed"] * moe_layers
    assert metrics["routing_replay/recomputed_tokens"] == step["tokens_routed"] * moe_layers
    assert metrics["routing_replay/shared_prompt_route_mismatches"] == 0
    assert all(grad > 0 for grad in step["router_grads"]), step["router_grads"]


def test_a_rebuilt_trainer_resumes_with_replay_and_leaves_no_global_router_replays(single):
    _, result = single
    assert result["global_instances"] == 0 and result["loaded_rollout"] == 0
    assert _max_diff(result["resumed"], result["after_step"]) == 0.0


def test_r2_training_forward_routes_exactly_as_the_old_logprob_forward_recorded(single):
    _, result = single
    r2 = result["r2"]
    assert r2["changed_by_moving"] > 0  # the moved router alone would route some tokens elsewhere
    assert r2["forward_maps"] > 0 and r2["maps_equal"]
    assert r2["metrics"]["routing_replay/replayed_tokens"] > 0
    assert r2["metrics"]["ppo_kl"] != 0.0  # the weights did move: the replay kept the routes only


def test_expert_tensor_and_pipeline_parallel_replay_equal_one_rank(single):
    case, result = single
    ranks = run_gloo_ranks(MODULE, ["parallel", str(case["model"])], case["work"] / "parallel", 2)
    halves = sorted(rank["ep2"] for rank in ranks)
    assert [dp for dp, _ in halves] == [(0, 2), (1, 2)]
    ep2 = [log_prob for _, part in halves for log_prob in part]
    tp2, pp2 = ranks[0]["tp2"], ranks[1]["pp2"]
    assert ranks[0]["pp2"] is None  # the first stage has no log-probs
    diffs = {
        name: _max_diff(ours, result["replayed"])
        for name, ours in (("EP=2", ep2), ("TP=2", tp2), ("PP=2", pp2))
    }
    print(f"{case['model'].name}: replayed log-probs vs one rank: {diffs}")
    assert all(diff < 1e-5 for diff in diffs.values()), diffs
    assert _max_diff(tp2, case["engine"]) < 1e-5 and _max_diff(pp2, case["engine"]) < 1e-5
    for layout, times in (("ep2_step", 1), ("pp2_step", 2)):  # every rank's routes, summed over ranks
        steps = [rank[layout] for rank in ranks]
        routed = sum(step["tokens_routed"] * len(step["router_grads"]) for step in steps)
        for step in steps:
            counts = [step["metrics"][f"routing_replay/{k}_tokens"] for k in ("replayed", "recomputed")]
            assert counts == [routed, routed * (times - 1)], (layout, counts, routed)
            assert all(grad > 0 for grad in step["router_grads"]), layout
