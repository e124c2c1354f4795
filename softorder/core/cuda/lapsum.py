"""GPU form of :mod:`softorder.core.lapsum` and :mod:`softorder.core.kernel_sums`.

The prefix arrays ``E, A, B, S, Ad, Bd`` are affine scans (:mod:`softorder.core.cuda.scan`);
the inverse and the derivative sums of a target are the CPU helpers compiled as device
functions, one thread per target; the merges of a sorted row with sorted targets become a
binary search per target (where it joins the row), an atomic add at that point and one scan
per direction. Array arguments are (rows, ...) device arrays, as in the CPU kernels.
"""

from __future__ import annotations

import math

from numba import cuda

from softorder.core import lapsum as cpu
from softorder.core.cuda import _launch
from softorder.core.cuda._launch import F1, F2, I2
from softorder.core.cuda.rows import element, nan_row, nan_rows
from softorder.core.cuda.scan import affine_scan, fill
from softorder.core.laplace import INF, gap, offset_z, rel_weight

_gap = _launch.device(gap)
_offset_z = _launch.device(offset_z)
_rel_weight = _launch.device(rel_weight)
_count_at_most = _launch.device(cpu.count_at_most)
_invert = _launch.device(cpu.invert)
_target_position = _launch.device(cpu.target_position)
_inverse_position = _launch.device(cpu.inverse_position)
_target_sums = _launch.device(cpu.target_sums)


@_launch.kernel(F2, F1, F2, F2, F2)
def _decays(xs, alpha, E, ones_a, ones_b):
    """``E[i] = exp(-(r[i] - r[i-1]) / alpha)`` (0 at i = 0), and 1 into the next two slots."""
    row, i, inside = element(xs.shape)
    if inside:
        E[row, i] = math.exp(-_gap(xs[row, i], xs[row, i - 1]) * (1.0 / alpha[row])) if i else 0.0
        ones_a[row, i] = 1.0
        ones_b[row, i] = 1.0


@_launch.kernel(F2, F2, F2)
def _lapsum_at_points(A, B, S):
    row, i, inside = element(S.shape)
    if inside:
        S[row, i] = i + 0.5 + 0.5 * (B[row, i] - A[row, i])


@_launch.kernel(F2, F1, F2, F2, F2, F2, F2)
def _moment_terms(xs, alpha, E, A, B, left, right):
    """Increments of ``Ad`` (``E_i gap_i A_(i-1) / alpha``) and ``Bd`` (mirrored)."""
    row, i, inside = element(xs.shape)
    if inside:
        n = xs.shape[1]
        inv_alpha = 1.0 / alpha[row]
        e = E[row, i]
        left[row, i] = (
            e * _gap(xs[row, i], xs[row, i - 1]) * inv_alpha * A[row, i - 1]
            if (i > 0 and e > 0.0)
            else 0.0
        )
        e = E[row, i + 1] if i + 1 < n else 0.0
        right[row, i] = (
            e * _gap(xs[row, i + 1], xs[row, i]) * inv_alpha * B[row, i + 1] if (e > 0.0) else 0.0
        )


def prefix_sums(xs, alpha, E, A, B, decays: bool = True) -> None:
    """GPU :func:`softorder.core.lapsum.prefix_sums` for all rows: the decays into ``E`` (or,
    without ``decays``, ``E`` as given: saved by a forward pass), then ``A`` and ``B``.
    """
    if decays:
        _launch.for_each(_decays, xs.size, xs, alpha, E, A, B)
    else:
        fill(A, 1.0)
        fill(B, 1.0)
    affine_scan(E, A, A)
    affine_scan(E, B, B, reverse=True)


def prefix_moments(xs, alpha, E, A, B, Ad, Bd) -> None:
    """GPU :func:`softorder.core.lapsum.prefix_moments` for all rows (needs ``E, A, B``)."""
    _launch.for_each(_moment_terms, xs.size, xs, alpha, E, A, B, Ad, Bd)
    affine_scan(E, Ad, Ad)
    affine_scan(E, Bd, Bd, reverse=True)


def row_tables(xs, alpha, moments: bool, work):
    """Fill ``E, A, B, S`` (and ``Ad, Bd`` with ``moments``) into ``work`` (rows, >= 6, n),
    as :func:`softorder.core.lapsum.row_tables` does per row; returns the six (rows, n) views.
    """
    E, A, B, S = (work[:, k, :] for k in range(4))
    Ad = Bd = None
    prefix_sums(xs, alpha, E, A, B)
    _launch.for_each(_lapsum_at_points, xs.size, A, B, S)
    if moments:
        Ad, Bd = work[:, 4, :], work[:, 5, :]
        prefix_moments(xs, alpha, E, A, B, Ad, Bd)
    return E, A, B, Ad, Bd, S


@_launch.kernel(F2, F1, F2, F2, F2, F2, F2, I2, F2, F2)
def _solve(xs, alpha, E, A, B, S, w, anchor, offset, out):
    """One thread per target: ``S^-1(w)`` as ``(anchor, offset)``, and its value into ``out``
    (a (1, 0) placeholder when not wanted). ``w`` may have one row shared by all rows.
    """
    row, j, inside = element(anchor.shape)
    if inside:
        if nan_row(xs, row):
            anchor[row, j] = 0
            offset[row, j] = math.nan
            if out.shape[1]:
                out[row, j] = math.nan
            return
        target = w[row if w.shape[0] > 1 else 0, j]
        r = xs[row]
        a = alpha[row]
        hint = _count_at_most(S[row], target, 0)
        k, t = _invert(r, 1.0 / a, E[row], A[row], B[row], target, hint)
        anchor[row, j] = k
        offset[row, j] = t
        if out.shape[1]:
            out[row, j] = _inverse_position(r, a, k, t)


def solve_targets(xs, alpha, tables, w, anchor, offset, out=None) -> None:
    """Invert every target ``w`` (rows or 1, m) of every row into ``anchor``/``offset``
    (rows, m), and their values into ``out`` when given. NaN rows get offset NaN.
    """
    E, A, B, Ad, Bd, S = tables
    if w.ndim == 1:
        w = w.reshape(1, w.shape[0])
    if out is None:
        out = _launch.empty((1, 0))
    _launch.for_each(_solve, anchor.size, xs, alpha, E, A, B, S, w, anchor, offset, out)


def inverse_kernel(xs, alpha, w, worder, out, anchor, offset, work) -> None:
    """GPU :func:`softorder.core.lapsum.inverse_kernel` (``worder`` is not needed here)."""
    tables = row_tables(xs, alpha, False, work)
    solve_targets(xs, alpha, tables, w, anchor, offset, out)


@_launch.kernel(F2, F1, F2, F2, F2, F2)
def _lapsum_values(xs, alpha, A, B, points, out):
    row, j, inside = element(points.shape)
    if inside:
        if nan_row(xs, row):
            out[row, j] = math.nan
            return
        r = xs[row]
        n = r.shape[0]
        x = points[row, j]
        inv_alpha = 1.0 / alpha[row]
        lo = 0
        hi = n
        while lo < hi:  # number of r <= x
            mid = (lo + hi) // 2
            if r[mid] <= x:
                lo = mid + 1
            else:
                hi = mid
        s = float(lo)
        if lo > 0:
            s -= 0.5 * A[row, lo - 1] * math.exp(-_gap(x, r[lo - 1]) * inv_alpha)
        if lo < n:
            s += 0.5 * B[row, lo] * math.exp(-_gap(r[lo], x) * inv_alpha)
        out[row, j] = s


def lapsum_kernel(xs, alpha, points, out, work) -> None:
    """GPU :func:`softorder.core.lapsum.lapsum_kernel`: ``S_row(points)``."""
    E, A, B, Ad, Bd, S = row_tables(xs, alpha, False, work)
    _launch.for_each(_lapsum_values, points.size, xs, alpha, A, B, points, out)


@cuda.jit(device=True, inline="always")
def _first_below(r, ra, inv_alpha, t, strict):
    """First point ``i`` with ``z_i = (b - r_i) / alpha`` ``<= 0`` (``< 0`` if ``strict``),
    ``b = r[anchor] + alpha t``; ``z`` falls along the sorted row. NaN rows end the search.
    """
    lo = 0
    hi = r.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        z = _offset_z(ra, r[mid], inv_alpha, t)
        if z < 0.0 or (z == 0.0 and not strict):
            hi = mid
        else:
            lo = mid + 1
    return lo


@_launch.kernel(F2, F1, I2, F2, F2, F2, F2, F2)
def _join_points(xs, alpha, anchor, offset, c, shift, up, down):
    """Source ``s`` (a target) joins the upward pass at the first point at or above it and the
    downward pass at the last point below it, with its exact distance (a factor <= 1).
    """
    row, s, inside = element(anchor.shape)
    if inside and c[row, s] != 0.0:
        r = xs[row]
        inv_alpha = 1.0 / alpha[row]
        ra = r[anchor[row, s]]
        t = offset[row, s]
        i = _first_below(r, ra, inv_alpha, t, False)
        if i < r.shape[0]:
            z = _offset_z(ra, r[i], inv_alpha, t)
            cuda.atomic.add(up, (row, i), c[row, s] * math.exp(min(0.0, shift[row, s] + z)))
        if i > 0:
            z = _offset_z(ra, r[i - 1], inv_alpha, t)
            cuda.atomic.add(down, (row, i - 1), c[row, s] * math.exp(min(0.0, shift[row, s] - z)))


@_launch.kernel(F2, F2, F2)
def _add_both(out, up, down):
    row, i, inside = element(out.shape)
    if inside:
        out[row, i] += up[row, i] + down[row, i]


def spread_to_points(xs, alpha, E, anchor, offset, c, shift, out) -> None:
    """GPU :func:`softorder.core.kernel_sums.spread_to_points` for (rows, m) sources: adds
    ``sum_s c[s] exp(shift[s] - |r[i] - b_s| / alpha)`` to ``out[:, i]``.
    """
    rows, n = xs.shape
    up = _launch.empty((rows, n))
    down = _launch.empty((rows, n))
    fill(up, 0.0)
    fill(down, 0.0)
    _launch.for_each(_join_points, anchor.size, xs, alpha, anchor, offset, c, shift, up, down)
    affine_scan(E, up, up)
    affine_scan(E, down, down, reverse=True)
    _launch.for_each(_add_both, out.size, out, up, down)


@_launch.kernel(F2, F1, F2, F2, F2, F2, I2, F2, F2, F2, F2, F2, F2)
def _pullback_targets(xs, alpha, A, B, Ad, Bd, anchor, offset, u, c, shift, wbar, abar):
    """Per target: the coefficient and shift it spreads, ``wbar`` and its part of alpha's."""
    row, j, inside = element(anchor.shape)
    if inside:
        r = xs[row]
        a = alpha[row]
        k = anchor[row, j]
        t = offset[row, j]
        sh, G, Z = _target_sums(r, 1.0 / a, A[row], B[row], Ad[row], Bd[row], k, t)
        uj = u[row, j]
        if G == 0.0 or uj == 0.0 or abs(_target_position(r, a, k, t)) == INF or nan_row(xs, row):
            c[row, j] = 0.0
            shift[row, j] = 0.0
            wbar[row, j] = 0.0
            abar[row, j] = 0.0
            return
        c[row, j] = uj / G
        shift[row, j] = sh
        wbar[row, j] = uj * 2.0 * a * math.exp(sh) / G
        abar[row, j] = uj * Z / G


def inverse_pullback(xs, alpha, tables, anchor, offset, u, rbar, wbar, alpha_terms) -> None:
    """GPU :func:`softorder.core.lapsum.inverse_pullback` for all rows: adds the pullback of
    ``u`` (rows, m) to ``rbar`` (rows, n; sorted order), writes ``wbar`` (rows, m) and each
    target's part of alpha's cotangent into ``alpha_terms`` (rows, m; the caller sums).
    """
    E, A, B, Ad, Bd, S = tables
    c = _launch.empty(anchor.shape)
    shift = _launch.empty(anchor.shape)
    _launch.for_each(
        _pullback_targets,
        anchor.size,
        xs,
        alpha,
        A,
        B,
        Ad,
        Bd,
        anchor,
        offset,
        u,
        c,
        shift,
        wbar,
        alpha_terms,
    )
    spread_to_points(xs, alpha, E, anchor, offset, c, shift, rbar)


@_launch.kernel(F2, F1, F2, F2, F2, F2, I2, F2, F2, F1, F2, F2, F2)
def _push_targets(xs, alpha, A, B, Ad, Bd, anchor, offset, wdot, alpha_dot, out, G, shift):
    row, j, inside = element(anchor.shape)
    if inside:
        r = xs[row]
        a = alpha[row]
        k = anchor[row, j]
        t = offset[row, j]
        sh, g, Z = _target_sums(r, 1.0 / a, A[row], B[row], Ad[row], Bd[row], k, t)
        if g == 0.0 or abs(_target_position(r, a, k, t)) == INF:
            out[row, j] = 0.0
            G[row, j] = 0.0
            shift[row, j] = -INF
            return
        G[row, j] = g
        shift[row, j] = sh
        v = Z / g * alpha_dot[row]
        if wdot[row, j] != 0.0:
            v += wdot[row, j] * 2.0 * a * math.exp(sh) / g
        out[row, j] = v


@_launch.kernel(F2, F1, I2, F2, F2, F2, F2, F2, F2)
def _gather_targets(xs, alpha, anchor, offset, shift, G, up, down, out):
    """Per target: the row's kernel sum at it, from the two scans at its neighbours."""
    row, j, inside = element(anchor.shape)
    if inside and G[row, j] > 0.0:
        r = xs[row]
        inv_alpha = 1.0 / alpha[row]
        ra = r[anchor[row, j]]
        t = offset[row, j]
        i = _first_below(r, ra, inv_alpha, t, True)
        acc = 0.0
        if i > 0 and up[row, i - 1] != 0.0:
            z = _offset_z(ra, r[i - 1], inv_alpha, t)
            acc += up[row, i - 1] * math.exp(min(0.0, shift[row, j] - z))
        if i < r.shape[0] and down[row, i] != 0.0:
            z = _offset_z(ra, r[i], inv_alpha, t)
            acc += down[row, i] * math.exp(min(0.0, shift[row, j] + z))
        out[row, j] += acc / G[row, j]


def inverse_pushforward(xs, alpha, tables, anchor, offset, rdot, wdot, alpha_dot, out) -> None:
    """GPU :func:`softorder.core.lapsum.inverse_pushforward`: tangents of the targets
    ``out`` (rows, m) from ``rdot`` (rows, n; sorted order), ``wdot`` (rows, m) and
    ``alpha_dot`` (rows,).
    """
    E, A, B, Ad, Bd, S = tables
    G = _launch.empty(anchor.shape)
    shift = _launch.empty(anchor.shape)
    _launch.for_each(
        _push_targets,
        anchor.size,
        xs,
        alpha,
        A,
        B,
        Ad,
        Bd,
        anchor,
        offset,
        wdot,
        alpha_dot,
        out,
        G,
        shift,
    )
    up = _launch.empty(xs.shape)
    down = _launch.empty(xs.shape)
    affine_scan(E, rdot, up)
    affine_scan(E, rdot, down, reverse=True)
    _launch.for_each(
        _gather_targets, anchor.size, xs, alpha, anchor, offset, shift, G, up, down, out
    )


__all__ = ["inverse_kernel", "lapsum_kernel", "nan_rows", "row_tables", "solve_targets"]
