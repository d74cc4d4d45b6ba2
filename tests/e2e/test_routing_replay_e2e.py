"""Rollout routing replay (R3) through the loop ``train.py`` runs, on a near-tied tiny Qwen3-MoE with
expert parallelism 2: the torch engine returns the experts each token went to, the rollout keeps them
with the log-probs they explain, and the trainer replays them. Measured side by side on the same
checkpoint and prompts: the trainer's log-probs against the engine's without replay (fp32 noise flips
near-tied experts, and a flipped expert changes the token's output) and with it (fp32 noise only);
the trainer's counter says every route of the rollout was replayed."""

from __future__ import annotations

import pytest

from slime.config import parse_args
from tests.support.near_tied_moe import near_tied

EP2 = ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")


@pytest.fixture(scope="module")
def near_tied_moe(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("r3_loop")
    made = make_tiny_model(root / "made", arch="qwen3_moe", tie_word_embeddings=False, num_layers=2)
    return near_tied(made, root / "qwen3_moe", "qwen3_moe")


def run(flags: list[str], num_rollout: int) -> list[dict[str, float]]:
    """The train metrics of each rollout of a run of ``flags`` (train.py's order of events)."""
    from slime.cli import check_implemented
    from slime.config.settings.run import RunSettings
    from slime.ray.loop import RolloutLoop
    from slime.ray.session import TrainingSession

    args = parse_args(flags)
    check_implemented(args)
    seen = []
    with TrainingSession(RunSettings.from_args(args)) as session, RolloutLoop(session) as loop:
        for rollout_id in loop.rollout_ids():
            batch = loop.generate(rollout_id)
            if args.use_rollout_routing_replay:
                routes = batch.data["rollout_routed_experts"]
                assert [r.shape for r in routes] == [(len(t) - 1, 2, 2) for t in batch.data["tokens"]]
            metrics = loop.train(batch)
            seen.append({k: v for k, v in metrics.items() if k.startswith("train/")})
            seen[-1]["tokens"] = float(sum(len(t) for t in batch.data["tokens"]))
            loop.push_weights()
            loop.finish(rollout_id, metrics)
    assert len(seen) == num_rollout
    return seen


@pytest.mark.e2e
def test_r3_replays_the_engines_routes_under_expert_parallelism(ray_cluster, tiny_run_flags, near_tied_moe):
    def flags(*extra: str, num_rollout: int) -> list[str]:
        return tiny_run_flags(
            *EP2, *extra, model_script=None, hf_checkpoint=str(near_tied_moe), actor_num_gpus_per_node=2,
            rollout_num_gpus=1, num_rollout=num_rollout, rollout_temperature="0.7", lr="1e-3",
        )  # fmt: skip

    plain = run(flags(num_rollout=1), 1)
    replayed = run(flags("--use-rollout-routing-replay", num_rollout=2), 2)
    diff = "train/train_rollout_logprob_abs_diff"
    without, with_replay = plain[0][diff], [m[diff] for m in replayed]
    print(f"mean |log-prob(trainer) - log-prob(engine)|: {without:.3g} without replay, {with_replay} with")
    assert without > 1e-4
    assert max(with_replay) < 1e-5
    for metrics in replayed:
        # every token of the rollout replayed once in each of the 2 MoE layers, over both ranks
        assert metrics["train/routing_replay/replayed_tokens"] == 2 * metrics["tokens"]
        assert metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
