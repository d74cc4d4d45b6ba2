"""Vision-language GRPO through the loop ``train.py`` runs: the tiny Qwen2.5-VL, images read by
``--multimodal-keys``, processed once on the rollout side, expanded by the engine, trained by the
megatron-core policy with its Transformers vision tower, and the whole model pushed back.

The invariants are those of every text run: step 0 is on policy (``ppo_kl`` 0, the trainer's
log-probs of the engine's tokens on the same images equal the engine's), and after each push every
engine tensor, vision tower included, equals the trainer's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime.config import parse_args
from tests.support.plugins import __file__ as _plugins_init

PLUGINS = Path(_plugins_init).parent
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "black": (0, 0, 0)}


@pytest.fixture(scope="module")
def vlm_task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny VLM and four prompts, each a coloured square (56x56: four image tokens) and a question;
    the second's picture is a truncated PNG (it exists, so the reader takes it; it cannot be decoded)."""
    from PIL import Image, ImageDraw

    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("vlm")
    model = make_tiny_model(root / "model", arch="qwen2_5_vl")
    (root / "images").mkdir()
    rows = []
    for name, rgb in COLOURS.items():
        image = Image.new("RGB", (56, 56), "white")
        ImageDraw.Draw(image).rectangle([14, 14, 41, 41], fill=rgb)
        image.save(root / "images" / f"{name}.png")
        rows.append({"input": "<image>colour?", "images": [f"images/{name}.png"], "label": name})
    green = root / "images" / "green.png"
    green.write_bytes(green.read_bytes()[:40])
    prompts = root / "train.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model, prompts


def _flags(tiny_run_flags, vlm_task: tuple[Path, Path], *extra: str, **overrides: object) -> list[str]:
    model, prompts = vlm_task
    return tiny_run_flags(
        *extra, model_script="tiny-qwen2.5-vl.sh", hf_checkpoint=model, prompt_data=prompts,
        multimodal_keys='{"image": "images"}', rollout_temperature="0.7", rm_type=None,
        custom_rm_path=f"{PLUGINS / 'length_reward.py'}:first_character_reward",
        update_weight_buffer_size=64 * 1024, **overrides,
    )  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["distributed", "tensor", "disk"])
def test_grpo_on_the_tiny_vlm_is_on_policy_and_the_vision_tower_reaches_every_engine(
    ray_cluster, tiny_run_flags, vlm_task, transport, tmp_path
):
    """Two rollouts over the default transport and colocated (tensor); one over disk snapshots."""
    import ray

    from slime.cli import check_implemented
    from slime.config.settings.run import RunSettings
    from slime.ray.loop import RolloutLoop
    from slime.ray.session import TrainingSession
    from slime.utils.http import post_json_sync
    from tests.support.engines import engine_weights_equal

    extra = {
        "distributed": ("--check-weight-update-equal",),
        "tensor": ("--colocate",),
        "disk": (
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(tmp_path / "snapshots"),
        ),
    }[transport]
    num_rollout = 1 if transport == "disk" else 2
    flags = _flags(
        tiny_run_flags,
        vlm_task,
        *extra,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=2,
        num_rollout=num_rollout,
    )
    args = parse_args(flags)
    check_implemented(args)
    assert args.update_weight_transport == transport
    with TrainingSession(RunSettings.from_args(args)) as session:
        if transport == "distributed":  # --check-weight-update-equal: noise until the first push
            from safetensors.torch import load_file

            name = "visual.merger.mlp.2.bias"
            loaded = load_file(vlm_task[0] / "model.safetensors")[name]
            url = ray.get(session.rollout.engine_urls.remote())[0]
            noisy = post_json_sync(
                f"{url}/get_weights_by_name", {"name": name, "truncate_size": loaded.numel()}
            )
            assert not torch.equal(torch.tensor(noisy).flatten(), loaded.flatten())
        with RolloutLoop(session) as loop:  # start: the first push, then the check that it restored all
            for rollout_id in loop.rollout_ids():  # train.py's order of events
                batch = loop.generate(rollout_id)
                images, valid = batch.data["multimodal_train_inputs"], batch.data["valid_rewards"]
                # The broken picture's group failed (no image, nothing trained); the run went on.
                assert valid == [True, True, False, False, True, True, True, True]
                assert [item is None for item in images] == [not v for v in valid]
                assert all(
                    item["image_grid_thw"].tolist() == [[1, 4, 4]] for item in images if item is not None
                )
                assert batch.data["loss_masks"][2] == [0] * len(batch.data["loss_masks"][2])
                session.hand_gpus_to_trainer()
                metrics = loop.train(batch)
                if rollout_id == 0:
                    print({key: value for key, value in metrics.items() if key.startswith("train/")})
                    assert metrics["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
                    assert metrics["train/train_rollout_logprob_abs_diff"] <= 1e-4
                    assert metrics["train/grad_norm"] > 0
                loop.push_weights()
                expected = session.trainer.hf_state_dict()
                session.hand_gpus_to_engines()
                assert any(name.startswith("visual.") for name in expected)
                for url in ray.get(session.rollout.engine_urls.remote()):
                    engine_weights_equal(url, expected)
                loop.finish(rollout_id, metrics)
