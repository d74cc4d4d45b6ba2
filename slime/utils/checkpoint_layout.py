"""Where Megatron-LM-style checkpoints live on disk, without importing Megatron.

``DIR/iter_0000007/`` holds rollout 7 and ``DIR/latest_checkpointed_iteration.txt`` names the newest.
The driver and the tools check ``--load`` / ``--ckpt-step`` with these before any process starts.
"""

from __future__ import annotations

from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(directory: str | Path, rollout_id: int) -> Path:
    return Path(directory) / f"iter_{rollout_id:07d}"


def latest_rollout_id(directory: str | Path) -> int | None:
    """The rollout id named by the tracker file, or None when ``directory`` holds no checkpoint."""
    tracker = Path(directory) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected a rollout id, found {text!r}; delete the file to start fresh")
    return int(text)


def saved_rollout_ids(directory: str | Path) -> list[int]:
    """Rollout ids with an ``iter_*`` directory under ``directory``, ascending."""
    found = Path(directory).glob("iter_*")
    return sorted(int(p.name[5:]) for p in found if p.is_dir() and p.name[5:].isdigit())
