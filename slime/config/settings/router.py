"""How slime runs sglang-router, the process in front of the engines (``slime.rollout.router``)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

DEFAULT_REQUEST_TIMEOUT_S = 6 * 3600.0


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    """``--router-request-timeout``: a generation may take this long before the router gives up."""
    extra_args: tuple[str, ...] = ()
    """``--router-extra-args``, split: the user's sglang-router flags, after slime's own."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterSettings:
        return cls(
            request_timeout_s=args.router_request_timeout,
            extra_args=tuple(shlex.split(args.router_extra_args or "")),
        )

    def check(self) -> str | None:
        """Why sglang-router would refuse these flags (its own parser's message), or None; run before
        any process starts, so a typo in ``--router-extra-args`` is one line, not a dead router."""
        import contextlib
        import io

        from sglang_router.launch_router import parse_router_args

        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                parse_router_args(self.argv())
        except SystemExit:
            lines = errors.getvalue().strip().splitlines() or ["refused"]
            return lines[-1].split("error: ", 1)[-1]
        return None

    def argv(self) -> list[str]:
        """The router flags slime decides, then the user's.

        - Health checks and the circuit breaker off: on SGLang ``/health`` is a generation that waits
          while the engine is paused (503 after 20 s), so the router would drop every engine during a
          long train step or while released (``--colocate``). slime's own monitor probes the engines
          and pauses with them (``slime.ray.engine_health``) and takes failed ones out of the router.
        - No retries by the router: under ``--use-fault-tolerance`` the rollout sends a failed request
          again itself, knowing when the rollout aborted; without it, a failed engine ends the run in
          one line. A router retry would also start a timed-out generation again from scratch.
        - A request timeout of hours (``--router-request-timeout``), not 30 minutes: long reasoning
          generations of large models are not errors.
        """
        return [
            "--disable-health-check",
            "--disable-circuit-breaker",
            "--disable-retries",
            "--request-timeout-secs",
            str(max(1, round(self.request_timeout_s))),
            *self.extra_args,
        ]
