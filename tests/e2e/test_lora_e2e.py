"""LoRA RL through the loop ``train.py`` runs: the trainer trains rank-8 adapters on the frozen tiny
model, every push sends the adapter alone (unload, then load from tensors when colocated or from an
HF PEFT directory otherwise), and every ``/generate`` names it. Invariants as for full fine-tuning:
step 0 on policy, the engine's log-probs those of the trainer, and after each push the engine's adapter
tensors equal to the trainer's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime.config import parse_args
from tests.support.plugins import __file__ as _plugins_init

PLUGINS = Path(_plugins_init).parent


@pytest.mark.e2e
@pytest.mark.parametrize("colocate", [False, True], ids=["distributed", "colocate"])
def test_grpo_with_lora_pushes_only_the_adapter_and_stays_on_policy(ray_cluster, tiny_run_flags, colocate):
    import ray

    from slime.cli import check_implemented
    from slime.config.settings.run import RunSettings
    from slime.ray.loop import RolloutLoop
    from slime.ray.session import TrainingSession
    from slime.utils.http import post_json_sync

    extra = ("--colocate",) if colocate else ()
    flags = tiny_run_flags(
        *extra, "--lora-rank", "8", "--lora-alpha", "16", "--check-weight-update-equal",
        actor_num_gpus_per_node=2, rollout_num_gpus=2, num_rollout=3, lr="1e-2",
        rollout_temperature="0.7", rm_type=None,
        custom_rm_path=f"{PLUGINS / 'length_reward.py'}:first_character_reward",
    )  # fmt: skip
    args = parse_args(flags)
    check_implemented(args)
    with TrainingSession(RunSettings.from_args(args)) as session, RolloutLoop(session) as loop:
        full_bytes = sum(t.numel() * t.element_size() for t in session.trainer.hf_state_dict().values())
        for rollout_id in loop.rollout_ids():  # train.py's order of events
            batch = loop.generate(rollout_id)
            session.hand_gpus_to_trainer()
            metrics = loop.train(batch)
            if rollout_id == 0:
                print({key: value for key, value in metrics.items() if key.startswith("train/")})
                assert metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
                assert metrics["train/train_rollout_logprob_abs_diff"] <= 1e-5
                assert metrics["train/grad_norm"] > 0
            pushed = session.push_weights(loop.version)  # what loop.push_weights does, with its metrics
            adapter = session.trainer.lora_state_dict()
            session.hand_gpus_to_engines()
            adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
            assert pushed["update_weights_bytes"] == adapter_bytes < 0.5 * full_bytes
            assert any(name.endswith("lora_B.weight") and t.abs().sum() > 0 for name, t in adapter.items())
            for url in ray.get(session.rollout.engine_urls.remote()):
                for name, tensor in adapter.items():
                    body = {"lora_name": "slime_lora", "name": name, "truncate_size": tensor.numel()}
                    values = post_json_sync(f"{url}/get_lora_weights_by_name", body)
                    assert torch.equal(torch.tensor(values).flatten(), tensor.flatten().float()), (url, name)
            loop.finish(rollout_id, metrics)
