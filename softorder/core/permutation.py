"""Soft permutation matrix and the permutation cross-entropy loss.

With boundaries ``b_0 = -inf``, ``b_k = S^-1(k)`` (k = 1..n-1), ``b_n = +inf``:
``P[k, i] = F((b_(k+1) - r_i) / alpha) - F((b_k - r_i) / alpha)`` (0-based row k), a doubly
stochastic matrix with ``P @ r`` the soft-sorted row. The matrix is the one O(n^2) output; the
loss ``-sum_i log P[t_i - 1, i]`` needs only two boundaries per element and costs O(n).
Gradients chain through ``F`` directly and through the boundaries with
:func:`softorder.core.lapsum.inverse_pullback` (one O(n) merge).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import prange, types

from softorder.core._jit import NativeCalls, helper, inner_helper, kernel
from softorder.core.laplace import (
    INF,
    LOG_HALF,
    cdf_diff,
    hazard,
    log_cdf,
    offset_z,
)
from softorder.core.lapsum import (
    PULLBACK_WORK,
    PUSHFORWARD_WORK,
    TABLES,
    TABLES_WITH_MOMENTS,
    inverse_pullback,
    inverse_pushforward,
    moment_tables,
    solve_ladder,
    sum_tables,
)
from softorder.core.rows import gather_finite, has_nan, scatter_finite

FORWARD_WORK = TABLES
#: the tables with moments, the gradient, and a row for the CPU pullback's injections
GRADIENT_WORK = TABLES_WITH_MOMENTS + 2
#: rows of the boundary-indexed scratch ``twork`` (rows, BOUNDARY_WORK, n - 1) of the gradients:
#: two of their own (``beta`` and ``w_bar``, or ``b_dot`` and ``w_dot``), then the inverse's.
BOUNDARY_WORK = 2 + max(PULLBACK_WORK, PUSHFORWARD_WORK)
#: rows of ``work`` that the CPU :func:`permutation_loss_vjp` reads: the tables with moments
#: and ``rbar`` (the pullback's injections go in S's row, unread there, and in ``x_bar``'s)
LOSS_GRADIENT_WORK = TABLES_WITH_MOMENTS + 1
#: the rows of ``twork`` that the CPU :func:`permutation_loss_vjp` reads (``beta``)
LOSS_BOUNDARY_WORK = 1

_F, _B = types.float64, types.boolean
_F1, _F2 = types.Array(_F, 1, "C"), types.Array(_F, 2, "C")
_L1 = types.Array(types.int64, 1, "C")
#: the per-row helpers the kernels call through their addresses (``native``), compiled once
#: for all of them instead of once more inside each
_NATIVE = NativeCalls(
    # r, inv_alpha, work
    sum_tables=(sum_tables, (_F1, _F, _F2)),
    moment_tables=(moment_tables, (_F1, _F, _F2)),
    # r, alpha, inv_alpha, E, A, B, w0, anchor, t, out
    solve_ladder=(solve_ladder, (_F1, _F, _F, _F1, _F1, _F1, _F, _L1, _F1, _F1)),
    # r, a, tables, anchor, offset, beta, rbar, w_bar, injections up and down, two flags
    inverse_pullback=(
        inverse_pullback,
        (_F1, _F, types.UniTuple(_F1, 6), _L1, _F1, _F1, _F1, _F1, _F1, _F1, _B, _B),
    ),
)
_sum_tables = _NATIVE.sum_tables
_moment_tables = _NATIVE.moment_tables
_solve_ladder = _NATIVE.solve_ladder
_inverse_pullback = _NATIVE.inverse_pullback


@inner_helper
def _boundary_z(r, inv_alpha, anchor, offset, k, ri):
    """``(b_k - r_i) / alpha`` for boundary ``k`` in 0..n (``b_0 = -inf``, ``b_n = +inf``)."""
    if k == 0:
        return -INF
    if k == r.shape[0]:
        return INF
    return offset_z(r[anchor[k - 1]], ri, inv_alpha, offset[k - 1])


@helper
def _values_by_rank(r, order, target, out):
    """``out[t_i - 1] = r_i``: each sorted element's value at its target rank; returns whether
    the target ranks are a permutation (each rank once; the kernels also take repeated ranks,
    which then go the general way: :func:`_then_repeated_ranks`).

    The loss reads two boundaries per element at its target rank, a random position. With
    the element's value moved to its rank first (a tight loop of independent random writes),
    the boundaries are read in order; a long loop body with random reads kept too few misses
    in flight (the loss was 10x a sort at n = 1e6). ``r`` holds no NaN (those rows are done
    before), so a NaN left in ``out`` marks a rank not yet taken.
    """
    out[:] = np.nan
    once = True
    for i in range(r.shape[0]):
        k = target[order[i]] - 1
        if out[k] == out[k]:
            once = False
        out[k] = r[i]
    return once


@helper
def _loss_row(r, inv_alpha, order, target, anchor, offset):
    """``-sum_i log P[t_i - 1, i]`` of one row element by element (any target ranks)."""
    n = r.shape[0]
    loss = 0.0
    for i in range(n):
        k = target[order[i]] - 1
        z0 = _boundary_z(r, inv_alpha, anchor, offset, k, r[i])
        z1 = _boundary_z(r, inv_alpha, anchor, offset, k + 1, r[i])
        loss -= log_rank_probability(z0, z1)
    return loss


#: below this gap ``d = z1 - z0`` the tails' ``log(1 - exp(-d))`` and ``1 / expm1(d)`` are
#: their series (truncation under 1e-16 relative): the gap between neighbouring boundaries is
#: about ``1 / (n alpha density)``, small for the rows where time counts, and a polynomial
#: costs a fraction of ``expm1`` (and of ``expm1`` then ``log``)
SERIES_GAP = 0.1


@helper
def _log1mexp(d):
    """``log(1 - exp(-d))`` for ``d > 0``."""
    if d < SERIES_GAP:
        d2 = d * d
        # log((1 - exp(-d)) / d) = -d/2 + d^2/24 - d^4/2880 + d^6/181440 - d^8/9676800 ...
        tail = d2 * (1.0 / 181440.0 - d2 * (1.0 / 9676800.0))
        return math.log(d) - 0.5 * d + d2 * (1.0 / 24.0 - d2 * (1.0 / 2880.0 - tail))
    return math.log(-math.expm1(-d))


@helper
def _inv_expm1(d):
    """``1 / expm1(d)`` for ``d > 0`` (0 once ``expm1`` overflows)."""
    if d < SERIES_GAP:
        d2 = d * d
        # 1/d - 1/2 + d/12 - d^3/720 + d^5/30240 - d^7/1209600 ... (Bernoulli numbers)
        tail = d2 * (1.0 / 30240.0 - d2 * (1.0 / 1209600.0))
        return 1.0 / d - 0.5 + d * (1.0 / 12.0 - d2 * (1.0 / 720.0 - tail))
    return 1.0 / math.expm1(d)


@helper
def log_rank_probability(z0, z1):
    """``log(F(z1) - F(z0))`` for ``z0 <= z1``: :func:`~softorder.core.laplace.log_cdf_diff`
    with the tails' ``log(-expm1(z0 - z1))`` from :func:`_log1mexp`.
    """
    if z0 == z1:
        return -INF
    if z0 == -INF:
        return log_cdf(z1)
    if z1 == INF:
        return log_cdf(-z0)
    if z1 <= 0.0:
        return LOG_HALF + z1 + _log1mexp(z1 - z0)
    if z0 >= 0.0:
        return LOG_HALF - z0 + _log1mexp(z1 - z0)
    return math.log1p(-0.5 * (math.exp(z0) + math.exp(-z1)))


@helper
def density_ratios(z0, z1):
    """``(f(z0) / P, f(z1) / P)`` with ``P = F(z1) - F(z0)`` for ``z0 <= z1``: the loss's
    derivatives ``d(-log P)/dz0`` and ``-d(-log P)/dz1`` in closed form, without ``log P``.

    With both on one side of 0 (an element away from its two boundaries, the usual case) the
    ratios are ``1/u`` and ``1 + 1/u``, ``u = expm1(z1 - z0)`` (:func:`_inv_expm1`), where
    ``exp(log f(z) - log P)`` took four transcendentals. Both are inf where ``P = 0``
    (``z0 == z1``), as that form gives; the ratio of an infinite ``z`` is 0 (callers skip it).
    """
    if z0 == z1:
        return INF, INF
    if z0 == -INF:  # P = F(z1)
        return 0.0, hazard(z1)
    if z1 == INF:  # P = 1 - F(z0) = F(-z0), f symmetric
        return hazard(-z0), 0.0
    if z1 <= 0.0 or z0 >= 0.0:
        # z1 <= 0: P = f(z1) (1 - exp(z0 - z1)); z0 >= 0: P = f(z0) (1 - exp(z0 - z1))
        far = _inv_expm1(z1 - z0)
        near = 1.0 + far
        if z1 <= 0.0:
            return far, near
        return near, far
    e0 = 0.5 * math.exp(z0)  # f(z0) = F(z0) for z0 < 0
    e1 = 0.5 * math.exp(-z1)  # f(z1) = 1 - F(z1) for z1 > 0
    p = 1.0 - (e0 + e1)
    return e0 / p, e1 / p


@helper
def _loss_row_vjp(r, inv_alpha, order, target, anchor, offset, c, beta, rbar):
    """The loss's direct gradient terms of one row element by element (any target ranks):
    adds to ``beta`` and ``rbar``, returns the direct part of ``alpha_bar``.
    """
    n = r.shape[0]
    abar = 0.0
    for i in range(n):
        if abs(r[i]) == INF:
            continue
        k = target[order[i]] - 1
        z0 = _boundary_z(r, inv_alpha, anchor, offset, k, r[i])
        z1 = _boundary_z(r, inv_alpha, anchor, offset, k + 1, r[i])
        g0, g1 = density_ratios(z0, z1)
        # d(-log P)/dz1 = -f(z1)/P and d(-log P)/dz0 = f(z0)/P
        if abs(z1) != INF:
            gamma = -g1 * c * inv_alpha
            beta[k] += gamma
            rbar[i] -= gamma
            abar -= gamma * z1
        if abs(z0) != INF:
            gamma = g0 * c * inv_alpha
            beta[k - 1] += gamma
            rbar[i] -= gamma
            abar -= gamma * z0
    return abar


@inner_helper
def _rank_z(r, inv_alpha, anchor, offset, k, ri):
    """:func:`_boundary_z` for boundary ``k`` in 0..n (the same value)."""
    if k == 0:
        return -INF
    if k == r.shape[0]:
        return INF
    return offset_z(r[anchor[k - 1]], ri, inv_alpha, offset[k - 1])


@helper
def _loss_by_rank_vjp(r, inv_alpha, order, target, anchor, offset, c, byrank, beta, rbar):
    """:func:`_loss_row_vjp` for target ranks that are a permutation, rank by rank from
    ``byrank`` (:func:`_values_by_rank`, overwritten); writes ``rbar`` and ``beta`` (all of
    them) and returns the direct part of ``alpha_bar``, summed in the ranks' order.
    """
    n = r.shape[0]
    an = anchor
    off = offset
    abar = 0.0
    pending = 0.0  # the cotangent of boundary k from the rank below (beta[k - 1] at rank k)
    for k in range(n):  # the element of target rank k + 1, between boundaries k and k + 1
        ri = byrank[k]
        rb = 0.0
        up = 0.0
        down = 0.0
        if abs(ri) != INF:
            z0 = _rank_z(r, inv_alpha, an, off, k, ri)
            z1 = _rank_z(r, inv_alpha, an, off, k + 1, ri)
            g0, g1 = density_ratios(z0, z1)
            # d(-log P)/dz1 = -f(z1)/P and d(-log P)/dz0 = f(z0)/P
            if abs(z1) != INF:
                up = -g1 * c * inv_alpha
                rb -= up
                abar -= up * z1
            if abs(z0) != INF:
                down = g0 * c * inv_alpha
                rb -= down
                abar -= down * z0
        byrank[k] = rb
        if k > 0:
            beta[k - 1] = pending + down
        pending = up
    # back to the elements (sorted order)
    tg = target
    od = order
    for i in range(n):
        rbar[i] = byrank[tg[od[i]] - 1]
    return abar


@kernel(native=_NATIVE)
def permutation_forward(xs, order, alpha, w, worder, out, anchor, offset, work, native):
    """Soft permutation matrices ``out`` (rows, n, n); boundaries into ``anchor``/``offset``
    (rows, n-1).
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :, :] = np.nan
            anchor[row, :] = 0
            offset[row, :] = np.nan
            continue
        inv_alpha = 1.0 / alpha[row]
        E, A, B, Ad, Bd, S = _sum_tables(native, r, inv_alpha, work[row])
        # b_k = S^-1(k) for k = 1..n-1: a ladder, which solve_ladder inverts without reading w
        # or worder (no values wanted: alpha is not read)
        _solve_ladder(native, r, 1.0, inv_alpha, E, A, B, 1.0, anchor[row], offset[row], S[:0])
        for i in range(n):
            col = order[row, i]
            lo = -INF
            for k in range(n):
                hi = _boundary_z(r, inv_alpha, anchor[row], offset[row], k + 1, r[i])
                out[row, k, col] = cdf_diff(lo, hi)
                lo = hi


@kernel(native=_NATIVE)
def permutation_vjp(
    xs, order, alpha, anchor, offset, worder, V, x_bar, alpha_bar, work, twork, native
):
    """Cotangent ``V`` (rows, n, n) -> ``x_bar`` (rows, n), ``alpha_bar`` (rows,). O(n^2), the
    size of ``V``; the chain through the boundaries is O(n).
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        tables = _moment_tables(native, r, inv_alpha, work[row])
        beta = twork[row, 0]  # the cotangent on the boundaries
        beta[:] = 0.0
        rbar = work[row, TABLES_WITH_MOMENTS]
        rbar[:] = 0.0
        abar = 0.0
        for i in range(n):
            if abs(r[i]) == INF:
                continue
            col = order[row, i]
            for k in range(1, n):
                z = _boundary_z(r, inv_alpha, anchor[row], offset[row], k, r[i])
                if abs(z) == INF:
                    continue
                gamma = 0.5 * math.exp(-abs(z)) * (V[row, k - 1, col] - V[row, k, col]) * inv_alpha
                beta[k - 1] += gamma
                rbar[i] -= gamma
                abar -= gamma * z
        # beta through the boundaries into rbar; the pullback's injections go in S's row
        # (spent) and the last row of work
        alpha_bar[row] = abar + _inverse_pullback(
            native,
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            beta,
            rbar,
            twork[row, 1, :m],
            work[row, 3, :n],
            work[row, TABLES_WITH_MOMENTS + 1, :n],
            False,
            False,
        )
        scatter_finite(r, order[row], rbar, x_bar[row])


def _then_repeated_ranks(repeated):
    """A loss kernel that leaves the rows whose target ranks repeat to the kernel ``repeated``.

    The API takes only permutations (it refuses repeated ranks); the kernels take any ranks.
    The permutation kernel writes NaN in the other rows and returns their count; ``repeated``
    then overwrites those rows. In a kernel of its own, the element-by-element path is
    compiled the first time a call needs it, not on every first call. ``serial`` and
    ``parallel`` are the permutation kernel's.
    """

    def wrap(permutations):
        @functools.wraps(permutations)
        def run(xs, *args):
            if permutations(xs, *args):
                repeated(xs, *args)

        run.serial = permutations.serial
        run.parallel = permutations.parallel
        run.repeated = repeated
        return run

    return wrap


@kernel(native=_NATIVE)
def _loss_forward_repeated(xs, order, alpha, target, w, worder, out, anchor, offset, work, native):
    """:func:`permutation_loss_forward` of the rows whose target ranks repeat, element by
    element (their boundaries are solved already).
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r) or _values_by_rank(r, order[row], target[row], work[row, 0]):
            continue
        inv_alpha = 1.0 / alpha[row]
        out[row] = _loss_row(r, inv_alpha, order[row], target[row], anchor[row], offset[row])


@_then_repeated_ranks(_loss_forward_repeated)
@kernel(native=_NATIVE)
def permutation_loss_forward(
    xs, order, alpha, target, w, worder, out, anchor, offset, work, native
):
    """``out[row] = -sum_i log P[target_i - 1, i]`` for 1-based target ranks (rows, n)."""
    rows, n = xs.shape
    repeated = 0
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row] = np.nan
            anchor[row, :] = 0
            offset[row, :] = np.nan
            continue
        inv_alpha = 1.0 / alpha[row]
        E, A, B, Ad, Bd, S = _sum_tables(native, r, inv_alpha, work[row])
        _solve_ladder(native, r, 1.0, inv_alpha, E, A, B, 1.0, anchor[row], offset[row], S[:0])
        # the tables are spent once the boundaries are solved
        terms = work[row, 0]
        if not _values_by_rank(r, order[row], target[row], terms):
            out[row] = np.nan
            repeated += 1
            continue
        an = anchor[row]
        off = offset[row]
        loss = 0.0
        for k in range(n):  # the element of target rank k + 1, between boundaries k and k + 1
            ri = terms[k]
            z0 = _rank_z(r, inv_alpha, an, off, k, ri)
            z1 = _rank_z(r, inv_alpha, an, off, k + 1, ri)
            loss -= log_rank_probability(z0, z1)
        out[row] = loss
    return repeated


@kernel(native=_NATIVE)
def _loss_vjp_repeated(
    xs, order, alpha, target, anchor, offset, worder, cot, x_bar, alpha_bar, work, twork, native
):
    """:func:`permutation_loss_vjp` of the rows whose target ranks repeat, element by element."""
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r) or _values_by_rank(r, order[row], target[row], work[row, 3]):
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        tables = _moment_tables(native, r, inv_alpha, work[row])
        beta = twork[row, 0]
        beta[:] = 0.0
        rbar = work[row, TABLES_WITH_MOMENTS]
        rbar[:] = 0.0
        abar = _loss_row_vjp(
            r, inv_alpha, order[row], target[row], anchor[row], offset[row], cot[row], beta, rbar
        )
        # beta through the boundaries into rbar; the pullback's injections go in S's row
        # (spent) and x_bar's row (free until the scatter)
        alpha_bar[row] = abar + _inverse_pullback(
            native,
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            beta,
            rbar,
            beta[:0],
            work[row, 3, :n],
            x_bar[row],
            False,
            False,
        )
        scatter_finite(r, order[row], rbar, x_bar[row])


@_then_repeated_ranks(_loss_vjp_repeated)
@kernel(native=_NATIVE)
def permutation_loss_vjp(
    xs, order, alpha, target, anchor, offset, worder, cot, x_bar, alpha_bar, work, twork, native
):
    """Cotangent ``cot`` (rows,) on the loss -> ``x_bar`` (rows, n), ``alpha_bar`` (rows,). O(n).

    Scratch ``work`` (rows, >= ``LOSS_GRADIENT_WORK``, n) and ``twork`` (rows,
    >= ``LOSS_BOUNDARY_WORK``, >= n - 1).
    """
    rows, n = xs.shape
    repeated = 0
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        # Only the pullback reads the tables, so they are filled after the direct terms:
        # until then x_bar's row holds the values by rank. The pullback's injections go in
        # S's row (only the forward's solve reads S) and x_bar's row (free until the
        # scatter); it is not asked for w_bar.
        byrank = x_bar[row]
        if not _values_by_rank(r, order[row], target[row], byrank):
            x_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            repeated += 1
            continue
        beta = twork[row, 0]
        rbar = work[row, TABLES_WITH_MOMENTS]
        abar = _loss_by_rank_vjp(
            r,
            inv_alpha,
            order[row],
            target[row],
            anchor[row],
            offset[row],
            cot[row],
            byrank,
            beta,
            rbar,
        )
        tables = _moment_tables(native, r, inv_alpha, work[row])
        # beta through the boundaries into rbar
        alpha_bar[row] = abar + _inverse_pullback(
            native,
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            beta,
            rbar,
            beta[:0],
            work[row, 3, :n],
            x_bar[row],
            False,
            False,
        )
        scatter_finite(r, order[row], rbar, x_bar[row])
    return repeated


@kernel
def permutation_jvp(xs, order, alpha, anchor, offset, worder, x_dot, alpha_dot, out, work, twork):
    """Tangents ``x_dot`` (rows, n), ``alpha_dot`` (rows,) -> tangent of ``P`` (rows, n, n).

    ``dP[k, i] = f(z_(k+1),i) dz_(k+1),i - f(z_k,i) dz_k,i`` with
    ``dz_j,i = (db_j - dr_i - z_j,i dalpha) / alpha``; the boundary tangents ``db_j`` come from
    one O(n) merge, the rest is O(n^2), the size of ``P``.
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :, :] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        tables = moment_tables(r, inv_alpha, work[row])
        rdot = work[row, TABLES_WITH_MOMENTS]
        gather_finite(r, order[row], x_dot[row], rdot)
        m = n - 1
        b_dot = twork[row, 0, :m]
        w_dot = twork[row, 1, :m]
        w_dot[:] = 0.0
        inverse_pushforward(
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            worder,
            rdot,
            w_dot,
            alpha_dot[row],
            b_dot,
            twork[row, 2:],
        )
        for i in range(n):
            col = order[row, i]
            lower = 0.0  # f(z_k,i) dz_k,i of the previous boundary; 0 at b_0 = -inf
            for k in range(n):
                upper = 0.0
                if k + 1 < n:
                    z = _boundary_z(r, inv_alpha, anchor[row], offset[row], k + 1, r[i])
                    if abs(z) != INF:
                        dz = (b_dot[k] - rdot[i] - z * alpha_dot[row]) * inv_alpha
                        upper = 0.5 * math.exp(-abs(z)) * dz
                out[row, k, col] = upper - lower
                lower = upper
