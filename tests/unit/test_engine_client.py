"""The client side of SGLang's HTTP protocol, on the reply shapes of the real releases (no server).

Shapes from the SGLang wheels: ``/v1/loads`` (``srt/entrypoints/v1_loads.py``, 0.5.19-0.5.23),
``/get_load`` (``srt/entrypoints/http_server.py``, 0.5.19-0.5.20), a refusal's body
(``{"success": false, "message"}`` or an ``ErrorResponse``).
"""

from __future__ import annotations

import pickle

from slime.engine_client.calls import EngineCallError, _message_of
from slime.engine_client.control import requests_in_get_load, requests_in_loads


def test_load_replies_of_both_endpoints_count_running_and_waiting_requests() -> None:
    v1_loads = {
        "timestamp": "2026-12-01T10:00:00+00:00",
        "version": "0.5.23",
        "accelerator": "NVIDIA H100",
        "num_accelerators": 2,
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 900},
            {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 100},
        ],
    }
    assert requests_in_loads(v1_loads) == 6
    get_load = [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 900, "num_pending_tokens": 0},
        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 100, "num_pending_tokens": 0},
    ]
    assert requests_in_get_load(get_load) == 6
    assert requests_in_loads({**v1_loads, "loads": []}) == 0


def test_a_refusal_names_the_engine_and_keeps_its_words_across_processes() -> None:
    message = _message_of('{"success": false, "message": "update_weights_from_tensor must run between x"}')
    error = EngineCallError("http://10.0.0.5:30000", "/update_weights_from_tensor", message, 400)
    line = str(error)
    assert line == (
        "engine http://10.0.0.5:30000 refused /update_weights_from_tensor (HTTP 400): "
        "update_weights_from_tensor must run between x"
    )
    copy = pickle.loads(pickle.dumps(error))  # Ray pickles exceptions between actors
    assert str(copy) == line and copy.status == 400 and copy.url == error.url
    assert _message_of('{"object": "error", "message": "bad selector", "code": 400}') == "bad selector"
    assert _message_of('{"error": {"message": "Either text or input_ids"}}') == "Either text or input_ids"
    assert _message_of("Internal Server Error") == "Internal Server Error"


def test_free_ports_are_drawn_below_the_ephemeral_range_and_are_free() -> None:
    """Outgoing connections take their local ports from the ephemeral range; a port drawn there
    could be taken between the draw and the server's bind."""
    import socket

    from slime.utils.http import _below_ephemeral_ports, free_port

    ports = {free_port() for _ in range(20)}
    assert ports <= set(_below_ephemeral_ports()) and len(ports) > 1
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("", port))
