"""The maths of evaluation (``slime.utils.stats``): the unbiased pass@k and the Student-t interval.

Every expected number is worked out by hand, or read from a printed t table, next to it.
"""

from __future__ import annotations

import math

import pytest

from slime.utils.stats import Interval, mean_interval, pass_at_k, pass_at_k_ks, t_cdf, t_quantile

# n = 4 samples, c correct: pass@k = 1 - C(4 - c, k) / C(4, k), with C(4, 1) = 4, C(4, 2) = 6, C(4, 4) = 1.
PASS_AT_K_N4 = {
    (0, 1): 0.0, (0, 2): 0.0, (0, 4): 0.0,  # nothing correct: every k fails
    (1, 1): 1 / 4, (1, 2): 1 - 3 / 6, (1, 4): 1.0,  # C(3, 2) = 3 pairs without the correct one
    (2, 1): 2 / 4, (2, 2): 1 - 1 / 6, (2, 4): 1.0,  # C(2, 2) = 1 pair of the two wrong ones
    (3, 1): 3 / 4, (3, 2): 1.0, (3, 4): 1.0,  # one wrong sample cannot fill a pair
    (4, 1): 1.0, (4, 2): 1.0, (4, 4): 1.0,
}  # fmt: skip


@pytest.mark.parametrize(("c", "k"), sorted(PASS_AT_K_N4))
def test_pass_at_k_matches_the_binomial_formula_by_hand(c: int, k: int) -> None:
    assert pass_at_k(4, c, k) == pytest.approx(PASS_AT_K_N4[c, k], abs=1e-15)


def test_pass_at_k_stays_finite_where_the_binomials_overflow() -> None:
    # C(2000, 1000) ~ 1e600 is no float; pass@1 is c / n whatever n is, and one wrong sample out of
    # 2000 leaves C(1, 1000) = 0 subsets without a correct one.
    assert pass_at_k(2000, 500, 1) == pytest.approx(0.25, abs=1e-12)
    assert pass_at_k(2000, 1999, 1000) == 1.0
    # c = 1: 1 - C(1999, 1000) / C(2000, 1000) = 1 - 1000 / 2000
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 8)


def test_pass_at_k_is_logged_for_powers_of_two_up_to_n() -> None:
    assert [pass_at_k_ks(n) for n in (1, 2, 3, 4, 6, 8)] == [
        [1],
        [1, 2],
        [1, 2],
        [1, 2, 4],
        [1, 2, 4],
        [1, 2, 4, 8],
    ]


def test_t_quantiles_match_the_tables() -> None:
    # Student's t, two-sided 95 % (upper 0.975) critical values as every table prints them.
    table = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 10: 2.2281, 30: 2.0423, 1000: 1.9623}
    for df, value in table.items():
        assert t_quantile(0.975, df) == pytest.approx(value, abs=5e-5), df
    assert t_quantile(0.025, 4) == -t_quantile(0.975, 4)
    # df = 1 is the Cauchy distribution and df = 2 has a closed form: both checkable exactly.
    assert t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-15)
    assert t_cdf(1.0, 2) == pytest.approx(0.5 + 1 / (2 * math.sqrt(3)), abs=1e-15)


def test_the_interval_is_mean_plus_minus_t_times_the_standard_error() -> None:
    # [0, 1, 1]: mean 2/3, sample variance ((2/3)² + 2 (1/3)²) / 2 = 1/3, standard error
    # sqrt(1/3) / sqrt(3) = 1/3, half width t(0.975, 2) / 3 = 4.302653 / 3 = 1.434218.
    interval = mean_interval([0.0, 1.0, 1.0])
    assert interval.mean == pytest.approx(2 / 3)
    assert interval.low == pytest.approx(2 / 3 - 1.434218, abs=1e-6)
    assert interval.high == pytest.approx(2 / 3 + 1.434218, abs=1e-6)
    # [1, 2, 3, 4]: mean 2.5, variance 5/3, standard error sqrt(5/12) = 0.645497, t(0.975, 3) = 3.182446.
    interval = mean_interval([1.0, 2.0, 3.0, 4.0])
    assert (interval.low, interval.high) == pytest.approx((2.5 - 2.054260, 2.5 + 2.054260), abs=1e-6)
    assert mean_interval([0.5, 0.5]) == Interval(0.5, 0.5, 0.5)  # prompts that agree: zero width
    assert mean_interval([0.7]) is None  # one prompt says nothing about the spread between prompts
