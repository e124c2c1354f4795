"""Slow, obvious reference implementations, written independently of softorder's kernels.

Direct O(n^2) sums, bisection for every inverse, dense matrices, central finite differences.
Only NumPy; float64 throughout.
"""

from __future__ import annotations

import numpy as np


def laplace_cdf(z):
    z = np.asarray(z, dtype=np.float64)
    return np.where(
        z <= 0, 0.5 * np.exp(np.minimum(z, 0.0)), 1.0 - 0.5 * np.exp(-np.maximum(z, 0.0))
    )


def lapsum(row, points, alpha):
    """S(points) = sum_i F((points - row_i) / alpha), by the direct sum."""
    row = np.asarray(row, dtype=np.float64)
    points = np.asarray(points, dtype=np.float64)
    return laplace_cdf((points[..., None] - row) / alpha).sum(-1)


def lapsum_inverse(row, w, alpha, iterations=400):
    """Solve S(b) = w by bisection on a bracket that provably contains the root."""
    row = np.asarray(row, dtype=np.float64)
    n = row.size
    w = np.atleast_1d(np.asarray(w, dtype=np.float64))
    lo = np.full(w.shape, row.min() + alpha * (np.log(w / n) - 1.0))
    hi = np.full(w.shape, row.max() - alpha * (np.log((n - w) / n) - 1.0))
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        below = lapsum(row, mid, alpha) < w
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def soft_topk_smallest(row, k, alpha):
    b = lapsum_inverse(row, k, alpha)[0]
    return laplace_cdf((b - np.asarray(row, dtype=np.float64)) / alpha)


def soft_topk(row, k, alpha, largest=True):
    row = np.asarray(row, dtype=np.float64)
    return soft_topk_smallest(-row if largest else row, k, alpha)


def soft_rank(row, alpha):
    row = np.asarray(row, dtype=np.float64)
    return 0.5 + laplace_cdf((row[:, None] - row[None, :]) / alpha).sum(1)


def soft_sort(row, alpha):
    n = np.size(row)
    return lapsum_inverse(row, np.arange(1, n + 1) - 0.5, alpha)


def soft_quantile(row, q, alpha):
    return lapsum_inverse(row, np.asarray(q, dtype=np.float64) * np.size(row), alpha)


def soft_permutation(row, alpha):
    """Dense P[k, i] = F((b_(k+1) - r_i)/alpha) - F((b_k - r_i)/alpha)."""
    row = np.asarray(row, dtype=np.float64)
    n = row.size
    bounds = np.concatenate(
        [[-np.inf], lapsum_inverse(row, np.arange(1, n), alpha) if n > 1 else np.empty(0), [np.inf]]
    )
    z = (bounds[:, None] - row[None, :]) / alpha
    cdfs = laplace_cdf(z)
    # Where both bounds lie above r_i, F = 1 - F(-z) is near 1 and the plain difference loses
    # every digit of a tiny P (e.g. exp(-40)); the difference of the upper tails F(-z) is exact.
    tails = laplace_cdf(-z)
    with np.errstate(invalid="ignore"):  # (inf - inf in the unused branch)
        return np.where(z[:-1] > 0, tails[:-1] - tails[1:], cdfs[1:] - cdfs[:-1])


def topk_cross_entropy_row(logits, label, p_k, alpha):
    total = 0.0
    for k, weight in enumerate(p_k, start=1):
        if weight > 0:
            total += weight * soft_topk(logits, k, alpha, largest=True)[label]
    return -np.log(total)


def topk_cross_entropy_split_row(logits, label, p_k, alpha):
    logits = np.asarray(logits, dtype=np.float64)
    ce = np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[label]
    rest = 0.0
    for k, weight in enumerate(p_k, start=1):
        if k >= 2 and weight > 0:
            rest += weight * soft_topk(logits, k, alpha, largest=True)[label]
    tail = -(1 - p_k[0]) * np.log(rest) if rest > 0 else 0.0
    return p_k[0] * ce + tail


def permutation_cross_entropy_row(x, target_ranks, alpha):
    P = soft_permutation(x, alpha)
    return -sum(np.log(P[t - 1, i]) for i, t in enumerate(target_ranks))


def central_difference(f, x, direction, eps=1e-6):
    """(f(x + eps d) - f(x - eps d)) / (2 eps), elementwise in f's output."""
    x = np.asarray(x, dtype=np.float64)
    return (np.asarray(f(x + eps * direction)) - np.asarray(f(x - eps * direction))) / (2 * eps)
