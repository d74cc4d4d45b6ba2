"""The sglang-router in front of the engines: a real router process, engines added and removed at run time.

Facts about sglang-router 0.3.2 this module relies on (measured; docs/architecture.md, "Measured
facts the code relies on"):

- ``python -m sglang_router.launch_router`` starts with no ``--worker-urls`` and answers
  ``GET /health`` at once. It also binds a Prometheus exporter (default port 29000), so each router
  gets its own free ``--prometheus-port`` or a second router on the node fails.
- ``POST /workers {"url"}`` answers 202 with a ``worker_id`` and adds the worker in the
  background: it needs ``GET /health`` = 200 from the worker and reads ``/get_model_info`` and
  ``/get_server_info``. ``GET /workers/<id>`` shows ``is_healthy`` and the job's status; a worker
  that never answers stays "processing" (the router keeps retrying), so the caller bounds the wait.
  It probes HTTP and gRPC side by side (no request field turns that off), so an HTTP-only engine
  sees, and may log, two malformed requests (an HTTP/2 preface) per registration.
- ``DELETE /workers/<id>`` (a UUID) answers 202 and removes in the background; ``GET /workers``
  lists ``{"workers": [{"id", "url", "is_healthy", "load", "model_id", ...}]}``.
- The router re-serializes ``/generate``: ``input_ids``, ``sampling_params`` (temperature, top_p,
  top_k, max_new_tokens, min_new_tokens, stop, stop_token_ids, skip_special_tokens, no_stop_trim,
  sampling_seed), ``return_logprob``, ``logprob_start_len``, ``return_text_in_logprobs`` and ``rid``
  reach the engine; an engine's 400 (e.g. prompt + max_new_tokens over the context) comes back
  unchanged, not retried. A batch (a list of ``input_ids``) passes to one engine with one
  ``sampling_params`` map and a string rid; a list of either is refused with HTTP 422 ("Failed to
  deserialize the JSON body"), so the inputs of a batch cannot carry a seed each.
- With no worker, ``/generate`` is 503 ``no_available_workers``; so is it when every worker failed
  the router's own health checks (``GET /health`` every 60 s by default, unhealthy after 3 failures,
  back after 2 successes) or opened its circuit breaker (10 failures).
- ``--disable-health-check`` still probes ``GET /health`` once, when a worker is added (a worker
  answering 503 then is never added), and never again (measured with a worker whose ``/health``
  turned 503 after it was added: still listed healthy and routed to).
- Defaults that do not suit RL (``launch_router --help``): requests time out after 1800 s
  (``--request-timeout-secs``) and failed ones are sent again up to 5 times by the router itself.
- SIGTERM waits up to ``--shutdown-grace-period-secs`` (default 180) for requests in flight.
- The worker's model path must be a local absolute path (the engines report the resolved
  ``--hf-checkpoint``); otherwise the router tries to fetch a tokenizer from the hub.
- ``--api-key K`` makes the router demand ``Authorization: Bearer K`` of its own clients
  (``/workers``, ``/generate``: 401 without; ``/health`` stays open); it does not send K to workers.
  A worker's key is its own field, ``POST /workers {"url", "api_key"}``: with it the router reads the
  worker's model info and sends the key with every request it routes there (without it, it warns and
  only passes on the client's own ``Authorization`` header).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from slime.config.settings.router import RouterSettings
from slime.utils.http import (
    HttpError,
    ServerProcess,
    ServerStartError,
    engine_api_key,
    free_port,
    get_json,
    is_ok,
    request_json,
)

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5


def list_workers(router_url: str) -> list[dict[str, Any]]:
    """The workers a running router routes to (id, url, is_healthy, load, ...); any process may ask."""
    workers: list[dict[str, Any]] = get_json(f"{router_url}/workers")["workers"]
    return workers


def engine_urls(router_url: str) -> list[str]:
    """The engines the router routes to right now."""
    return [worker["url"] for worker in list_workers(router_url)]


class RouterError(RuntimeError):
    """The router refused or did not finish a worker change in time."""


class Router:
    """One sglang-router process with round-robin routing; starts with no worker."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        log_level: str = "warn",
        settings: RouterSettings | None = None,
    ):
        self.host = host
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        argv = [sys.executable, "-m", "sglang_router.launch_router"]
        argv += ["--host", host, "--port", str(self.port), "--policy", "round_robin"]
        argv += ["--prometheus-host", host, "--prometheus-port", str(free_port())]
        argv += ["--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S), "--log-level", log_level]
        argv += (settings or RouterSettings()).argv()
        if key := engine_api_key():  # the run's engines have a key: so has the router, for its clients
            argv += ["--api-key", key]
        self.server = ServerProcess("sglang-router", argv, Path(log_dir) / "router.log", dict(os.environ))

    @property
    def pid(self) -> int | None:
        return self.server.pid

    def start(self, timeout_s: float = 60.0) -> str:
        """Starts the router and waits for ``/health``; returns its URL."""
        self.server.start()
        try:
            self.server.wait_ready(lambda: is_ok(f"{self.url}/health", timeout=2), timeout_s, interval_s=0.1)
        except ServerStartError as exc:
            raise RouterError(str(exc)) from None
        return self.url

    def workers(self) -> list[dict[str, Any]]:
        """The registered workers as the router lists them (id, url, is_healthy, load, ...)."""
        return list_workers(self.url)

    def worker_urls(self) -> list[str]:
        return [worker["url"] for worker in self.workers()]

    def add_worker(self, url: str, timeout_s: float = 60.0) -> str:
        """Registers an engine and waits until the router routes to it; returns the worker id."""
        key = engine_api_key()  # the router sends it with every request it routes to this engine
        worker = {"url": url, "api_key": key} if key else {"url": url}
        reply = request_json("POST", f"{self.url}/workers", worker)
        worker_id: str = reply["worker_id"]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = get_json(f"{self.url}/workers/{worker_id}")
            except HttpError as exc:
                if exc.status != 404:  # 404: the job has not created the worker record yet
                    raise
                info = {}
            if info.get("is_healthy") and url in self.worker_urls():
                return worker_id
            job = info.get("job_status") or {}
            if job.get("status") == "failed":
                raise RouterError(f"the router could not add {url}: {job.get('message')}")
            if time.monotonic() >= deadline:
                self._delete(worker_id)
                raise RouterError(
                    f"the router did not accept {url} within {timeout_s:.0f} s (job: {job or 'unknown'}); "
                    f"is GET {url}/health 200? router log: {self.server.log_path}"
                )
            time.sleep(0.1)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Unregisters an engine; returns once the router no longer lists it (no new request goes there)."""
        ids = [worker["id"] for worker in self.workers() if worker["url"] == url]
        if not ids:
            raise RouterError(f"{url} is not registered with the router {self.url}")
        for worker_id in ids:
            self._delete(worker_id)
        deadline = time.monotonic() + timeout_s
        while url in self.worker_urls():
            if time.monotonic() >= deadline:
                raise RouterError(f"the router still lists {url} {timeout_s:.0f} s after removing it")
            time.sleep(0.05)

    def _delete(self, worker_id: str) -> None:
        request_json("DELETE", f"{self.url}/workers/{worker_id}")

    def shutdown(self) -> None:
        """Stops the router process (requests in flight get ``SHUTDOWN_GRACE_S`` to finish)."""
        self.server.stop(grace_s=SHUTDOWN_GRACE_S + 5)
