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
#: ``work`` instead of 7 (at n = 1e6, 40 MB less); more targets carry ``A`` and ``Ad``
#: along, taken in ascending order: 5 rows (:func:`pullback_rows`).
FEW_TARGETS = 8
#: and at most this many (:func:`~softorder.core.lapsum.neighbour_sums` sorts them by
#: insertion)
MAX_FEW_TARGETS = 64


@kernel
def inverse_vjp(xs, order, alpha, anchor, offset, worder, u, x_bar, w_bar, alpha_bar, work, twork):
    """Cotangent ``u`` (rows, m) on the targets -> ``x_bar`` (rows, n; original element order),
    ``w_bar`` (rows, m) and ``alpha_bar`` (rows,). Scratch: ``work`` (rows, VJP_WORK, n),
    ``twork`` (rows, PULLBACK_WORK, m; only the GPU twin uses it). A ``w_bar`` of width 0 asks
    for no ``w_bar`` (soft sort discards it; it costs an ``exp`` per target). ``x_bar`` may be
    ``u`` itself (soft sort): each row of ``u`` is read before that row of ``x_bar`` is written.

    ``worder`` (rows, m), the targets' ascending order, or width 0 when they come ascending
    (soft sort). The tables the pullback reads are kept in one of two ways
    (:func:`pullback_rows`): per target for a few targets, else ``E``, ``B``, ``Bd`` stored and
    ``A``, ``Ad`` carried along the targets in ascending order (5 rows of n; the full tables
    were 7).
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    want_wbar = w_bar.shape[1] == m
    few = m * FEW_TARGETS <= n and m <= MAX_FEW_TARGETS
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            w_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        w = work[row]
        none = w[0, :0]
        if few:
            # sums at each target's two points (L, A, Ad, B, Bd); the upward injections in the
            # row of x_bar, written only after them (x_bar is never u here: fewer columns)
            sums = np.empty((5, m))
            neighbour_sums(r, inv_alpha, w[0, :n], anchor[row], offset[row], sums)
            E, rbar, inj_up, B, Bd = w[0, :n], w[1, :n], x_bar[row], none, none
            visit = worder[row, :0]
        else:
            sums = np.empty((5, 0))
            E, B, Bd, rbar, inj_up = w[0, :n], w[1, :n], w[2, :n], w[3, :n], w[4, :n]
            right_tables(r, inv_alpha, E, B, Bd)
            visit = ascending_visit(anchor[row], offset[row], worder[row])
        alpha_bar[row] = pullback_rows(
            r,
            a,
            anchor[row],
            offset[row],
            u[row],
            rbar,
            w_bar[row],
            want_wbar,
            E,
            inj_up,
            few,
            sums,
            B,
            Bd,
            visit,
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
def ascending_visit(anchor, offset, worder):
    """An order of the targets in which their left points (``anchor - 1`` for ``offset <=
    0``, else ``anchor``) never decrease: ``worder`` (width 0: the targets as they come) when
    they already do, the usual case (soft sort's targets, or any sorted by value), else a
    new one sorted by insertion from it (stable, O(m + inversions)).
    """
    m = anchor.shape[0]
    given = worder.shape[0] == m
    previous = -1
    ascending = True
    for q in range(m):
        j = worder[q] if given else q
        left = anchor[j] - 1 if offset[j] <= 0.0 else anchor[j]
        if left < previous:
            ascending = False
            break
        previous = left
    if ascending:
        return worder
    visit = np.empty(m, np.int64)
    for q in range(m):
        j = worder[q] if given else q
        left = anchor[j] - 1 if offset[j] <= 0.0 else anchor[j]
        k = q
        while k > 0:
            i = visit[k - 1]
            if (anchor[i] - 1 if offset[i] <= 0.0 else anchor[i]) <= left:
                break
            visit[k] = i
            k -= 1
        visit[k] = j
    return visit


@helper
def right_tables(r, inv_alpha, E, B, Bd):
    """``E``, ``B`` and ``Bd`` of :func:`~softorder.core.lapsum.row_tables` (the same
    operations), without ``A``, ``Ad`` and ``S``.
    """
    n = r.shape[0]
    E[0] = 0.0
    for i in range(1, n):
        E[i] = math.exp(-gap(r[i], r[i - 1]) * inv_alpha)
    B[n - 1] = 1.0
    Bd[n - 1] = 0.0
    for i in range(n - 2, -1, -1):
        e = E[i + 1]
        B[i] = 1.0 + e * B[i + 1]
        Bd[i] = e * (Bd[i + 1] + gap(r[i + 1], r[i]) * inv_alpha * B[i + 1]) if e > 0.0 else 0.0


@helper
def pullback_rows(
    r, alpha, anchor, offset, u, rbar, wbar, want_wbar, E, inj_up, few, sums, B, Bd, visit
):
    """:func:`~softorder.core.lapsum.inverse_pullback` into a fresh ``rbar`` (which doubles as
    the downward injections), reading the tables at each target's left point ``L`` and right
    point ``R`` from ``sums[1:, j] = (A[L], Ad[L], B[R], Bd[R])`` when ``few``
    (:func:`~softorder.core.lapsum.neighbour_sums`), else from the stored ``B``, ``Bd`` and
    ``A``, ``Ad`` carried forward along the targets in the order ``visit`` (width 0: as they
    come), in which their left points ascend (:func:`ascending_visit`). The arithmetic per
    target is ``inverse_pullback``'s, so the results are its own to the bit for targets taken
    in the same order (a copy of its loop: passing the arrays to a per-target helper cost 3x
    the arithmetic there).
    """
    n = r.shape[0]
    m = anchor.shape[0]
    inv_alpha = 1.0 / alpha
    inj_up[:] = 0.0
    rbar[:] = 0.0
    at = 0  # A and Ad at point `at` (not few)
    a_at = 1.0
    ad_at = 0.0
    alpha_bar = 0.0
    in_order = visit.shape[0] == 0
    if want_wbar:
        wbar[:] = 0.0
    for q in range(m):
        j = q if in_order else visit[q]
        an = anchor[j]
        t = offset[j]
        uj = u[j]
        L = an - 1 if t <= 0.0 else an
        R = L + 1
        if not few:
            while at < L:
                at += 1
                e = E[at]
                ad_at = e * (ad_at + gap(r[at], r[at - 1]) * inv_alpha * a_at) if e > 0.0 else 0.0
                a_at = 1.0 + e * a_at
        ra = r[an]
        position = ra if t == 0.0 or abs(ra) == INF else ra + alpha * t  # target_position
        if uj == 0.0 or abs(position) == INF:
            continue
        if few:
            a_l = sums[1, j]
            ad_l = sums[2, j]
            b_r = sums[3, j]
            bd_r = sums[4, j]
        else:
            a_l = a_at
            ad_l = ad_at
            b_r = B[R] if R < n else 0.0
            bd_r = Bd[R] if R < n else 0.0
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
