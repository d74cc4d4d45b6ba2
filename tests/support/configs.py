"""Building configs (an HF checkpoint's config.json, base flags) and checking refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slime.config import build_parser, parse_args
from slime.config.settings.cluster import ClusterSettings
from slime.config.settings.fault_tolerance import FaultToleranceSettings

TINY_QWEN2 = {
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
}


def make_hf(root: Path, **overrides: object) -> str:
    """A fake HF checkpoint: only config.json, which is all the config package reads."""
    path = root / "hf"
    path.mkdir(exist_ok=True)
    config = {k: v for k, v in {**TINY_QWEN2, **overrides}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def base(hf: str, *extra: str) -> list[str]:
    """The smallest valid command: HF checkpoint, rollout size, lr, run length, colocated GPUs."""
    return [
        "--hf-checkpoint", hf, "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
        "--lr", "1e-6", "--num-rollout", "3", "--colocate", *extra,
    ]  # fmt: skip


def expect_error(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> str:
    """parse_args must exit 2 with exactly one stderr line ``error: <flag>: ...``."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {flag}: "), err
    return err.strip()


def cluster_settings(**overrides: object) -> ClusterSettings:
    """What ``start_ray`` reads: one trainer rank and one engine, no critic, no external engines."""
    values: dict[str, object] = {
        "actor_num_nodes": 1, "actor_num_gpus_per_node": 1, "rollout_num_gpus": 1,
        "rollout_num_gpus_per_engine": 1, "num_gpus_per_node": 8, "colocate": False, "critic_num_nodes": 1,
        "critic_num_gpus_per_node": 1, "has_critic": False, "debug_rollout_only": False,
        "debug_train_only": False, "uses_engines": True, "ray_address": None, "external_engine_addrs": (),
        "engine_api_key": None,
    }  # fmt: skip
    return ClusterSettings(**{**values, **overrides})  # type: ignore[arg-type]


def fault_tolerance_settings(**changes: object) -> FaultToleranceSettings:
    """The flags' defaults as fault-tolerance settings, with ``changes``."""
    defaults = FaultToleranceSettings.from_args(build_parser().parse_args([]))
    return dataclasses.replace(defaults, **changes)  # type: ignore[arg-type]
