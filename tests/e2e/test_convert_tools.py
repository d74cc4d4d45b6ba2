"""tools/convert_hf_to_torch_dist.py and tools/convert_torch_dist_to_hf.py, run as a user runs them.

HF -> torch_dist -> HF is bit-exact, also across layouts: the checkpoint is written at TP=2 (two
ranks) and read back at PP=2 (two stages), which dist_checkpointing reshards on load. The way back is
given the HF directory of a differently seeded model as ``--hf-checkpoint``, so the output can only
equal the original if its weights came from the checkpoint.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from slime.backends.megatron.hf_checkpoint import SafetensorsReader
from tests.support.models import model_args
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e


def run_tool(name, *flags):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / name), *model_args("tiny-qwen2.sh"), *map(str, flags)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_hf_to_torch_dist_at_tp2_and_back_at_pp2_is_bit_exact(tiny_models, tmp_path):
    from tools.make_tiny_model import make_tiny_model

    original_dir = tiny_models["qwen2"]
    other_dir = make_tiny_model(tmp_path / "other", seed=1)  # same shape, other weights
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"

    saved = run_tool(
        "convert_hf_to_torch_dist.py",
        "--hf-checkpoint", original_dir, "--save", ckpt,
        "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
    )  # fmt: skip
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert (ckpt / "iter_0000000").is_dir()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "0"

    loaded = run_tool(
        "convert_torch_dist_to_hf.py", "--hf-checkpoint", other_dir, "--load", ckpt, "--save-hf", out,
        "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-3000:]

    original, other = (
        load_file(original_dir / "model.safetensors"),
        load_file(other_dir / "model.safetensors"),
    )
    reader = SafetensorsReader(out)  # through model.safetensors.index.json: one file per bucket
    exported = {name: reader.get(name) for name in reader.names()}
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert not torch.equal(other["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    ("tool", "flags", "message"),
    [
        ("convert_hf_to_torch_dist.py", [], "error: --save: required"),
        ("convert_torch_dist_to_hf.py", ["--save-hf", "OUT"], "error: --load: required"),
        ("convert_torch_dist_to_hf.py", ["--load", "MISSING", "--save-hf", "OUT"], "holds no checkpoint"),
        ("convert_torch_dist_to_hf.py", ["--load", "EMPTY"], "error: --save-hf: required"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(tiny_models, tmp_path, tool, flags, message):
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "EMPTY" / "latest_checkpointed_iteration.txt").write_text("0")
    (tmp_path / "EMPTY" / "iter_0000000").mkdir()
    paths = [str(tmp_path / f) if f.isupper() else f for f in flags]
    result = run_tool(tool, "--hf-checkpoint", tiny_models["qwen2"], *paths)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "OUT").exists()
