"""``train.py`` as a user first meets it: ``--help`` and mistakes, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, model_args

FAMILY_TITLES = (
    "Megatron: model",
    "Megatron: parallelism",
    "SGLang: --sglang-<flag> pass-through",
    "slime: rollout",
)


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_help_lists_the_three_flag_families():
    result = run("--help")
    assert result.returncode == 0
    for title in FAMILY_TITLES:
        assert title in result.stdout
    assert "--num-query-groups" in result.stdout and "--rollout-batch-size" in result.stdout


def test_a_bad_flag_is_one_line_and_exit_2():
    result = run("--no-such-flag")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: unrecognized arguments: --no-such-flag; see --help"]


def test_a_malformed_data_line_is_one_line_and_nothing_starts(tiny_models, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input": "abc", "label": "cba"}) + "\n" + '{"input": broken\n')
    flags = ["--hf-checkpoint", str(tiny_models["qwen2"]), "--prompt-data", str(data), "--lr", "1e-5"]
    result = run(
        *model_args(), *flags, "--rollout-batch-size", "1", "--rollout-num-gpus", "1", "--num-rollout", "1"
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {data}:2: not valid JSON"), lines
