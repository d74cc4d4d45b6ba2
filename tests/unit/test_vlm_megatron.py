"""The megatron-core Qwen2.5-VL policy on the tiny VLM (one gloo rank, on the CPU): its flags come from
config.json, its weights convert to and from the HF checkpoint bit for bit (vision tower included),
its logits are transformers' (alone and packed), ``--freeze-vision-tower`` trains the language model
only, and ``--save-hf`` writes a checkpoint transformers loads with the same logits.

The model runs in one subprocess for the module (``tests.support.vlm_megatron``: the CPU trainer setup
patches ``torch.cuda`` process-wide); each test checks one part of what it recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.models import model_args
from tests.support.trainers import trainer_args
from tests.support.vlm_megatron import run_ranks, tiny_vlm

TOL = 1e-5  # fp32, the same maths in another order


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_vlm(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def run(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(vlm, tmp_path_factory.mktemp("vlm_run"), world=1)[0]


def test_the_tiny_script_is_what_config_json_says(vlm: Path) -> None:
    from slime.config.settings.trainer import TrainerSettings

    scripted = TrainerSettings.from_args(trainer_args(vlm, model_flags=model_args("tiny-qwen2.5-vl.sh")))
    derived = TrainerSettings.from_args(trainer_args(vlm, model_flags=[]))
    assert scripted.model == derived.model
    assert derived.model.position_embedding_type == "mrope"
    assert derived.model.mrope_section == [4, 6, 6]
    assert derived.model.add_qkv_bias and derived.model.swiglu and not derived.model.freeze_vision_tower


@pytest.mark.parametrize(
    ("flags", "extra", "flag"),
    [
        ("tiny-qwen2.5-vl.sh", ["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),
        ("tiny-qwen2.5-vl.sh", ["--mrope-section", "4", "4", "8"], "--mrope-section"),
        ("tiny-qwen2.sh", [], "--position-embedding-type"),
    ],
)
def test_layouts_and_flags_it_refuses(
    vlm: Path, flags: str, extra: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        trainer_args(vlm, world=2, extra=extra, model_flags=model_args(flags))
    assert capsys.readouterr().err.startswith(f"error: {flag}: ")


def test_freezing_a_tower_a_text_model_lacks_is_refused(
    tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        trainer_args(tiny_models["qwen2"], extra=["--freeze-vision-tower"])
    assert capsys.readouterr().err.startswith("error: --freeze-vision-tower: has no effect")


def test_hf_to_megatron_to_hf_is_bit_exact_vision_tower_included(run: dict[str, Any]) -> None:
    exported, checkpoint = run["exported"], run["checkpoint"]
    assert sorted(exported) == sorted(checkpoint)
    assert sum(name.startswith("visual.") for name in checkpoint) == 30
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name], tensor), name


def test_logits_equal_transformers_on_image_and_text_prompts(run: dict[str, Any]) -> None:
    for ours, theirs in zip(run["alone"], run["hf"], strict=True):
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max() <= TOL
    # The image is seen: without its features the same ids give other logits.
    assert (run["no_image"] - run["alone"][0]).abs().max() > 1e-2


def test_packed_sequences_with_their_own_positions_equal_each_alone(run: dict[str, Any]) -> None:
    start = 0
    for length, alone in zip(run["lengths"], run["alone"], strict=True):
        assert (run["packed"][start : start + length] - alone).abs().max() <= TOL
        start += length
    assert start == run["packed"].shape[0]


def test_padded_rows_take_their_own_images_in_row_order(run: dict[str, Any]) -> None:
    """``--qkv-format bshd``: two image prompts as rows of one batch; each row's image pads get that
    row's image (the images come row after row)."""
    assert run["padded"].shape[0] == 2
    for row, length in enumerate(run["lengths"][:2]):
        assert (run["padded"][row, :length] - run["alone"][row]).abs().max() <= TOL


def test_responses_sharing_an_image_prompt_equal_each_alone(run: dict[str, Any]) -> None:
    """``--share-prompts-in-train``: the trainer's batching packs the image prompt once; the model's
    multimodal RoPE takes each token's own positions, the packed attention the shared mask."""
    ours, theirs = run["shared"]
    assert [len(t) for t in ours] == [len(t) for t in theirs] == [4, 3, 5]
    for a, b in zip(ours, theirs, strict=True):
        assert (a - b).abs().max() <= TOL


def test_freeze_vision_tower_trains_the_language_model_only(run: dict[str, Any]) -> None:
    frozen, trained = run["step_frozen=True"], run["step_frozen=False"]
    names = sorted(frozen["before"])
    tower = [name for name in names if name.startswith("visual.")]
    language = [name for name in names if not name.startswith("visual.")]
    assert len(tower) == 30 and language
    # No gradient, no DDP gradient buffer, unchanged by the step; every language parameter moved.
    assert frozen["requires_grad"] == frozen["buffered"] == language
    for name in tower:
        assert torch.equal(frozen["after"][name], frozen["before"][name]), name
    for name in language:
        assert not torch.equal(frozen["after"][name], frozen["before"][name]), name
    # Unfrozen, the same step moves the tower too.
    assert trained["buffered"] == names
    assert all(not torch.equal(trained["after"][n], trained["before"][n]) for n in tower)


def test_text_only_steps_train_with_overlapped_gradient_reduction(run: dict[str, Any]) -> None:
    """A micro-batch without images still touches every tower parameter (with a zero), so the DDP of
    ``--overlap-grad-reduce`` that waits for each parameter's gradient gets them all at every step."""
    assert run["overlap_steps"] == 3


def test_the_tower_keeps_fp32_rope_frequencies_in_bf16(run: dict[str, Any]) -> None:
    assert run["bf16_tower"] == (torch.bfloat16, torch.float32)


def test_save_hf_loads_in_transformers_with_the_trained_logits(run: dict[str, Any]) -> None:
    assert run["reloaded_class"] == "Qwen2_5_VLForConditionalGeneration"
    assert sorted(run["saved"]) == sorted(run["checkpoint"])
    assert (run["reloaded_logits"] - run["trained_logits"]).abs().max() <= TOL
    name = "visual.merger.mlp.0.weight"  # the trained tower is exported, not the loaded one
    assert torch.equal(run["saved"][name], run["step_frozen=False"]["after"][name])
    assert not torch.equal(run["saved"][name], run["checkpoint"][name])
