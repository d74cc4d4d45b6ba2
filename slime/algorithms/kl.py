"""KL estimators between the current policy and a reference, per token (Schulman, "Approximating KL
Divergence", 2020). ``log_ratio = log π(a) - log π_ref(a)`` for tokens sampled from π.
"""

from __future__ import annotations

import torch

_LOG_RATIO_CLAMP = 20.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """``k1``: log r; ``k2``: ½ (log r)²; ``k3`` / ``low_var_kl``: (r⁻¹ - 1) + log r, clamped.

    ``low_var_kl`` clamps the log-ratio to ±20 and the estimate to [-10, 10] (as verl and slime do), so
    extreme ratios give a large but finite value instead of inf/NaN.
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        estimate = neg.exp() - 1.0 - neg
        return estimate.clamp(-10.0, 10.0) if kind == "low_var_kl" else estimate
    raise ValueError(f"unknown KL estimator {kind!r}; choose k1, k2, k3 or low_var_kl")
