"""The rollout's HTTP client: connections kept from one rollout to the next."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from slime.engine_client.generate import client_session, post_json, run_on_thread_loop


class _Echo(BaseHTTPRequestHandler):
    """Answers every POST with ``{}`` over HTTP/1.1 keep-alive and records the client's port."""

    protocol_version = "HTTP/1.1"
    ports: ClassVar[list[int]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        _Echo.ports.append(self.client_address[1])
        body = json.dumps({}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Echo.ports = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def _one_rollout(url: str) -> bool:
    session, shared = client_session(4)
    for _ in range(3):
        await post_json(session, f"{url}/generate", {"input_ids": [1]})
    if not shared:
        await session.close()
    return shared


def test_rollouts_on_the_thread_loop_reuse_their_connections(echo_url):
    """Two rollouts through ``run_on_thread_loop`` send all six requests over one connection; two
    through plain ``asyncio.run`` get a session each, closed after it, so two connections."""
    results = []

    def rollouts_in_a_thread() -> None:  # a thread of its own, as a rollout-manager call runs in
        results.extend(run_on_thread_loop(_one_rollout(echo_url)) for _ in range(2))

    worker = threading.Thread(target=rollouts_in_a_thread)
    worker.start()
    worker.join()
    assert results == [True, True]
    assert len(_Echo.ports) == 6 and len(set(_Echo.ports)) == 1

    _Echo.ports = []
    assert [asyncio.run(_one_rollout(echo_url)) for _ in range(2)] == [False, False]
    assert len(_Echo.ports) == 6 and len(set(_Echo.ports)) == 2
