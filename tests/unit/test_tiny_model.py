"""The locally generated tiny checkpoint is what every real-model code path is tested on, so it must load
offline in transformers like a hub checkpoint, tokenize exactly, and agree with its Megatron flags."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.make_tiny_model import CHARACTERS, SETTINGS_FILE, SPECIAL_TOKENS, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "scripts" / "models"
ARCHS = ("qwen2", "qwen3", "llama")
REAL_SCRIPTS = ("qwen2.5-0.5B.sh", "qwen3-0.6B.sh", "qwen3-4B.sh", "qwen3-8B.sh", "llama3.1-8B.sh")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One default-sized checkpoint per architecture, shared by the whole module (≈ 1 s to build)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _model_args(script: Path) -> list[str]:
    """MODEL_ARGS as bash itself expands it, so quoting or comment mistakes in a script show up."""
    out = subprocess.run(
        ["bash", "-c", 'set -eu; source "$1"; printf "%s\\n" "${MODEL_ARGS[@]}"', "bash", str(script)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.splitlines()


def _flag_values(args: list[str]) -> dict[str, str | None]:
    """{--flag: value or None for a switch}; every entry must be a flag or a flag's single value."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        assert args[i].startswith("--"), f"stray value {args[i]!r}"
        assert args[i] not in flags, f"duplicate flag {args[i]}"
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            flags[args[i]] = args[i + 1]
            i += 2
        else:
            flags[args[i]] = None
            i += 1
    return flags


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_offline_and_runs(tiny_dirs: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_dirs[arch]
    config = _config(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    expected_class = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
    assert type(model).__name__ == expected_class[arch]
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied

    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == (arch == "qwen2")
    assert (attn.k_proj.bias is not None) == (arch == "qwen2")
    assert hasattr(attn, "q_norm") == (arch == "qwen3")
    assert attn.k_proj.out_features == 2 * 32  # GQA: 2 KV heads of dim 32
    assert model.model.layers[0].mlp.gate_proj.out_features == 512  # SwiGLU gate + up

    input_ids = torch.randint(
        0, len(SPECIAL_TOKENS) + len(CHARACTERS), (2, 7), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (2, 7, config["vocab_size"])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_config_and_generation_config(tiny_dirs: dict[str, Path], arch: str) -> None:
    from transformers import GenerationConfig

    path = tiny_dirs[arch]
    config = _config(path)
    n_tokens = len(SPECIAL_TOKENS) + len(CHARACTERS)
    assert config["vocab_size"] % 16 == 0
    assert n_tokens < config["vocab_size"] < n_tokens + 16  # a few unused, padded rows
    assert config["eos_token_id"] == SPECIAL_TOKENS.index("<|im_end|>")
    assert config["pad_token_id"] == 0
    assert config.get("bos_token_id") is None
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is True
    assert (path / "model.safetensors").is_file()
    assert not list(path.glob("*.bin"))

    generation = GenerationConfig.from_pretrained(path, local_files_only=True)
    assert generation.do_sample is True
    # top_k must be set: transformers would fill a missing one with 50. vocab_size keeps every token.
    assert generation.top_k == config["vocab_size"]
    assert generation.top_p == 1.0 and generation.temperature == 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trip_and_chat_template(tiny_dirs: dict[str, Path], arch: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs[arch], local_files_only=True)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARACTERS)

    rng = random.Random(0)
    samples = [CHARACTERS, "  two  spaces\n\nnewlines ", "12+3=15", "Sort: 5 3 1 -> 1 3 5"]
    samples += ["".join(rng.choice(CHARACTERS) for _ in range(rng.randint(1, 60))) for _ in range(50)]
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text), repr(text)  # exactly one token per character
        assert tok.decode(ids) == text, repr(text)
    ids = tok.encode("<|im_start|>ab<|im_end|>", add_special_tokens=False)
    assert ids == [1, tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b"), 2]
    assert tok.decode(ids, skip_special_tokens=True) == "ab"

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "12+3"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\n12+3<|im_end|>\n<|im_start|>assistant\n"
    conversation = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
    ]
    assert tok.apply_chat_template(conversation, tokenize=False) == (
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
    )


def test_same_settings_reuse_the_directory(tiny_dirs: dict[str, Path]) -> None:
    path = tiny_dirs["qwen2"]
    weights = path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert make_tiny_model(path) == path
    assert weights.stat().st_mtime_ns == before


def test_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    target = tmp_path / "model"
    make_tiny_model(target, num_layers=1, hidden_size=32, intermediate_size=64, seed=1)
    with pytest.raises(FileExistsError, match="different settings"):
        make_tiny_model(target, num_layers=1, hidden_size=32, intermediate_size=64, seed=2)

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        make_tiny_model(other, num_layers=1, hidden_size=32, intermediate_size=64)
    assert (other / "notes.txt").read_text() == "keep me"

    make_tiny_model(target, num_layers=1, hidden_size=32, intermediate_size=64, seed=2, force=True)
    assert json.loads((target / SETTINGS_FILE).read_text())["seed"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging dirs left behind


def test_same_seed_gives_same_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    small = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64}
    a = load_file(make_tiny_model(tmp_path / "a", seed=3, **small) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=3, **small) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=4, **small) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_invalid_settings_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        make_tiny_model(tmp_path / "x", num_attention_heads=3)
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    assert not (tmp_path / "x").exists()


def test_cli_reuses_and_reports(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The CLI's fast path (an existing model) needs no torch import; errors are one line, exit code 2."""
    script = REPO / "tools" / "make_tiny_model.py"
    ok = subprocess.run(
        [sys.executable, str(script), "--out", str(tiny_dirs["qwen2"])], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert f"vocab_size={_config(tiny_dirs['qwen2'])['vocab_size']}" in ok.stdout

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    bad = subprocess.run([sys.executable, str(script), "--out", str(busy)], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "error:" in bad.stderr


def test_tiny_qwen2_script_matches_config(tiny_dirs: dict[str, Path]) -> None:
    config = _config(tiny_dirs["qwen2"])
    flags = _flag_values(_model_args(MODELS_DIR / "tiny-qwen2.sh"))
    assert int(flags["--num-layers"]) == config["num_hidden_layers"]
    assert int(flags["--hidden-size"]) == config["hidden_size"]
    assert int(flags["--ffn-hidden-size"]) == config["intermediate_size"]
    assert int(flags["--num-attention-heads"]) == config["num_attention_heads"]
    assert int(flags["--num-query-groups"]) == config["num_key_value_heads"]
    assert int(flags["--kv-channels"]) == config.get(
        "head_dim", config["hidden_size"] // config["num_attention_heads"]
    )
    assert int(flags["--vocab-size"]) == config["vocab_size"]
    assert float(flags["--rotary-base"]) == config["rope_parameters"]["rope_theta"]
    assert float(flags["--norm-epsilon"]) == config["rms_norm_eps"]
    assert int(flags["--max-position-embeddings"]) == config["max_position_embeddings"]
    assert ("--untie-embeddings-and-output-weights" in flags) == (not config["tie_word_embeddings"])
    assert "--add-qkv-bias" in flags and "--qk-layernorm" not in flags  # Qwen2: q/k/v bias, no qk-norm


REQUIRED_SWITCHES = (
    "--swiglu",
    "--group-query-attention",
    "--use-rotary-position-embeddings",
    "--disable-bias-linear",
)
REQUIRED_VALUES = (
    "--num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--num-query-groups",
    "--kv-channels",
    "--rotary-base",
    "--norm-epsilon",
    "--vocab-size",
    "--max-position-embeddings",
)
# (attention extra, tied embeddings) as the models' config.json files state them.
EXPECTED_SHAPE = {
    "qwen2.5-0.5B.sh": ("--add-qkv-bias", True),
    "tiny-glm4.sh": ("--add-qkv-bias", True),
    "qwen3-0.6B.sh": ("--qk-layernorm", True),
    "qwen3-4B.sh": ("--qk-layernorm", True),
    "qwen3-8B.sh": ("--qk-layernorm", False),
    "llama3.1-8B.sh": (None, False),
}


@pytest.mark.parametrize("name", ["tiny-qwen2.sh", "tiny-glm4.sh", *REAL_SCRIPTS])
def test_model_scripts_define_required_flags(name: str) -> None:
    script = MODELS_DIR / name
    header = script.read_text().splitlines()[0]
    assert header.startswith("#")
    if name in REAL_SCRIPTS:
        assert (
            re.search(r"[\w.-]+/[\w.-]+", header)
            and "config.json" in script.read_text().split("MODEL_ARGS")[0]
        )

    flags = _flag_values(_model_args(script))
    for switch in REQUIRED_SWITCHES:
        assert switch in flags and flags[switch] is None, f"{name}: {switch}"
    for flag in REQUIRED_VALUES:
        assert flags.get(flag) is not None, f"{name}: {flag} needs a value"
        float(flags[flag])  # numeric
    assert flags["--normalization"] == "RMSNorm"
    assert int(flags["--num-attention-heads"]) % int(flags["--num-query-groups"]) == 0
    assert not ("--add-qkv-bias" in flags and "--qk-layernorm" in flags)

    if name in EXPECTED_SHAPE:
        extra, tied = EXPECTED_SHAPE[name]
        for option in ("--add-qkv-bias", "--qk-layernorm"):
            assert (option in flags) == (option == extra), f"{name}: {option}"
        assert ("--untie-embeddings-and-output-weights" in flags) == (not tied), name
