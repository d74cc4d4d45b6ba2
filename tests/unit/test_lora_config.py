"""LoRA flags: what the engines are started with, what a push goes through, and the one-line refusals
of combinations that cannot work yet."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime.config import parse_args
from slime.config.settings.lora import ALL_LINEAR, LoraSettings, engine_server_args, target_modules
from slime.config.settings.rollout import EngineSettings
from slime.config.settings.weight_sync import WeightSyncSettings
from slime.rollout.plugin_args import served_adapter
from tests.support.configs import base, expect_error, make_hf


def test_all_linear_and_exclusions_give_the_hf_module_names() -> None:
    assert target_modules(["all-linear"], ["o_proj"])[:6] == (
        "q_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert target_modules(["q_proj", "k_proj", "v_proj"], []) == ("q_proj", "k_proj", "v_proj")
    lora = LoraSettings(rank=8, alpha=32.0)
    assert lora.scaling == 4.0 and lora.enabled and not LoraSettings().enabled


def test_engines_serve_the_adapter_unless_it_is_train_only(tmp_path: Path) -> None:
    hf = make_hf(tmp_path)
    args = parse_args(base(hf, "--lora-rank", "8", "--sglang-max-loras-per-batch", "2"))
    server_args = dict(EngineSettings.from_args(args).server_args)
    assert server_args == {
        "enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"], "max_loras_per_batch": "2",
    }  # fmt: skip
    assert served_adapter(args) == "slime_lora"
    narrow = LoraSettings(rank=4, target_modules=("q_proj", "k_proj", "v_proj"))
    assert engine_server_args(narrow)["lora_target_modules"] == ["q_proj", "k_proj", "v_proj"]
    train_only = parse_args(base(hf, "--lora-rank", "8", "--lora-train-only"))
    assert dict(EngineSettings.from_args(train_only).server_args) == {}
    assert served_adapter(train_only) is None
    from slime.weight_sync.lora import LoraWeightUpdater
    from slime.weight_sync.transport import build_weight_updater

    assert isinstance(build_weight_updater(WeightSyncSettings.from_args(train_only), None), LoraWeightUpdater)
    assert set(ALL_LINEAR) <= set(LoraSettings.from_args(args).target_modules)


@pytest.mark.parametrize(
    ("extra", "flag", "text"),
    [
        (["--lora-train-only"], "--lora-train-only", "applies to LoRA runs only; add --lora-rank R"),
        (
            ["--lora-rank", "8", "--lora-adapter-path", "/nowhere"],
            "--lora-adapter-path",
            "/nowhere has no adapter_config.json",
        ),
        (
            ["--lora-rank", "8", "--target-modules", "q_proj", "v_proj"],
            "--target-modules",
            "fuses q_proj k_proj v_proj",
        ),
        (
            ["--lora-rank", "8", "--exclude-modules", "lm_head"],
            "--exclude-modules",
            "lm_head is not among --target-modules",
        ),
        (["--lora-rank", "8", "--actor-num-nodes", "2"], "--colocate", "handed over from one node's rank 0"),
    ],
)
def test_combinations_that_cannot_work_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str, text: str
) -> None:
    assert text in expect_error(capsys, base(make_hf(tmp_path), *extra), flag)
