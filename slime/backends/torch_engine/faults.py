"""Failing on purpose, for the fault-tolerance tests: the torch engine crashes, hangs or answers 500.

Real engines die of OOM, NCCL errors or lost nodes; the tests need one that does so at a chosen
moment. A fault is armed either at start, by ``SLIME_TORCH_ENGINE_FAULT=<mode>@<n>`` in the engine's
environment (how a ``train.py`` subprocess reaches its engines), or at run time by
``POST /slime/inject_fault {"mode", "after_requests"}`` (how an in-process test reaches one engine;
``{"mode": "none"}`` disarms). It fires at the ``n``-th ``/generate`` request from then on (``0``:
at once, except ``crash``, which fires at the next one):

- ``crash``: the process kills itself with SIGKILL, as ``kill -9`` would;
- ``hang``: every request from then on waits until the engine shuts down (then answers 503: a SIGTERM
  stops it at once rather than after the server's shutdown timeout); the process stays alive;
- ``error``: every request from then on, ``/health_generate`` included, is answered 500.

With ``SLIME_TORCH_ENGINE_FAULT_ONCE=<path>`` an environment fault fires only in the one engine that
creates ``path`` first, so an engine restarted with the same environment (or a second engine of the
run) stays well. Nothing of this is active unless one of the two is used.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass

from aiohttp import web

logger = logging.getLogger(__name__)

FAULT_ENV = "SLIME_TORCH_ENGINE_FAULT"
ONCE_ENV = "SLIME_TORCH_ENGINE_FAULT_ONCE"
MODES = ("crash", "hang", "error")


@dataclass
class Fault:
    """An armed fault: ``mode`` at the ``after_requests``-th ``/generate`` request from now."""

    mode: str
    after_requests: int
    once_path: str | None = None
    seen: int = 0
    fired: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.after_requests < 0:
            raise ValueError(f"fault {self.mode}@{self.after_requests}: expected one of {MODES} @ n >= 0")
        if self.after_requests == 0 and self.mode != "crash":  # 0: from now on, /health_generate included
            self.fired = True

    @classmethod
    def from_env(cls) -> Fault | None:
        spec = os.environ.get(FAULT_ENV)
        if not spec:
            return None
        mode, _, count = spec.partition("@")
        return cls(mode, int(count or 1), os.environ.get(ONCE_ENV))

    def count(self, path: str) -> None:
        """Counts ``/generate`` requests; fires at the chosen one (once, or never if another won)."""
        if self.fired or path != "/generate":
            return
        self.seen += 1
        if self.seen < self.after_requests:
            return
        if self.once_path is not None and not _claim(self.once_path):
            self.after_requests = 2**62  # another engine fired it: this one stays well
            return
        self.fired = True
        logger.warning("injected fault: %s at /generate request %d", self.mode, self.seen)
        if self.mode == "crash":
            os.kill(os.getpid(), signal.SIGKILL)


def _claim(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


FAULT = web.AppKey("fault", list)  # [Fault | None]: replaced by /slime/inject_fault
STOPPING = web.AppKey("stopping", asyncio.Event)  # set at shutdown: hung requests end then
INJECT_PATH = "/slime/inject_fault"


@web.middleware
async def fault_middleware(request: web.Request, handler) -> web.StreamResponse:
    fault: Fault | None = request.app[FAULT][0]
    if fault is not None and request.path != INJECT_PATH:
        fault.count(request.path)
        if fault.fired and fault.mode == "hang":
            await request.app[STOPPING].wait()  # no answer while the engine runs
            return web.json_response({"error": {"message": "injected fault: shut down"}}, status=503)
        if fault.fired and fault.mode == "error":
            return web.json_response({"error": {"message": "injected fault"}}, status=500)
    return await handler(request)


async def inject_fault(request: web.Request) -> web.Response:
    """``{"mode", "after_requests"}`` arms a fault; ``{"mode": "none"}`` disarms it (a hung request
    stays hung)."""
    body = await request.json()
    try:
        mode = str(body.get("mode"))
        request.app[FAULT][0] = None if mode == "none" else Fault(mode, int(body.get("after_requests", 1)))
    except (TypeError, ValueError) as exc:
        return web.json_response({"success": False, "message": str(exc)}, status=400)
    return web.json_response({"success": True})


def install(app: web.Application) -> None:
    """Adds the middleware, the endpoint and the fault the environment arms (if any)."""
    app[FAULT] = [Fault.from_env()]
    app[STOPPING] = asyncio.Event()

    async def release_hung_requests(app: web.Application) -> None:
        app[STOPPING].set()

    app.on_shutdown.append(release_hung_requests)
    app.middlewares.append(fault_middleware)
    app.router.add_post(INJECT_PATH, inject_fault)
