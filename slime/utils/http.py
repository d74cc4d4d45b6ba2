"""HTTP servers this process starts, and the small JSON client that talks to them.

Engines and the router are separate server processes that slime starts and must never leave behind:
``ServerProcess`` is the one place that knows how to start such a process (own process group, log
file, killed with its parent), wait until it answers, tell why it did not (the tail of its log), and
stop it. The JSON helpers are synchronous (standard library); the calls to engines, and the rollout's
async transport, are ``slime.engine_client``'s.

Every client here sends the run's engine key (``engine_api_key``), when the run has one, as SGLang's
``--api-key`` expects it: ``Authorization: Bearer <key>``. A run that is not confined to loopback has
one (``slime.ray.cluster.start_ray`` makes it), so no other host can drive its engines.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOG_TAIL_LINES = 20

ENGINE_API_KEY_ENV = "SLIME_ENGINE_API_KEY"
"""The environment variable that carries the run's engine key to every process of the run (the driver
sets it; actors inherit it, or on a joined cluster get it from Ray's job runtime_env; servers inherit
it). An environment variable,
not a field of ``args``: the args namespace is logged (wandb config), the key must never be."""

SECRET_FLAGS = ("--api-key", "--admin-api-key")
"""Server flags whose value is a secret: kept out of the command line a ``ServerProcess`` logs."""


def engine_api_key() -> str | None:
    """The run's engine key (SGLang's ``--api-key``, sglang-router's ``--api-key``), None without one."""
    return os.environ.get(ENGINE_API_KEY_ENV) or None


def auth_headers() -> dict[str, str]:
    """The header that authenticates a request to this run's engines; empty when the run has no key."""
    key = engine_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the values of ``SECRET_FLAGS`` (``--api-key K`` or ``--api-key=K``) replaced."""
    redacted, hide_next = [], False
    for token in argv:
        flag, eq, _ = token.partition("=")
        if hide_next:
            token = "<redacted>"
        elif eq and flag in SECRET_FLAGS:
            token = f"{flag}=<redacted>"
        redacted.append(token)
        hide_next = token in SECRET_FLAGS
    return redacted


class HttpError(RuntimeError):
    """A non-2xx answer; ``status`` is the HTTP status, the message holds the server's own words."""

    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        super().__init__(f"{method} {url} answered HTTP {status}: {body.strip()[:2000]}")
        self.status = status
        self.body = body


class ServerStartError(RuntimeError):
    """A server process that exited or never answered; the message ends with the tail of its log."""


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _below_ephemeral_ports() -> range:
    """Ports under the kernel's ephemeral range, which outgoing connections never take as their own."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return range(max(1024, low - 12000), low)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nobody listens on right now, on any address (the server binds it a moment later).

    Probing every interface matters: a port free on the node IP may be taken on 127.0.0.1, and a
    TCPStore (torch.distributed's rendezvous) listens on all interfaces. The port is drawn below the
    ephemeral range: a port the kernel hands out (bind to 0) is also what it gives the next outgoing
    connection of any process, and one did take a trainer's rendezvous port between the draw and
    the bind (EADDRINUSE, seen on a busy 2-core machine).
    """
    candidates = _below_ephemeral_ports()
    # Not the global RNG: the trainers seed it, and every process would then try the same ports.
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        if _bindable(port):
            return port
    with socket.socket() as sock:  # every candidate taken: let the kernel pick
        sock.bind(("", 0))
        return sock.getsockname()[1]


def listening_socket_fd(host: str, port: int) -> int:
    """The file descriptor of a socket listening on ``host:port`` alone, for torch's ``TCPStore``
    (``master_listen_fd``): given only a port, its server listens on every interface (``::``), so a
    rendezvous on 127.0.0.1 would still answer the whole network."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family).detach()


def request_json(method: str, url: str, payload: Any = None, timeout: float = 30.0) -> Any:
    """One JSON call; returns the decoded answer (the raw text when it is not JSON, None when empty).

    Raises ``HttpError`` for a non-2xx answer and ``OSError`` (``URLError``) when nothing answers.
    """
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    headers.update(auth_headers())
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            body = response.read().decode()
    except urllib.error.HTTPError as exc:
        raise HttpError(method, url, exc.code, exc.read().decode(errors="replace")) from None
    if not body:
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


def get_json(url: str, timeout: float = 30.0) -> Any:
    return request_json("GET", url, timeout=timeout)


def post_json_sync(url: str, payload: Any = None, timeout: float = 30.0) -> Any:
    return request_json("POST", url, {} if payload is None else payload, timeout=timeout)


def is_ok(url: str, timeout: float = 5.0) -> bool:
    """True when ``GET url`` answers 2xx; any error (refused, timeout, 5xx) is False."""
    try:
        request_json("GET", url, timeout=timeout)
    except (OSError, HttpError, TimeoutError):
        return False
    return True


GROUP_EXIT_S = 2.0
"""How long ``ServerProcess.stop`` lets the rest of a server's group end by itself after the server."""


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies hold nothing and do not count: an orphan's
    waits for init to reap it, which some container inits never do. Without /proc: False."""
    try:
        entries = os.listdir("/proc")
    except FileNotFoundError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                state, _ppid, group = stat.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != b"Z":
            return True
    return False


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the process that started it dies.

    Ray kills actors with SIGKILL, which runs no atexit hook and no signal handler; this is what
    keeps an engine or router from outliving its actor then. Linux ties the signal to the *thread*
    that started the child, so servers are started from long-lived threads (an actor's own).
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class ServerProcess:
    """One server subprocess: its own process group, output in a log file, stopped as a group.

    ``start`` also registers the process for ``stop_all_servers`` (atexit and SIGTERM of this
    process), so a normal exit or a polite kill leaves no orphan either.
    """

    def __init__(self, name: str, argv: list[str], log_path: str | os.PathLike[str], env: dict[str, str]):
        self.name = name
        self.argv = argv
        self.log_path = Path(log_path)
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exit_code(self) -> int | None:
        """The exit status once the process has exited (negative: the signal that ended it), else None."""
        return None if self.proc is None else self.proc.poll()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(redact_argv(self.argv))}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: stop() reaches its children too
                preexec_fn=_die_with_parent,
            )
        _register(self)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(deque(log, maxlen=lines)).rstrip()
        except OSError:
            return "(no log)"

    def fail(self, what: str) -> ServerStartError:
        """An error naming the server, what went wrong, its log file and the last lines of that log."""
        return ServerStartError(f"{self.name} {what}; log {self.log_path}, last lines:\n{self.log_tail()}")

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float, interval_s: float = 0.25) -> None:
        """Polls ``probe`` until it is True; raises (and stops the server) on exit or timeout."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise self.fail(f"exited with status {self.proc.returncode} before it was ready")
            if probe():
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise self.fail(f"was not ready within {timeout_s:.0f} s")
            time.sleep(interval_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the server, SIGKILL to what is left of its group; safe to call twice.

        Only the server's own process gets the SIGTERM: a server of several processes shuts its
        children down itself, in order (SGLang's tokenizer manager has its schedulers exit, then kills
        the rest). A SIGTERM to the whole group ended those children first, without their exit
        handlers, so what they had made (semaphores in /dev/shm) stayed. Once the server has exited,
        the rest of its group gets up to ``GROUP_EXIT_S`` (within ``grace_s``) to end by itself:
        multiprocessing's resource tracker unlinks what dead processes left when the last of them has
        gone. Then, or when the server outlives ``grace_s``, the whole group is SIGKILLed.
        """
        proc = self.proc
        if proc is None:
            return
        deadline = time.monotonic() + grace_s
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        # Children of the server may outlive it; the group id is the server's pid.
        settled = min(deadline, time.monotonic() + GROUP_EXIT_S)
        while _group_running(proc.pid) and time.monotonic() < settled:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        _RUNNING.pop(id(self), None)


_RUNNING: dict[int, ServerProcess] = {}
_hooks_installed = False


def stop_all_servers(grace_s: float = 5.0) -> None:
    """Stops every server this process started and has not stopped yet."""
    for server in list(_RUNNING.values()):
        with contextlib.suppress(Exception):
            server.stop(grace_s)


def _register(server: ServerProcess) -> None:
    global _hooks_installed
    _RUNNING[id(server)] = server
    if _hooks_installed:
        return
    _hooks_installed = True
    import atexit

    atexit.register(stop_all_servers)
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        stop_all_servers()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    # Signal handlers can only be set from the main thread; elsewhere atexit and the parent-death
    # signal still apply.
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, on_sigterm)
