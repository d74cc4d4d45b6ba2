"""Every HTTP call to an engine is made in ``slime/engine_client/``: no other module of ``slime/`` names an
engine route in code or opens an HTTP client of its own.

Exempt: the engines' own servers (``slime/backends/``, which serve the routes and wait for their own
server), and from the client check the router launcher (``slime/rollout/router.py``, which calls the
router's worker API), the generic JSON client itself (``slime/utils/http.py``) and the remote reward
model client (``slime/rollout/rewards/remote.py``, a reward server, not an engine). Docstrings, help
texts and log lines may name routes; a string that starts with one is a path built for a call.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO

SLIME = REPO / "slime"
CLIENT = SLIME / "engine_client"

ENGINE_ROUTES = (
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/begin_weight_update",
    "/end_weight_update",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/health_generate",
    "/model_info",
    "/server_info",
    "/get_server_info",
    "/v1/loads",
    "/get_load",
    "/v1/models",
)
ROUTE_EXEMPT = ("backends/",)
CLIENT_EXEMPT = (
    "backends/",
    "rollout/router.py",
    "utils/http.py",
    "rollout/rewards/remote.py",
)
HTTP_MODULES = ("aiohttp", "requests", "httpx", "urllib.request", "http.client")
"""Modules whose import (or, for ``aiohttp``, whose session or connector built) is an HTTP client."""
SYNC_CLIENT = ("request_json", "get_json", "post_json_sync", "is_ok")
"""The generic JSON client of ``slime.utils.http``: calling it is making an HTTP call."""


def _modules(under: Path) -> dict[str, ast.Module]:
    return {str(path.relative_to(SLIME)): ast.parse(path.read_text()) for path in sorted(under.rglob("*.py"))}


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes (module, class, function) and of attribute docstrings."""
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                ids.add(id(stmt.value))
    return ids


def _string_literals(tree: ast.Module) -> list[str]:
    """Every string constant of the code (f-string parts included), docstrings left out."""
    docs = _docstrings(tree)
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def _names_route(text: str, route: str) -> bool:
    """``text`` is a path to ``route`` (``"/v1/loads"``, an f-string's ``"/v1/loads?include=core"``),
    not prose that mentions it (a flag's help, a log line)."""
    return text.startswith(route) and not text[len(route) : len(route) + 1].isidentifier()


def _routes_in(tree: ast.Module) -> set[str]:
    return {route for text in _string_literals(tree) for route in ENGINE_ROUTES if _names_route(text, route)}


def _http_clients_in(tree: ast.Module) -> set[str]:
    """What of an HTTP client the module uses: imported client modules, built aiohttp sessions, and
    the generic JSON client's functions."""
    clients = set(HTTP_MODULES) - {"aiohttp"}  # aiohttp's types and errors alone make no call
    builders = ("ClientSession", "TCPConnector", "request")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in clients}
        elif isinstance(node, ast.ImportFrom) and node.module in clients:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.module == "aiohttp":
            found |= {f"aiohttp.{alias.name}" for alias in node.names if alias.name in builders}
        elif isinstance(node, ast.ImportFrom) and node.module == "slime.utils.http":
            found |= {alias.name for alias in node.names if alias.name in SYNC_CLIENT}
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "aiohttp"
            and node.func.attr in builders
        ):
            found.add(f"aiohttp.{node.func.attr}")
    return found


def _exempt(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or (prefix.endswith("/") and name.startswith(prefix)) for prefix in prefixes)


def test_no_module_outside_the_engine_client_names_an_engine_route() -> None:
    modules = _modules(SLIME)
    assert len(modules) > 100, "the scan found too few modules to mean anything"
    offenders = {
        name: sorted(routes)
        for name, tree in modules.items()
        if not name.startswith("engine_client/") and not _exempt(name, ROUTE_EXEMPT)
        if (routes := _routes_in(tree))
    }
    assert offenders == {}, f"engine routes named outside slime/engine_client/: {offenders}"


def test_the_engine_client_names_every_route_it_is_the_home_of() -> None:
    """So that the test above cannot pass by looking for routes nobody writes the way it looks."""
    named = set().union(*(_routes_in(tree) for tree in _modules(CLIENT).values()))
    assert named == set(ENGINE_ROUTES)


def test_no_module_outside_the_engine_client_opens_an_http_client() -> None:
    modules = _modules(SLIME)
    offenders = {
        name: sorted(clients)
        for name, tree in modules.items()
        if not name.startswith("engine_client/") and not _exempt(name, CLIENT_EXEMPT)
        if (clients := _http_clients_in(tree))
    }
    assert offenders == {}, f"HTTP clients outside slime/engine_client/: {offenders}"
    in_client = set().union(*(_http_clients_in(tree) for tree in _modules(CLIENT).values()))
    assert {"aiohttp.ClientSession", "aiohttp.TCPConnector", "request_json", "get_json"} <= in_client
    for exempt in CLIENT_EXEMPT:  # every exemption still names something that exists
        assert (SLIME / exempt).exists(), exempt
