"""Starting one engine server process and waiting until it generates, whichever backend it runs.

The engine actors of a run, the benchmarks and the tests all start engines this one way: a free port,
the backend's argv for that address, a ``ServerProcess`` (own process group, log file, killed with
its parent), ready once ``GET /health_generate`` answers 200, i.e. once the server really generates.
A server that exits or is not ready in time is stopped and reported with the tail of its log.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from slime.utils.http import ServerProcess, free_port, is_ok

ServerCommand = Callable[[str, int], list[str]]
"""The argv of a server listening on ``(host, port)``."""

HEALTH_PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EngineServer:
    """A started engine server: its process and the URL it answers on."""

    process: ServerProcess
    url: str

    def stop(self) -> None:
        self.process.stop()


def start_engine_server(
    name: str,
    command: ServerCommand,
    log_path: str | os.PathLike[str],
    *,
    timeout_s: float,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
) -> EngineServer:
    """Starts ``command(host, port)`` on a free port with ``env`` over this process's environment and
    returns once it generates; raises ``ServerStartError`` (the server stopped) when it does not."""
    port = free_port()
    process = ServerProcess(name, command(host, port), log_path, {**os.environ, **(env or {})})
    process.start()
    url = f"http://{host}:{port}"
    process.wait_ready(lambda: is_ok(f"{url}/health_generate", timeout=HEALTH_PROBE_TIMEOUT_S), timeout_s)
    return EngineServer(process, url)
