"""Order statistics for latency cells: nearest-rank percentiles, minimum
sample counts, the LoadGen-style early-stopping test, and a seeded bootstrap
confidence interval for the change of a percentile between two samples.

Everything here is a pure function of numpy arrays, so the pandas and the
Ray Data paths produce bit-identical numbers.

Nearest rank
------------
The p-th percentile (0 < p <= 1) of n sorted samples x(1) <= ... <= x(n) is
x(ceil(p * n)): always an observed value, never an interpolation.

Minimum counts
--------------
Reporting a percentile from too few samples shows the sample maximum under
another name.  We show the p-th percentile only when n >= ceil(ln(1-c)/ln(p)):
with that many samples, the chance that *all* of them fall below the true
p-quantile is p**n <= 1 - c, so the sample maximum is an upper confidence
bound (confidence c) on the true p-quantile.  At c = 0.95:
p50 -> 5, p90 -> 29, p99 -> 299.  This is the zero-failure case of the
binomial test MLPerf LoadGen uses for early stopping (``early_stop_ok``).
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_CONFIDENCE = 0.95
PERCENTILES = (0.50, 0.90, 0.99)


def min_samples(p: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """Smallest n with p**n <= 1 - confidence (see module doc)."""
    if not 0.0 < p < 1.0 or not 0.0 < confidence < 1.0:
        raise ValueError("p and confidence must lie in (0, 1)")
    # Round before ceil so that exact cases (e.g. p=0.5, c=0.75 -> 2) are not pushed up by float noise.
    return int(math.ceil(round(math.log(1.0 - confidence) / math.log(p), 9)))


def nearest_rank_index(n: int, p: float) -> int:
    """0-based index of the nearest-rank p-th percentile among n sorted values."""
    if n <= 0:
        raise ValueError("no samples")
    return max(0, min(n - 1, int(math.ceil(round(p * n, 9))) - 1))


def nearest_rank(sorted_values: np.ndarray, p: float) -> float:
    """Nearest-rank percentile of an already sorted array."""
    return float(sorted_values[nearest_rank_index(len(sorted_values), p)])


def percentile(values, p: float) -> float | None:
    """Nearest-rank p-th percentile (p in (0, 1]) of unsorted values; None when empty."""
    arr = np.sort(np.asarray(list(values), dtype=float))
    return nearest_rank(arr, p) if len(arr) else None


def binom_cdf(k: int, n: int, q: float) -> float:
    """P(Binomial(n, q) <= k), summed in log space (no scipy needed)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if q <= 0.0:
        return 1.0
    if q >= 1.0:
        return 0.0
    lq, l1q = math.log(q), math.log1p(-q)
    lg_n1 = math.lgamma(n + 1)
    terms = [lg_n1 - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lq + (n - i) * l1q for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


def early_stop_ok(n: int, n_over: int, p: float, confidence: float = DEFAULT_CONFIDENCE) -> bool:
    """LoadGen-style early stopping: with ``n_over`` of ``n`` samples over the
    bound, can we claim the true p-th percentile is within the bound at this
    confidence?  If it were not, each sample would exceed the bound with
    probability >= 1-p, and seeing at most ``n_over`` exceedances would have
    probability <= BinomCDF(n_over; n, 1-p).  We claim the bound is met when
    that probability is <= 1 - confidence.  With n_over = 0 this is exactly
    n >= min_samples(p, confidence)."""
    if n <= 0:
        return False
    if confidence >= 0.5 and n_over >= math.ceil(n * (1.0 - p)):
        return False  # n_over is at or above the binomial median: CDF >= 0.5 >= 1 - confidence
    # Rounded like min_samples: exact cases (p=0.5, c=0.875, n=3: 0.125 vs 0.125) must not fail on float noise.
    return round(binom_cdf(n_over, n, 1.0 - p), 12) <= round(1.0 - confidence, 12)


def percentile_interval(values, p: float, confidence: float = DEFAULT_CONFIDENCE
                        ) -> tuple[float | None, float | None] | None:
    """Distribution-free confidence interval for the true p-quantile: order statistics
    (x(l), x(u)) with P(x(l) <= q_p <= x(u)) >= confidence, from the binomial count of
    samples below the quantile, split evenly between the two tails. A side that n
    samples cannot bound is None (a p99 from 20 samples has no upper bound: the
    sample maximum is not one). None when there are no samples."""
    arr = np.sort(np.asarray(list(values), dtype=float))
    n = len(arr)
    if not n:
        return None
    tail = (1.0 - confidence) / 2.0
    # lower: the largest l with P(B <= l - 1) <= tail, B ~ Binomial(n, p) samples below q_p
    lo = max((l for l in range(1, n + 1) if binom_cdf(l - 1, n, p) <= tail), default=None)
    # upper: the smallest u with P(B <= u - 1) >= 1 - tail
    up = min((u for u in range(1, n + 1) if binom_cdf(u - 1, n, p) >= 1.0 - tail), default=None)
    return (float(arr[lo - 1]) if lo else None, float(arr[up - 1]) if up else None)


def bootstrap_percentiles(sorted_values: np.ndarray, p: float, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap replicates of the nearest-rank p-th percentile.

    Resampling n values with replacement and taking the k-th smallest
    (k = ceil(p n)) is the same as taking x(ceil(n U)) where U is the k-th
    order statistic of n uniforms, U ~ Beta(k, n - k + 1).  Drawing U directly
    gives the exact bootstrap distribution in O(n_boot) instead of
    O(n_boot * n), so cells with 10^5 samples cost nothing."""
    n = len(sorted_values)
    k = nearest_rank_index(n, p) + 1
    u = rng.beta(k, n - k + 1, size=n_boot)
    idx = np.clip(np.ceil(u * n).astype(np.int64) - 1, 0, n - 1)
    return sorted_values[idx]


def bootstrap_resample_percentiles(values: np.ndarray, p: float, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """The textbook bootstrap (resample, sort, pick) -- used in tests to check
    ``bootstrap_percentiles`` against it."""
    n = len(values)
    k = nearest_rank_index(n, p)
    draws = rng.integers(0, n, size=(n_boot, n))
    return np.partition(values[draws], k, axis=1)[:, k]


def bootstrap_diff_ci(
    base_sorted: np.ndarray,
    cand_sorted: np.ndarray,
    p: float,
    *,
    n_boot: int = 4000,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap CI for (candidate p-th percentile - baseline p-th
    percentile), samples resampled independently, seeded for reproducibility."""
    rng = np.random.default_rng(seed)
    b = bootstrap_percentiles(base_sorted, p, n_boot, rng)
    c = bootstrap_percentiles(cand_sorted, p, n_boot, rng)
    diff = np.sort(c - b)
    alpha = (1.0 - confidence) / 2.0
    return nearest_rank(diff, alpha) if alpha > 0 else float(diff[0]), nearest_rank(diff, 1.0 - alpha)


def percentile_label(p: float) -> str:
    return f"p{round(p * 100, 6):g}"
