"""LoRA on the Megatron trainer (one gloo rank, on the CPU): adapters with B = 0 leave the model exactly
the base model, a step trains the adapters only (no gradient buffer, no optimizer state for the
frozen base), the exported adapter is PEFT's (``PeftModel`` gives the trainer's logits), it loads
back with ``--lora-adapter-path``, a distributed checkpoint resumes adapters and optimizer exactly, and
training holds a small fraction of the full model's bytes.

The trainer runs in subprocesses (``tests.support.lora_megatron``: the CPU trainer setup patches
``torch.cuda`` process-wide); each test checks one part of what they recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.lora_megatron import RANK, TOKENS, run_ranks, tiny_qwen2
from tests.support.trainers import trainer_args

TOL = 1e-5  # fp32, the same maths in another order
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
PADDING = 64 * 1024
"""DDP's gradient buffer aligns each parameter and bucket for the distributed optimizer (bytes)."""
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen2(tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_run")


@pytest.fixture(scope="module")
def run(model: Path, out_dir: Path) -> dict[str, Any]:
    return run_ranks("train", model, out_dir, world=1)[0]


def adapter_names(names: list[str]) -> list[str]:
    return [n for n in names if ".lora_" in n]


def test_zero_b_leaves_the_base_models_logits_exactly(run: dict[str, Any]) -> None:
    assert torch.equal(run["step0_logits"], run["base_logits"])


def test_a_step_trains_the_adapters_only(run: dict[str, Any]) -> None:
    names = sorted(run["before"])
    adapters = adapter_names(names)
    assert len(adapters) == 2 * len(LINEARS) * 2  # A and B of 4 linears in 2 layers
    # Only the adapters take gradients and have DDP gradient buffers.
    assert run["requires_grad"] == run["buffered"] == adapters
    for name in names:
        if name in adapters:
            continue
        assert torch.equal(run["after"][name], run["before"][name]), name
    for name in adapters:
        if name.endswith("lora_B.weight"):
            assert not run["before"][name].any() and run["after"][name].abs().min() > 0, name
    memory = run["memory"]
    trainable = sum(run["before"][n].numel() * 4 for n in adapters)
    assert memory["trainable_params"] == trainable
    assert trainable <= memory["grad_buffers"] <= trainable + PADDING
    assert memory["optimizer_state"] == 2 * trainable  # Adam's two moments, for the adapters alone


def test_the_exported_adapter_is_peft_and_gives_the_trainers_logits(
    run: dict[str, Any], model: Path, out_dir: Path
) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    adapter = out_dir / "adapter"
    assert run["save_hf"] == str(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == 16.0 and config["target_modules"] == list(MODULES)
    assert config["base_model_name_or_path"] == str(model)
    exported = run["state_dict"]
    assert sorted(exported) == sorted(run["step1_export"])
    assert all(torch.equal(exported[n], t) for n, t in run["step1_export"].items())
    # One fused A per layer, shared by its HF modules.
    prefix = "base_model.model.model.layers.1."
    q, k = (exported[f"{prefix}self_attn.{m}_proj.lora_A.weight"] for m in "qk")
    assert torch.equal(q, k) and q.shape == (RANK, 128)
    assert exported[f"{prefix}self_attn.k_proj.lora_B.weight"].shape == (64, RANK)

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter).eval()
    assert sorted(get_peft_model_state_dict(peft)) == sorted(exported)
    with torch.no_grad():
        theirs = peft(input_ids=TOKENS).logits[0, :, :99]
    assert (theirs - run["trained_logits"]).abs().max() <= TOL
    assert (run["trained_logits"] - run["base_logits"]).abs().max() > 1e-3  # the step moved the model


def test_lora_adapter_path_loads_the_exported_adapter_back(run: dict[str, Any]) -> None:
    assert sorted(run["reloaded_export"]) == sorted(run["step1_export"])
    for name, tensor in run["step1_export"].items():
        assert torch.equal(run["reloaded_export"][name], tensor), name
    assert (run["reloaded_logits"] - run["trained_logits"]).abs().max() <= TOL
    # PEFT's q, k and v each have their own A; Megatron's fused linear_qkv has one.
    assert "self_attn.k_proj, model.layers.0.self_attn.v_proj have different lora_A" in run["unequal_a"]
    assert run["unequal_a"].startswith("--lora-adapter-path ")


def test_a_checkpoint_resumes_adapters_and_optimizer_exactly(run: dict[str, Any]) -> None:
    assert run["loaded_rollout"] == 0
    for name, tensor in run["after"].items():
        assert torch.equal(run["loaded"][name], tensor), name
    adapters = adapter_names(sorted(run["after"]))
    # The second step moves A too (its gradient is zero while B is) and is the same after the resume.
    for name in adapters:
        assert not torch.equal(run["step2"][name], run["after"][name]), name
    for name, tensor in run["step2"].items():
        assert torch.equal(run["resumed_step2"][name], tensor), name


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--target-modules", "q_proj", "v_proj"], "--target-modules"),
        (["--exclude-modules", "up_proj"], "--target-modules"),
        (["--transformer-impl", "transformer_engine"], "--transformer-impl"),
    ],
)
def test_what_lora_refuses(
    model: Path, extra: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        trainer_args(model, extra=["--lora-rank", "8", *extra])
    assert capsys.readouterr().err.startswith(f"error: {flag}: ")


def test_training_bytes_drop_to_a_small_fraction(tmp_path: Path) -> None:
    wide = tiny_qwen2(
        tmp_path / "wide", num_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
        num_key_value_heads=4,
    )  # fmt: skip
    tiny = tiny_qwen2(tmp_path / "tiny")
    (result,) = run_ranks("memory", os.pathsep.join([str(tiny), str(wide)]), tmp_path / "memory", world=1)
    for name in ("tiny", "wide"):
        full, lora = result[name]["full"], result[name]["lora"]
        ratio = lora["training"] / full["training"]
        print(f"{name}: full {full}\n{name}: lora {lora}\n{name}: training bytes ratio {ratio:.4f}")
        assert lora["params"] > full["params"]  # the frozen base is still there, plus the adapters
        assert lora["trainable_params"] <= lora["grad_buffers"] <= lora["trainable_params"] + PADDING
        assert lora["optimizer_state"] == 2 * lora["trainable_params"]
        if name == "wide":
            assert ratio < 0.1
