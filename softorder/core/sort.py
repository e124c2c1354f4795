"""Gradients of the inverse values: soft sort (``w = k - 1/2``) and soft quantile (``w = q n``).

The forward pass is :func:`softorder.core.lapsum.inverse_kernel`. With ``b_j = S^-1(w_j)``:

    db_j/dr_i = e_ji / E_j,   db_j/dw_j = 1 / G_j,
    db_j/dalpha = sum_i e_ji (b_j - r_i) / (alpha E_j)

(``e_ji = exp(-|b_j - r_i| / alpha)``). Both products are one merge of the sorted row with the
sorted targets, O(n + m) per row.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from softorder.core._jit import helper, kernel
from softorder.core.kernel_sums import carry_injections, inject_exact
from softorder.core.laplace import INF, gap, offset_z, rel_weight
from softorder.core.lapsum import (
    TABLES_WITH_MOMENTS,
    inverse_pullback,
    inverse_pushforward,
    neighbour_sums,
    row_tables,
)
from softorder.core.rows import gather_finite, has_nan, scatter_finite

#: rows of scratch: the tables and the gradient (the CPU kernel keeps the gradient in the row
#: of ``S`` and the pullback's upward injections in the last row)
VJP_WORK = TABLES_WITH_MOMENTS + 1
#: the tables and the tangent (the CPU kernel keeps it in the row of ``S``: one row untouched)
JVP_WORK = TABLES_WITH_MOMENTS + 1
#: With at most n / FEW_TARGETS targets per row (soft quantile) the VJP keeps no tables: it
#: reads them at two points per target only
#: (:func:`~softorder.core.lapsum.neighbour_sums`), and fills 2 rows of its
#: ``work`` instead of 7 (at n = 1e6, 40 MB less). More targets whose left points ascend
#: (soft sort's) take :func:`pullback_ascending`: 5 rows.
FEW_TARGETS = 8


@kernel
def inverse_vjp(xs, order, alpha, anchor, offset, worder, u, x_bar, w_bar, alpha_bar, work, twork):
    """Cotangent ``u`` (rows, m) on the targets -> ``x_bar`` (rows, n; original element order),
    ``w_bar`` (rows, m) and ``alpha_bar`` (rows,). Scratch: ``work`` (rows, VJP_WORK, n),
    ``twork`` (rows, PULLBACK_WORK, m; only the GPU twin uses it). A ``w_bar`` of width 0 asks
    for no ``w_bar`` (soft sort discards it; it costs an ``exp`` per target).
    """
    rows, n = xs.shape
    want_wbar = w_bar.shape[1] == anchor.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            w_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        if anchor.shape[1] * FEW_TARGETS <= n:
            # the upward injections go to the row of x_bar, written only after them (x_bar is
            # never u here: u has fewer columns)
            rbar = work[row, 1, :n]
            alpha_bar[row] = pullback_few(
                r,
                a,
                anchor[row],
                offset[row],
                u[row],
                rbar,
                w_bar[row],
                work[row, 0, :n],
                x_bar[row],
                want_wbar,
            )
            scatter_finite(r, order[row], rbar, x_bar[row])
            continue
        if lefts_ascend(anchor[row], offset[row]):
            rbar = work[row, 3, :n]
            alpha_bar[row] = pullback_ascending(
                r,
                a,
                anchor[row],
                offset[row],
                u[row],
                rbar,
                w_bar[row],
                work[row, 0, :n],
                work[row, 1, :n],
                work[row, 2, :n],
                work[row, 4, :n],
                want_wbar,
            )
            scatter_finite(r, order[row], rbar, x_bar[row])
            continue
        tables = row_tables(r, 1.0 / a, True, work[row])
        rbar = work[row, 3, :n]  # S: the gradients do not read it
        rbar[:] = 0.0
        alpha_bar[row] = inverse_pullback(
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            u[row],
            rbar,
            w_bar[row],
            work[row, TABLES_WITH_MOMENTS, :n],
            rbar,
            want_wbar,
            True,
        )
        scatter_finite(r, order[row], rbar, x_bar[row])


@kernel
def inverse_jvp(
    xs, order, alpha, anchor, offset, worder, x_dot, w_dot, alpha_dot, out, work, twork
):
    """Tangents ``x_dot`` (rows, n; original order), ``w_dot`` (rows, m), ``alpha_dot`` (rows,)
    -> tangent of the targets ``out`` (rows, m). Scratch: ``work`` (rows, JVP_WORK, n),
    ``twork`` (rows, PUSHFORWARD_WORK, m).
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :] = np.nan
            continue
        a = alpha[row]
        tables = row_tables(r, 1.0 / a, True, work[row])
        rdot = work[row, 3, :n]  # S: the gradients do not read it (row 6 stays untouched)
        gather_finite(r, order[row], x_dot[row], rdot)
        inverse_pushforward(
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            worder[row],
            rdot,
            w_dot[row],
            alpha_dot[row],
            out[row],
            twork[row],
        )


@helper
def pullback_few(r, alpha, anchor, offset, u, rbar, wbar, E, inj_up, want_wbar):
    """:func:`~softorder.core.lapsum.inverse_pullback` into a fresh ``rbar`` for a few targets,
    without tables: their sums at each target's two neighbours come from
    :func:`~softorder.core.lapsum.neighbour_sums` (``E`` is filled there), and the arithmetic
    per target is ``inverse_pullback``'s, in the same order, so the results are the same to
    the bit.
    ``rbar`` doubles as the downward injections.
    """
    n = r.shape[0]
    m = anchor.shape[0]
    inv_alpha = 1.0 / alpha
    left = np.empty(m, np.int64)
    for j in range(m):
        left[j] = anchor[j] - 1 if offset[j] <= 0.0 else anchor[j]
    sums = np.zeros((4, m))
    neighbour_sums(r, inv_alpha, E, left, sums)
    inj_up[:] = 0.0
    rbar[:] = 0.0
    alpha_bar = 0.0
    for j in range(m):
        an = anchor[j]
        t = offset[j]
        uj = u[j]
        if want_wbar:
            wbar[j] = 0.0
        ra = r[an]
        position = ra if t == 0.0 or abs(ra) == INF else ra + alpha * t  # target_position
        if uj == 0.0 or abs(position) == INF:
            continue
        L = left[j]
        R = L + 1
        a_l = sums[0, j]
        ad_l = sums[1, j]
        b_r = sums[2, j]
        bd_r = sums[3, j]
        if L >= 0 and R < n:  # inverse_pullback's usual target
            zl = offset_z(ra, r[L], inv_alpha, t)
            zr = offset_z(ra, r[R], inv_alpha, t)
            if zl > 0.0 and zl != INF and zr <= 0.0 and zr != -INF:
                e = math.exp(-abs(zl + zr))
                left_nearer = zl <= -zr
                el = 1.0 if left_nearer else e
                er = e if left_nearer else 1.0
                G = a_l * el + b_r * er
                Z = (zl * a_l + ad_l) * el + (zr * b_r - bd_r) * er
                cj = uj / G
                inj_up[R] += cj * er
                rbar[L] += cj * el
                if want_wbar:
                    wbar[j] = uj * 2.0 * alpha * math.exp(min(zl, -zr)) / G
                alpha_bar += uj * Z / G
                continue
        zl = offset_z(ra, r[L], inv_alpha, t) if L >= 0 else INF
        zr = offset_z(ra, r[R], inv_alpha, t) if R < n else -INF
        sh = min(zl, -zr)
        if sh == INF:
            continue
        G = 0.0
        Z = 0.0
        el = rel_weight(zl, sh)
        if el > 0.0:
            G += a_l * el
            Z += (zl * a_l + ad_l) * el
        er = rel_weight(zr, sh)
        if er > 0.0:
            G += b_r * er
            Z += (zr * b_r - bd_r) * er
        if G == 0.0:
            continue
        cj = uj / G
        if (L < 0 or zl > 0.0) and (R >= n or zr <= 0.0):
            if R < n:
                inj_up[R] += cj * er
            if L >= 0:
                rbar[L] += cj * el
        else:  # ties or rounding: find those two points
            inject_exact(r, inv_alpha, ra, t, sh, cj, R, inj_up, rbar)
        if want_wbar:
            wbar[j] = uj * 2.0 * alpha * math.exp(sh) / G
        alpha_bar += uj * Z / G
    carry_injections(E, inj_up, rbar, rbar, True)
    return alpha_bar


@helper
def lefts_ascend(anchor, offset):
    """Whether the targets' left points (``anchor - 1`` for ``offset <= 0``, else ``anchor``)
    never decrease in the order the targets come: soft sort's ascending targets.
    """
    previous = -1
    for j in range(anchor.shape[0]):
        left = anchor[j] - 1 if offset[j] <= 0.0 else anchor[j]
        if left < previous:
            return False
        previous = left
    return True


@helper
def pullback_ascending(r, alpha, anchor, offset, u, rbar, wbar, E, B, Bd, inj_up, want_wbar):
    """:func:`~softorder.core.lapsum.inverse_pullback` into a fresh ``rbar`` for targets whose
    left points ascend (:func:`lefts_ascend`): ``E``, ``B`` and ``Bd`` are stored (the
    recurrences of :func:`~softorder.core.lapsum.row_tables`), ``A`` and ``Ad`` are carried
    forward to each target's left point as the targets come, so 5 rows of n instead of 7.
    The arithmetic per target is ``inverse_pullback``'s, in the same order (a copy of its
    loop: passing the arrays to a per-target helper cost 3x the arithmetic there), so the
    results are the same to the bit. ``rbar`` doubles as the downward injections.
    """
    n = r.shape[0]
    m = anchor.shape[0]
    inv_alpha = 1.0 / alpha
    E[0] = 0.0
    for i in range(1, n):
        E[i] = math.exp(-gap(r[i], r[i - 1]) * inv_alpha)
    B[n - 1] = 1.0
    Bd[n - 1] = 0.0
    for i in range(n - 2, -1, -1):
        e = E[i + 1]
        B[i] = 1.0 + e * B[i + 1]
        Bd[i] = e * (Bd[i + 1] + gap(r[i + 1], r[i]) * inv_alpha * B[i + 1]) if e > 0.0 else 0.0
    inj_up[:] = 0.0
    rbar[:] = 0.0
    at = 0  # A and Ad at point `at`
    a_at = 1.0
    ad_at = 0.0
    alpha_bar = 0.0
    for j in range(m):
        an = anchor[j]
        t = offset[j]
        uj = u[j]
        if want_wbar:
            wbar[j] = 0.0
        L = an - 1 if t <= 0.0 else an
        R = L + 1
        while at < L:
            at += 1
            e = E[at]
            ad_at = e * (ad_at + gap(r[at], r[at - 1]) * inv_alpha * a_at) if e > 0.0 else 0.0
            a_at = 1.0 + e * a_at
        ra = r[an]
        position = ra if t == 0.0 or abs(ra) == INF else ra + alpha * t  # target_position
        if uj == 0.0 or abs(position) == INF:
            continue
        if L >= 0 and R < n:  # inverse_pullback's usual target
            zl = offset_z(ra, r[L], inv_alpha, t)
            zr = offset_z(ra, r[R], inv_alpha, t)
            if zl > 0.0 and zl != INF and zr <= 0.0 and zr != -INF:
                e = math.exp(-abs(zl + zr))
                left_nearer = zl <= -zr
                el = 1.0 if left_nearer else e
                er = e if left_nearer else 1.0
                G = a_at * el + B[R] * er
                Z = (zl * a_at + ad_at) * el + (zr * B[R] - Bd[R]) * er
                cj = uj / G
                inj_up[R] += cj * er
                rbar[L] += cj * el
                if want_wbar:
                    wbar[j] = uj * 2.0 * alpha * math.exp(min(zl, -zr)) / G
                alpha_bar += uj * Z / G
                continue
        zl = offset_z(ra, r[L], inv_alpha, t) if L >= 0 else INF
        zr = offset_z(ra, r[R], inv_alpha, t) if R < n else -INF
        sh = min(zl, -zr)
        if sh == INF:
            continue
        G = 0.0
        Z = 0.0
        el = rel_weight(zl, sh)
        if el > 0.0:
            G += a_at * el
            Z += (zl * a_at + ad_at) * el
        er = rel_weight(zr, sh)
        if er > 0.0:
            G += B[R] * er
            Z += (zr * B[R] - Bd[R]) * er
        if G == 0.0:
            continue
        cj = uj / G
        if (L < 0 or zl > 0.0) and (R >= n or zr <= 0.0):
            if R < n:
                inj_up[R] += cj * er
            if L >= 0:
                rbar[L] += cj * el
        else:  # ties or rounding: find those two points
            inject_exact(r, inv_alpha, ra, t, sh, cj, R, inj_up, rbar)
        if want_wbar:
            wbar[j] = uj * 2.0 * alpha * math.exp(sh) / G
        alpha_bar += uj * Z / G
    carry_injections(E, inj_up, rbar, rbar, True)
    return alpha_bar
