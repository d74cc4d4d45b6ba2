"""The repository root the tests run from."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "support" / "plugins"
"""The plugin modules the tests name by file path or dotted path (``tests.support.plugins.<name>``)."""
