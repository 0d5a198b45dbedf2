"""Statistics for ``cancelbench trend``: the two-sided Mann-Whitney U test (exact
without ties, tie-corrected normal approximation otherwise), Holm's correction and
bootstrap intervals of a percentile. Hand-written (a few dozen lines) rather than a
scipy dependency; the tests cross-check them against scipy.stats."""

from __future__ import annotations

import math

import numpy as np

from . import stats

def _ranks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average ranks (1-based) and the tie group sizes."""
    order = np.argsort(values, kind="mergesort")
    sorted_v = values[order]
    ranks = np.empty(len(values))
    _, start, counts = np.unique(sorted_v, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return ranks, counts


def _exact_u_cdf_counts(m: int, n: int) -> list[int]:
    """Counts of arrangements per U value (0..m*n): coefficients of the Gaussian binomial
    [m+n choose m]_q, built as prod_i (1 - q^(n+i)) / (1 - q^i), truncated at degree m*n (exact)."""
    deg = m * n
    a = [1] + [0] * deg
    for i in range(1, m + 1):
        j = n + i
        for k in range(deg, j - 1, -1):
            a[k] -= a[k - j]
        for k in range(i, deg + 1):
            a[k] += a[k - i]
    return a


def mann_whitney_u(x, y) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test: (U of x, p-value).  Exact null distribution when there
    are no ties and m*n <= 10000, else the normal approximation with tie and continuity
    correction (as scipy's ``method="auto"`` chooses, with a larger exact range)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    m, n = len(x), len(y)
    if not m or not n:
        raise ValueError("both samples need values")
    ranks, ties = _ranks(np.concatenate([x, y]))
    u = float(ranks[:m].sum() - m * (m + 1) / 2.0)
    big_n = m + n
    if (ties == 1).all() and m * n <= 10_000:
        counts = _exact_u_cdf_counts(min(m, n), max(m, n))
        total = math.comb(big_n, m)
        k = int(round(u))
        low = sum(counts[: k + 1]) / total
        high = sum(counts[k:]) / total
        return u, min(1.0, 2.0 * min(low, high))
    mu = m * n / 2.0
    tie_term = float(((ties ** 3) - ties).sum()) / (big_n * (big_n - 1))
    sigma = math.sqrt(m * n / 12.0 * ((big_n + 1) - tie_term))
    if sigma == 0:
        return u, 1.0
    z = (abs(u - mu) - 0.5) / sigma
    return u, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0)))


def _mwu_impl():
    """The Mann-Whitney U test a trend runs: always this module's, whatever else is installed, so a
    trend's p-values do not depend on the environment (tests/test_trend_stats.py checks it against
    scipy.stats.mannwhitneyu, which the ``test`` extra installs)."""
    return mann_whitney_u, "cancelbench (exact without ties, else normal approximation)"


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone, capped at 1)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def fold_change(rel_change: float | None) -> float:
    """A change as a fold, the same either way: +100% and -50% are both 2x."""
    if rel_change is None:
        return 1.0
    ratio = 1.0 + rel_change
    return math.inf if ratio <= 0 else max(ratio, 1.0 / ratio)


def _interval(sorted_values: np.ndarray, p: float, rng: np.random.Generator, n_boot: int,
              confidence: float) -> tuple[float, float]:
    reps = np.sort(stats.bootstrap_percentiles(sorted_values, p, n_boot, rng))
    a = (1.0 - confidence) / 2.0
    return stats.nearest_rank(reps, a), stats.nearest_rank(reps, 1.0 - a)


