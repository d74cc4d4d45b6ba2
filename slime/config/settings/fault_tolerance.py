"""What a run does when a part of it fails: engine probes and restarts, request retries, trainer resume."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class FaultToleranceSettings:
    enabled: bool
    """``--use-fault-tolerance``: probe the engines, restart failed ones, retry their requests."""
    health_check_interval_s: float
    health_check_timeout_s: float
    health_check_first_wait_s: float
    request_retries: int
    """``--rollout-request-retries``: sends of a request an engine failed before the rollout stops."""
    auto_resume: int
    """``--auto-resume``: restarts of the run from its last checkpoint after a trainer failure."""
    trainer_call_timeout_s: float
    """``--trainer-call-timeout``: one call to the trainer ranks may take this long (0: no limit)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultToleranceSettings:
        return cls(
            enabled=bool(args.use_fault_tolerance),
            health_check_interval_s=float(args.rollout_health_check_interval),
            health_check_timeout_s=float(args.rollout_health_check_timeout),
            health_check_first_wait_s=float(args.rollout_health_check_first_wait),
            request_retries=int(args.rollout_request_retries),
            auto_resume=int(args.auto_resume),
            trainer_call_timeout_s=float(args.trainer_call_timeout),
        )
