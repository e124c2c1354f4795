"""Laplace-kernel sums between sorted point sets in O(n + m) (math doc section 6).

Every recurrence multiplies by factors ``exp(-gap / alpha) <= 1``, so nothing overflows, and
sums that feed a ratio are taken relative to the nearest point (the ``shift`` of each target)
so that well-separated points give ``0 * finite`` instead of ``0 / 0``. Targets enter with their
exact offsets from an anchor point (their rounded values only decide the merge order), and
factors are clamped to <= 1 against rounding.
"""

from __future__ import annotations

from softorder.core._jit import helper, inner_helper
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
    i = start if start > 0 else 0
    if i > n:
        i = n
    if i > 0 and offset_z(ra, r[i - 1], inv_alpha, t) <= 0.0:
        hi = i - 1  # z <= 0 here; find the first such point below
        step = 1
        lo = hi - step
        while True:  # (a loop's condition is compiled twice, a test in the loop once)
            if lo < 0 or not (offset_z(ra, r[lo], inv_alpha, t) <= 0.0):
                break
            hi = lo
            step *= 2
            lo = hi - step
        if lo < -1:  # z > 0 at lo (or lo == -1)
            lo = -1
        while True:
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
            if offset_z(ra, r[mid], inv_alpha, t) <= 0.0:
                hi = mid
            else:
                lo = mid
        return hi
    while True:
        if i >= n or not (offset_z(ra, r[i], inv_alpha, t) > 0.0):
            break
        i += 1
    return i


@helper
def inject_exact(r, inv_alpha, ra, t, shift, c, start, inj_up, inj_down):
    """Inject a source ``c`` at ``b = ra + alpha t`` at the first point at or above ``b``
    (``inj_up``) and the point below it (``inj_down``), with the factors of
    :func:`spread_to_points`: where a merge of the sorted sources would join it. ``start`` is
    its usual first point at or above.
    """
    n = r.shape[0]
    i = _first_at_or_above(r, inv_alpha, ra, t, start)
    if i < n:
        inj_up[i] += c * exp_nonpositive(shift + offset_z(ra, r[i], inv_alpha, t))
    if i > 0:
        inj_down[i - 1] += c * exp_nonpositive(shift - offset_z(ra, r[i - 1], inv_alpha, t))


@helper
def carry_injections(E, inj_up, inj_down, out, fresh_out):
    """Add to ``out[i]`` the injections at or below ``i`` carried up and those at or above
    carried down by the factors ``E[i] = exp(-(r[i] - r[i-1]) / alpha)``: the two passes of
    :func:`spread_to_points` once every source sits at its neighbouring points. Streaming
    passes without a merge: the merge's data-dependent loop exit was mispredicted about once
    per point. With ``fresh_out`` (``out`` held nothing before the injections) ``inj_down``
    may be ``out`` itself: the downward pass then writes instead of adding.
    """
    n = out.shape[0]
    acc = 0.0
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            acc *= E[i + 1]
        acc += inj_down[i]
        if fresh_out:
            out[i] = acc
        else:
            out[i] += acc
    acc = 0.0
    for i in range(n):
        if i > 0:
            acc *= E[i]
        acc += inj_up[i]
        out[i] += acc


def _carry_both_ways(E, inj_up, inj_down):
    """Carry the injections ``inj_up`` up and ``inj_down`` down by the factors ``E``, each
    in place: :func:`carry_injections`'s two passes, the same sums, whose total at a point
    (``inj_down[i] + inj_up[i]``) is its value to the bit. Each carry is a chain of a product
    and a sum per point, whose latency bound its pass: the two run side by side in one loop
    (figures in CHANGELOG.md).
    """
    n = E.shape[0]
    up = 0.0
    down = 0.0
    for i in range(n):
        if i > 0:
            up *= E[i]
        up += inj_up[i]
        inj_up[i] = up
        j = n - 1 - i
        if i > 0:
            down *= E[j + 1]
        down += inj_down[j]
        inj_down[j] = down


#: :func:`_carry_both_ways` compiled on its own (soft sort's ladder VJP calls it by symbol)
carry_both_ways = helper(_carry_both_ways)
#: the same, inlined into its caller (the permutation loss's VJP helper: a function of its
#: own there lengthened the loss's first call, which has little room)
carry_both_ways_inline = inner_helper(_carry_both_ways)
