"""Laplace-kernel sums between sorted point sets in O(n + m) (math doc section 6).

Every recurrence multiplies by factors ``exp(-gap / alpha) <= 1``, so nothing overflows, and
sums that feed a ratio are taken relative to the nearest point (the ``shift`` of each target)
so that well-separated points give ``0 * finite`` instead of ``0 / 0``. Targets enter with their
exact offsets from an anchor point (their rounded values only decide the merge order), and
factors are clamped to <= 1 against rounding.
"""

from __future__ import annotations

from softorder.core._jit import helper
from softorder.core.laplace import exp_nonpositive, offset_z


@helper
def spread_to_points(r, inv_alpha, E, anchor, offset, c, shift, order, out):
    """Add ``sum_s c[s] exp(shift[s] - |r[i] - b_s| / alpha)`` to ``out[i]`` for every point.

    ``r`` is a sorted row with ``E[i] = exp(-(r[i] - r[i-1]) / alpha)``; the sources are targets
    of the inverse, ``b_s = r[anchor[s]] + alpha offset[s]``, visited in ascending order
    ``order``. Each source joins the two passes at its neighbouring points with its exact
    standardized distance (from anchor and offset; never from a rounded ``b_s``, which next to
    huge values can land on the wrong side of a point), then travels by the factors ``E``.
    ``shift[s]`` must not exceed the distance of ``b_s`` to the row, which keeps every added
    factor <= 1.
    """
    n = r.shape[0]
    m = order.shape[0]
    acc = 0.0
    p = 0
    for i in range(n):
        if i > 0:
            acc *= E[i]
        while p < m:
            s = order[p]
            z = offset_z(r[anchor[s]], r[i], inv_alpha, offset[s])
            if z > 0.0:  # b_s above r[i]: joins later
                break
            if c[s] != 0.0:
                acc += c[s] * exp_nonpositive(shift[s] + z)
            p += 1
        out[i] += acc
    acc = 0.0
    p = m - 1
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            acc *= E[i + 1]
        while p >= 0:
            s = order[p]
            z = offset_z(r[anchor[s]], r[i], inv_alpha, offset[s])
            if z <= 0.0:  # b_s at or below r[i]: was taken by the other pass
                break
            if c[s] != 0.0:
                acc += c[s] * exp_nonpositive(shift[s] - z)
            p -= 1
        out[i] += acc


@helper
def gather_at_targets(r, inv_alpha, E, c, anchor, offset, shift, order, out):
    """Add ``sum_i c[i] exp(shift[t] - |b_t - r[i]| / alpha)`` to ``out[t]`` for every target.

    The transpose of :func:`spread_to_points`: the accumulator is kept relative to the latest
    point of the row, then scaled to the target by its exact distance, a factor <= 1.
    """
    n = r.shape[0]
    m = order.shape[0]
    acc = 0.0
    i = 0
    for q in range(m):
        t = order[q]
        while i < n and offset_z(r[anchor[t]], r[i], inv_alpha, offset[t]) >= 0.0:
            if i > 0:
                acc *= E[i]
            acc += c[i]
            i += 1
        if i > 0 and acc != 0.0:
            z = offset_z(r[anchor[t]], r[i - 1], inv_alpha, offset[t])
            out[t] += acc * exp_nonpositive(shift[t] - z)
    acc = 0.0
    i = n - 1
    for q in range(m - 1, -1, -1):
        t = order[q]
        while i >= 0 and offset_z(r[anchor[t]], r[i], inv_alpha, offset[t]) < 0.0:
            if i < n - 1:
                acc *= E[i + 1]
            acc += c[i]
            i -= 1
        if i < n - 1 and acc != 0.0:
            z = offset_z(r[anchor[t]], r[i + 1], inv_alpha, offset[t])
            out[t] += acc * exp_nonpositive(shift[t] + z)


@helper
def _first_at_or_above(r, inv_alpha, ra, t, start):
    """First point ``i`` with ``b <= r[i]`` (``offset_z(ra, r[i], ., t) <= 0``; ``n`` if none)
    for a target ``b = ra + alpha t``, searched from ``start``, its usual value: a few steps
    at most, galloping through a block of ties. ``offset_z`` is non-increasing in ``i``.
    """
    n = r.shape[0]
    i = min(max(start, 0), n)
    if i > 0 and offset_z(ra, r[i - 1], inv_alpha, t) <= 0.0:
        hi = i - 1  # z <= 0 here; find the first such point below
        step = 1
        lo = hi - step
        while lo >= 0 and offset_z(ra, r[lo], inv_alpha, t) <= 0.0:
            hi = lo
            step *= 2
            lo = hi - step
        lo = max(lo, -1)  # z > 0 at lo (or lo == -1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if offset_z(ra, r[mid], inv_alpha, t) <= 0.0:
                hi = mid
            else:
                lo = mid
        return hi
    while i < n and offset_z(ra, r[i], inv_alpha, t) > 0.0:
        i += 1
    return i


@helper
def spread_by_injection(r, inv_alpha, E, anchor, offset, c, shift, out, inj_up, inj_down):
    """:func:`spread_to_points` for many sources (``m`` of order ``n``) in three streaming
    passes without a merge: each source is injected at its two neighbouring points (the first
    point at or above it, and the one below), then one scan up and one scan down carry the
    injections by the factors ``E``.

    The merge's data-dependent loop exits mispredicted about once per point; this costs 2 n
    scratch (``inj_up``, ``inj_down``, length n, overwritten) and reads each source once.
    Same sums; the additions at a point with several sources group differently (rounding).
    """
    n = r.shape[0]
    m = anchor.shape[0]
    for i in range(n):
        inj_up[i] = 0.0
        inj_down[i] = 0.0
    for s in range(m):
        cs = c[s]
        if cs == 0.0:
            continue
        a = anchor[s]
        t = offset[s]
        ra = r[a]
        # the first point at or above b_s is the right neighbour, unless ties or rounding put
        # b_s at an earlier point too (a call, kept off this path: calls that pass arrays
        # cost their reference counting, more than the rest of the loop)
        i = a if t <= 0.0 else a + 1
        if i > n or (i > 0 and offset_z(ra, r[i - 1], inv_alpha, t) <= 0.0):
            i = _first_at_or_above(r, inv_alpha, ra, t, i)
        else:
            while i < n and offset_z(ra, r[i], inv_alpha, t) > 0.0:
                i += 1
        if i < n:
            inj_up[i] += cs * exp_nonpositive(shift[s] + offset_z(ra, r[i], inv_alpha, t))
        if i > 0:
            inj_down[i - 1] += cs * exp_nonpositive(shift[s] - offset_z(ra, r[i - 1], inv_alpha, t))
    acc = 0.0
    for i in range(n):
        if i > 0:
            acc *= E[i]
        acc += inj_up[i]
        out[i] += acc
    acc = 0.0
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            acc *= E[i + 1]
        acc += inj_down[i]
        out[i] += acc
