"""``scripts/run-qwen3-4B.sh`` is run for real with a stand-in interpreter that records its argv, and
the argv goes through ``parse_args`` with a Qwen3-4B config.json and data files in place: a renamed
or removed flag, or model flags that disagree with Qwen3-4B, fail here instead of on an H100 node."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from slime.config import parse_args

REPO = Path(__file__).resolve().parents[2]

QWEN3_4B = {  # Qwen/Qwen3-4B config.json, the fields slime reads
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36,
    "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True,
    "attention_bias": False, "hidden_act": "silu",
}  # fmt: skip


def script_argv(tmp_path: Path, *extra: str) -> list[str]:
    """The argv ``scripts/run-qwen3-4B.sh`` hands to ``train.py`` (after the script path)."""
    recorder = tmp_path / "python"
    recorder.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
    recorder.chmod(0o755)
    out = tmp_path / "argv"
    env = {
        **os.environ,
        "PYTHON": str(recorder),
        "ARGV_OUT": str(out),
        "MODEL_DIR": str(tmp_path / "models"),
        "DATA_DIR": str(tmp_path / "data"),
        "CKPT_DIR": str(tmp_path / "ckpt"),
    }
    subprocess.run(["bash", str(REPO / "scripts/run-qwen3-4B.sh"), *extra], env=env, check=True, timeout=30)
    script, *argv = out.read_bytes().decode().split("\0")[:-1]
    assert Path(script) == REPO / "train.py"
    return argv


def test_run_qwen3_4b_parses_and_validates(tmp_path: Path) -> None:
    (tmp_path / "models/Qwen3-4B").mkdir(parents=True)
    (tmp_path / "models/Qwen3-4B/config.json").write_text(json.dumps(QWEN3_4B))
    for name in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (tmp_path / "data" / name).parent.mkdir(parents=True)
        (tmp_path / "data" / name).write_text('{"prompt": "1 + 1 = ?", "label": "2"}\n')
    args = parse_args(script_argv(tmp_path, "--num-rollout", "5"))
    assert (args.num_layers, args.hidden_size, args.kv_channels, args.qk_layernorm) == (36, 2560, 128, True)
    assert args.world_size == 4 and args.tensor_model_parallel_size == 2 and args.data_parallel_size == 2
    assert args.rollout_num_gpus == 4 and args.rollout_num_gpus_per_engine == 2
    assert args.global_batch_size == 256 and args.num_steps_per_rollout == 1 and args.num_rollout == 5
    assert args.advantage_estimator == "grpo" and args.eps_clip_high == 0.28 and args.bf16
    assert args.sglang_server_args == {"mem_fraction_static": "0.7"}
    assert [(s.name, s.path) for s in args.eval_sets] == [
        ("aime", str(tmp_path / "data/aime-2024/aime-2024.jsonl"))
    ]
