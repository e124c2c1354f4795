"""Laplace-kernel sums between sorted point sets in O(n + m) (math doc section 6).

Every recurrence multiplies by factors ``exp(-gap / alpha) <= 1``, so nothing overflows, and
sums that feed a ratio are taken relative to the nearest point (the ``shift`` of each target)
so that well-separated points give ``0 * finite`` instead of ``0 / 0``. Factors are clamped to
<= 1: a target whose offset is below the float spacing of huge values rounds onto a point, and
the rounded distance must not turn into ``exp(+shift)``.
"""

from __future__ import annotations

import math

from softorder.core._jit import helper
from softorder.core.laplace import gap


@helper
def self_sum(E, c, out):
    """``out[l] = sum_j c[j] exp(-|r[l] - r[j]| / alpha)`` on a sorted row (``E``: prefix_sums)."""
    n = c.shape[0]
    acc = 0.0
    for i in range(n):
        acc = c[i] + E[i] * acc if i > 0 else c[i]
        out[i] = acc
    acc = 0.0
    for i in range(n - 2, -1, -1):
        acc = E[i + 1] * (c[i + 1] + acc)
        out[i] += acc


@helper
def spread_to_points(r, inv_alpha, E, pos, c, shift, order, out):
    """Add ``sum_s c[s] exp(shift[s] - |r[i] - pos[s]| / alpha)`` to ``out[i]`` for every point.

    ``r`` is a sorted row with ``E[i] = exp(-(r[i] - r[i-1]) / alpha)``, ``pos`` the sources
    (targets of the inverse), visited in ascending order ``order``; ``shift[s]`` must not
    exceed the distance of ``pos[s]`` to the row, which keeps every added factor <= 1.
    """
    n = r.shape[0]
    m = order.shape[0]
    acc = 0.0
    p = 0
    for i in range(n):
        if i > 0:
            acc *= E[i]
        while p < m and pos[order[p]] <= r[i]:
            s = order[p]
            if c[s] != 0.0:
                acc += c[s] * math.exp(min(0.0, shift[s] - gap(r[i], pos[s]) * inv_alpha))
            p += 1
        out[i] += acc
    acc = 0.0
    p = m - 1
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            acc *= E[i + 1]
        while p >= 0 and pos[order[p]] > r[i]:
            s = order[p]
            if c[s] != 0.0:
                acc += c[s] * math.exp(min(0.0, shift[s] - gap(pos[s], r[i]) * inv_alpha))
            p -= 1
        out[i] += acc


@helper
def gather_at_targets(r, inv_alpha, E, c, pos, shift, order, out):
    """Add ``sum_i c[i] exp(shift[t] - |pos[t] - r[i]| / alpha)`` to ``out[t]`` for every target.

    The transpose of :func:`spread_to_points`: the accumulator is kept relative to the latest
    point of the row, then scaled to the target by a factor <= 1.
    """
    n = r.shape[0]
    m = order.shape[0]
    acc = 0.0
    i = 0
    for q in range(m):
        t = order[q]
        while i < n and r[i] <= pos[t]:
            if i > 0:
                acc *= E[i]
            acc += c[i]
            i += 1
        if i > 0 and acc != 0.0:
            out[t] += acc * math.exp(min(0.0, shift[t] - gap(pos[t], r[i - 1]) * inv_alpha))
    acc = 0.0
    i = n - 1
    for q in range(m - 1, -1, -1):
        t = order[q]
        while i >= 0 and r[i] > pos[t]:
            if i < n - 1:
                acc *= E[i + 1]
            acc += c[i]
            i -= 1
        if i < n - 1 and acc != 0.0:
            out[t] += acc * math.exp(min(0.0, shift[t] - gap(r[i + 1], pos[t]) * inv_alpha))
