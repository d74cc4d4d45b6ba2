"""A torch engine served in this process behind its real aiohttp app (on a background event loop), so
that a test speaks HTTP to it as the rollout does, without a process start per test module."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import requests
import torch
from aiohttp import web

from slime.backends.torch_engine.engine import TorchEngine
from slime.backends.torch_engine.server import create_app
from slime.backends.torch_engine.server_args import parse_server_args
from slime.utils.http import free_port


class ServedEngine:
    """The engine of ``argv`` (SGLang flag names; ``--random-seed 0`` added) and its app; ``url`` takes
    HTTP requests until ``close``."""

    def __init__(self, argv: list[str]) -> None:
        torch.set_num_threads(1)
        self.engine = TorchEngine(parse_server_args([*argv, "--random-seed", "0"]))
        self.engine.start()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(create_app(self.engine))
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(30)

    def post(self, path: str, body: dict[str, Any]) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, timeout=60)

    def close(self) -> None:
        """The app, its loop and then the engine's scheduler thread (requests in flight are aborted)."""
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.engine.scheduler.stop()
