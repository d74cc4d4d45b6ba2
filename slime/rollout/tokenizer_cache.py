"""A checkpoint's tokenizer as ``AutoTokenizer`` builds it, kept pickled between runs.

``AutoTokenizer`` imports torch whenever torch is installed (``configuration_utils`` imports
``modeling_rope_utils``, which imports torch), although the tokenizer it returns needs none. Measured
2026-12-05, 2 cores, on the quickstart's tokenizer: a process that loads it through ``AutoTokenizer``
holds 293 MiB of private memory and spent 2.1 s; one that unpickles the same object 111 MiB and 1.2 s.
The rollout manager and the driver only tokenize, so the first load of a checkpoint's tokenizer pickles
the object (whatever class ``AutoTokenizer`` picked) into this cache, and every load unpickles it. A
process without torch that finds no entry has one made by a short-lived process of its own
(``python -m slime.rollout.tokenizer_cache CHECKPOINT``, 2.4 CPU-s on 2 cores), so that it never
imports torch for a tokenizer; a process that has torch already makes the entry itself.

An entry is keyed by the checkpoint's real path, the size and modification time of every file at its
top level, and the Python, transformers and tokenizers versions: a changed file or an upgrade makes a
new entry. ``SLIME_TOKENIZER_CACHE`` names the directory (default ``$XDG_CACHE_HOME/slime/tokenizers``,
else ``~/.cache/slime/tokenizers``); ``off`` turns the cache off. Entries are written by this module
only, into a directory only its user can write (a pickle runs code when loaded).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_ENV = "SLIME_TOKENIZER_CACHE"


def load_tokenizer(checkpoint: str) -> Any:
    """``AutoTokenizer.from_pretrained(checkpoint)``'s tokenizer, from the cache when it holds it; a
    local checkpoint's is put there on its first load. Loading errors are ``AutoTokenizer``'s."""
    entry = cache_entry(checkpoint)
    if entry is not None and not entry.is_file() and "torch" not in sys.modules:
        _make_entry_elsewhere(checkpoint)
    if entry is not None and entry.is_file():
        try:
            with entry.open("rb") as cached:
                return pickle.load(cached)
        except Exception as exc:  # a damaged entry: AutoTokenizer decides, and the entry is rewritten
            logger.warning("tokenizer cache entry %s unreadable (%s); loading %s", entry, exc, checkpoint)
    return _load_and_cache(checkpoint, entry)


MAKE_ENTRY_TIMEOUT_S = 600.0


def _make_entry_elsewhere(checkpoint: str) -> None:
    """The entry of ``checkpoint`` made by a process of its own; a failure there (a checkpoint whose
    tokenizer does not load) is left for this process's own ``AutoTokenizer`` to raise."""
    command = [sys.executable, "-m", __name__, checkpoint]
    try:
        subprocess.run(command, timeout=MAKE_ENTRY_TIMEOUT_S, capture_output=True, check=False)
    except subprocess.TimeoutExpired:  # run() has killed it
        logger.warning(
            "making the tokenizer cache entry of %s took over %.0f s", checkpoint, MAKE_ENTRY_TIMEOUT_S
        )


def _load_and_cache(checkpoint: str, entry: Path | None) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if entry is not None:
        _write(entry, tokenizer)
    return tokenizer


def cache_dir() -> Path | None:
    """Where entries live; None when ``SLIME_TOKENIZER_CACHE=off``."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("off", "0", "false", "") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slime" / "tokenizers"


def cache_entry(checkpoint: str) -> Path | None:
    """The entry of ``checkpoint``'s tokenizer as its files are now; None for no cache or a checkpoint
    that is not a local directory (a hub name)."""
    directory = cache_dir()
    root = Path(checkpoint)
    if directory is None or not root.is_dir():
        return None
    files = []
    for path in sorted(root.iterdir()):
        try:
            stat = path.stat()
        except OSError:  # a dangling link
            continue
        if path.is_file():
            files.append([path.name, stat.st_size, stat.st_mtime_ns])
    key = {
        "checkpoint": str(root.resolve()),
        "files": files,
        "python": list(sys.version_info[:3]),
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return directory / f"{digest}.pkl"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _write(entry: Path, tokenizer: Any) -> None:
    """Best effort: a tokenizer that does not pickle, or a cache that cannot be written, only costs the
    next load its time."""
    partial = None
    try:
        data = pickle.dumps(tokenizer)
        entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=entry.parent, prefix=".partial-")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(partial, entry)  # whole or not at all, whoever writes the same entry at once
    except Exception as exc:
        logger.debug("tokenizer not cached at %s: %s", entry, exc)
        if partial is not None:
            Path(partial).unlink(missing_ok=True)


if __name__ == "__main__":
    _load_and_cache(sys.argv[1], cache_entry(sys.argv[1]))
