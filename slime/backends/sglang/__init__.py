"""Launching real SGLang servers (GPU nodes): the ``--rollout-backend sglang`` side of the engine seam.

``slime.ray.engines.engine_command`` asks ``server_command`` for the argv of one server process;
the ``--sglang-*`` flags themselves are parsed and checked by ``slime.config.sglang_args``.
"""

from __future__ import annotations

from slime.backends.sglang.launcher import server_command

__all__ = ["server_command"]
