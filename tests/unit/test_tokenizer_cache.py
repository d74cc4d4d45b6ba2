"""The tokenizer cache: AutoTokenizer's very object, loaded again without torch, keyed by the files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slime.rollout import tokenizer_cache
from slime.rollout.tokenizer_cache import CACHE_ENV, cache_entry, load_tokenizer

TEXT = "the cat sat on 12 mats"
MESSAGES = [{"role": "user", "content": "2+2?"}]

LOAD_IN_A_FRESH_PROCESS = """
import json, sys
from slime.rollout.tokenizer_cache import load_tokenizer
tok = load_tokenizer(sys.argv[1])
print(json.dumps({
    "class": type(tok).__name__,
    "ids": tok(sys.argv[2], add_special_tokens=False)["input_ids"],
    "chat": tok.apply_chat_template(json.loads(sys.argv[3]), tokenize=False, add_generation_prompt=True),
    "torch": "torch" in sys.modules,
}))
"""


def _tokenizer_copy(tiny_models: dict[str, Path], tmp_path: Path) -> Path:
    """The tiny qwen2's tokenizer files in a directory of the test's own (they are changed here)."""
    copy = tmp_path / "checkpoint"
    copy.mkdir()
    for path in tiny_models["qwen2"].iterdir():
        if not path.name.endswith(".safetensors"):
            shutil.copy2(path, copy / path.name)
    return copy


def _load_in_a_fresh_process(checkpoint: Path, cache: Path) -> dict:
    env = {**os.environ, CACHE_ENV: str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(checkpoint), TEXT, json.dumps(MESSAGES)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cached_tokenizer_is_autotokenizers_and_loads_without_torch(tiny_models, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    checkpoint = _tokenizer_copy(tiny_models, tmp_path)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    reference = AutoTokenizer.from_pretrained(checkpoint)
    first = load_tokenizer(str(checkpoint))  # not cached yet: AutoTokenizer's, then written
    entry = cache_entry(str(checkpoint))
    assert entry is not None and entry.is_file()
    assert list(entry.parent.iterdir()) == [entry]  # no partial file left
    assert oct(entry.parent.stat().st_mode & 0o777) == "0o700"
    cached = _load_in_a_fresh_process(checkpoint, tmp_path / "cache")
    assert cached["torch"] is False
    assert cached["class"] == type(reference).__name__ == type(first).__name__
    assert cached["ids"] == reference(TEXT, add_special_tokens=False)["input_ids"]
    chat = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert cached["chat"] == chat


def test_a_process_without_torch_has_a_missing_entry_made_elsewhere(tiny_models, tmp_path):
    """The rollout manager's first run on a checkpoint: the entry is made by a process of its own, so
    the manager never imports torch; a checkpoint without a tokenizer fails with AutoTokenizer's error."""
    checkpoint = _tokenizer_copy(tiny_models, tmp_path)
    cache = tmp_path / "cache"
    loaded = _load_in_a_fresh_process(checkpoint, cache)
    assert loaded["torch"] is False and len(list(cache.glob("*.pkl"))) == 1
    assert loaded["ids"] == load_tokenizer(str(checkpoint))(TEXT, add_special_tokens=False)["input_ids"]
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    with pytest.raises(subprocess.CalledProcessError) as failed:
        _load_in_a_fresh_process(empty, cache)
    assert "OSError" in failed.value.stderr or "ValueError" in failed.value.stderr
    assert len(list(cache.glob("*.pkl"))) == 1


def test_a_changed_tokenizer_file_is_a_new_entry(tiny_models, tmp_path, monkeypatch):
    checkpoint = _tokenizer_copy(tiny_models, tmp_path)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    load_tokenizer(str(checkpoint))
    before = cache_entry(str(checkpoint))
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}|"
    config_path.write_text(json.dumps(config))
    (checkpoint / "chat_template.jinja").unlink(missing_ok=True)
    after = cache_entry(str(checkpoint))
    assert after != before and not after.exists()  # type: ignore[union-attr]
    assert load_tokenizer(str(checkpoint)).apply_chat_template(MESSAGES, tokenize=False) == "2+2?|"
    assert _load_in_a_fresh_process(checkpoint, tmp_path / "cache")["chat"] == "2+2?|"


def test_a_damaged_entry_is_loaded_again_and_rewritten(tiny_models, tmp_path, monkeypatch, caplog):
    checkpoint = _tokenizer_copy(tiny_models, tmp_path)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    expected = load_tokenizer(str(checkpoint))(TEXT)["input_ids"]
    entry = cache_entry(str(checkpoint))
    assert entry is not None
    entry.write_bytes(b"not a pickle")
    assert load_tokenizer(str(checkpoint))(TEXT)["input_ids"] == expected
    assert "unreadable" in caplog.text
    assert _load_in_a_fresh_process(checkpoint, tmp_path / "cache")["ids"] == expected


@pytest.mark.parametrize("value", ["off", "0", ""])
def test_the_cache_is_off_when_asked(tiny_models, tmp_path, monkeypatch, value):
    checkpoint = _tokenizer_copy(tiny_models, tmp_path)
    monkeypatch.setenv(CACHE_ENV, value)
    assert tokenizer_cache.cache_dir() is None and cache_entry(str(checkpoint)) is None
    assert load_tokenizer(str(checkpoint))(TEXT)["input_ids"]


def test_a_hub_name_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert cache_entry("Qwen/Qwen3-4B") is None


def test_the_default_directory_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tokenizer_cache.cache_dir() == tmp_path / "slime" / "tokenizers"
