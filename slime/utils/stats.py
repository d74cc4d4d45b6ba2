"""Evaluation statistics: the unbiased pass@k estimator and a confidence interval over prompts.

Pure Python (no SciPy: the project does not depend on it, and the one quantile it needs has a closed
form), so the evaluation path and its tests need nothing but the standard library.

Why a Student-t interval over per-prompt values: the prompts of an eval set are the independent
draws (the samples of one prompt are correlated: they share it), so each prompt contributes one
value (its mean reward, or its pass@k estimate) and the interval is the mean of those values
± t(0.975, P - 1) · s / √P over P prompts (Miller, "Adding Error Bars to Evals", 2024, §2). It is
deterministic, costs nothing, and each bound can be checked by hand; a bootstrap would need a seed
and a loop for a result that, for the tens to thousands of prompts of an eval set, is the same. It
has the t-interval's known weakness: when every prompt scores the same (all 0 or all 1) it has zero
width, which says the prompts agree, not that the mean is known exactly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (``k <= n``).

    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code"), computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``: the binomials overflow a float
    long before n is large, the product of numbers in [0, 1] never does.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_ks(n: int) -> list[int]:
    """The k that are logged for ``n`` samples per prompt: 1, 2, 4, ... up to ``n``."""
    return [2**e for e in range(n.bit_length()) if 2**e <= n]


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided ``CONFIDENCE`` interval."""

    mean: float
    low: float
    high: float

    def clipped(self, low: float, high: float) -> Interval:
        """The interval cut to ``[low, high]``: for a probability, bounds past 0 and 1 say nothing."""
        return Interval(self.mean, max(self.low, low), min(self.high, high))


def mean_interval(values: Sequence[float]) -> Interval | None:
    """The mean of ``values`` (one per prompt) with its Student-t ``CONFIDENCE`` interval.

    None for fewer than two values: one prompt says nothing about the spread between prompts.
    """
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile((1 + CONFIDENCE) / 2, n - 1) * std / math.sqrt(n)
    return Interval(mean, mean - half, mean + half)


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` (a positive integer) degrees of freedom.

    Bisection on the exact CDF; cached, as an evaluation asks for the same one per metric.
    """
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2 * high
    for _ in range(100):
        mid = (low + high) / 2
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def t_cdf(t: float, df: int) -> float:
    """Student's t CDF for integer ``df``, from the finite series of Abramowitz & Stegun 26.7.3-4.

    With θ = atan(t / √df), P(|T| <= t) is ``sin θ · (1 + ½cos²θ + (1·3)/(2·4)cos⁴θ + ...)`` for even
    df and ``(2/π)(θ + sin θ cos θ · (1 + ⅔cos²θ + (2·4)/(3·5)cos⁴θ + ...))`` for odd df, each with
    ⌈df/2⌉ - 1 terms after the first (none for df = 1).
    """
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    term = series = 1.0
    if df % 2 == 0:
        for j in range(1, df // 2):
            term *= (2 * j - 1) / (2 * j) * cos2
            series += term
        two_sided = math.sin(theta) * series
    else:
        for j in range(1, (df - 1) // 2):
            term *= (2 * j) / (2 * j + 1) * cos2
            series += term
        tail = math.sin(theta) * math.cos(theta) * series if df > 1 else 0.0
        two_sided = 2 / math.pi * (theta + tail)
    return (1 + two_sided) / 2
