"""Soft permutation matrix and the permutation cross-entropy loss.

With boundaries ``b_0 = -inf``, ``b_k = S^-1(k)`` (k = 1..n-1), ``b_n = +inf``:
``P[k, i] = F((b_(k+1) - r_i) / alpha) - F((b_k - r_i) / alpha)`` (0-based row k), a doubly
stochastic matrix with ``P @ r`` a soft-sorted row. The matrix is the one O(n^2) output; the
loss ``-sum_i log P[t_i - 1, i]`` needs only two boundaries per element and costs O(n).
Gradients chain through ``F`` directly and through the boundaries with
:func:`softorder.core.lapsum.inverse_pullback` (one O(n) merge).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import prange, types

from softorder.core import fast_exp
from softorder.core._jit import SymbolCalls, helper, inner_helper, kernel
from softorder.core.kernel_sums import carry_both_ways_inline
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
    empty,
    inverse_pullback,
    inverse_pushforward,
    moment_tables,
    solve_ladder,
    stack_rows,
    sum_tables,
)
from softorder.core.rank import decays
from softorder.core.rows import (
    AHEAD,
    PREFETCH_FROM,
    gather_finite,
    has_nan,
    prefetch,
    scatter_finite,
)
from softorder.core.sort import (
    _ADDED,
    _BEYOND,
    _BLOCK_ROWS,
    _SKIP,
    OTHER_TARGET,
    TBLOCK,
    WINDOW,
    _call_other_target,
    _descending_from_decays,
    _moments_up_to,
    _move_to_rows,
    _target_points,
    _then_linked,
    _usual_weights,
)

#: the tables with moments: the matrix's forward fills them (its gradient's tables, so that a
#: process compiles one table helper for both; the loss's forward reads the first TABLES)
FORWARD_WORK = TABLES_WITH_MOMENTS
#: the loss's general forward (:func:`permutation_loss_forward`): the tables without moments
LOSS_FORWARD_WORK = TABLES
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
# r, inv_alpha, work
_MOMENT_TABLES = (moment_tables, (_F1, _F, _F2))
# r, alpha, inv_alpha, E, A, B, w0, anchor, t, out
_SOLVE_LADDER = (solve_ladder, (_F1, _F, _F, _F1, _F1, _F1, _F, _L1, _F1, _F1))
# r, a, tables, anchor, offset, beta, rbar, w_bar, injections up and down, two flags
_INVERSE_PULLBACK = (
    inverse_pullback,
    (_F1, _F, types.UniTuple(_F1, 6), _L1, _F1, _F1, _F1, _F1, _F1, _F1, _B, _B),
)
#: the per-row helpers of the matrix's and the general loss's kernels, called by symbol: a
#: first call compiles only the helpers that its kernels call, each once for all of them (not
#: again inside each kernel)
_CALLS = SymbolCalls(
    sum_tables=(sum_tables, (_F1, _F, _F2)),
    moment_tables=_MOMENT_TABLES,
    solve_ladder=_SOLVE_LADDER,
    inverse_pullback=_INVERSE_PULLBACK,
)
_call_sum_tables = _CALLS.sum_tables
_call_moment_tables = _CALLS.moment_tables
_call_solve_ladder = _CALLS.solve_ladder
_call_inverse_pullback = _CALLS.inverse_pullback


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
    the boundaries are read in order; a long loop body with random reads keeps too few misses
    in flight on long rows. ``r`` holds no NaN (those rows are done
    before), so a NaN left in ``out`` marks a rank not yet taken.
    """
    out[:] = np.nan
    once = True
    n = r.shape[0]
    ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
    for i in range(n):
        if ahead:  # (a condition the loop does not change: LLVM splits it)
            # two random places per element: the target rank, read a step before its slot
            prefetch(target, order[i + ahead if i + ahead < n else n - 1])
            h = i + ahead // 2
            prefetch(out, target[order[h if h < n else n - 1]] - 1)
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
def _log1mexp_even(d):
    """The even part ``d^2/24 - d^4/2880 + d^6/181440 - d^8/9676800`` of the series
    ``log((1 - exp(-d)) / d) = -d/2 + d^2/24 - ...`` (``d < SERIES_GAP``).
    """
    d2 = d * d
    tail = d2 * (1.0 / 181440.0 - d2 * (1.0 / 9676800.0))
    return d2 * (1.0 / 24.0 - d2 * (1.0 / 2880.0 - tail))


@helper
def _log1mexp(d):
    """``log(1 - exp(-d))`` for ``d > 0``."""
    if d < SERIES_GAP:
        return math.log(d) - 0.5 * d + _log1mexp_even(d)
    return math.log(-math.expm1(-d))


@helper
def _inv_expm1_series(d):
    """``1 / expm1(d)`` by its series, for ``d < SERIES_GAP``."""
    d2 = d * d
    # 1/d - 1/2 + d/12 - d^3/720 + d^5/30240 - d^7/1209600 ... (Bernoulli numbers)
    tail = d2 * (1.0 / 30240.0 - d2 * (1.0 / 1209600.0))
    return 1.0 / d - 0.5 + d * (1.0 / 12.0 - d2 * (1.0 / 720.0 - tail))


@helper
def _inv_expm1(d):
    """``1 / expm1(d)`` for ``d > 0``: its series below :data:`SERIES_GAP`, else
    ``e / (1 - e)`` with ``e = exp(-d)`` (0 once ``e`` underflows), whose operations the
    block loop repeats (:func:`_usual_rank_terms`): within 7 eps from ``SERIES_GAP`` on.
    """
    if d < SERIES_GAP:
        return _inv_expm1_series(d)
    return _inv_expm1_of_decay(math.exp(-d))


@inner_helper
def _inv_expm1_of_decay(e):
    """``1 / expm1(d)`` from ``e = exp(-d)``: :func:`_inv_expm1`'s and the block loop's."""
    return e / (1.0 - e)


#: the widest gap whose rank the block loops take: ``exp(-d)`` is then
#: :func:`~softorder.core.fast_exp.exp_main`'s (``|x| < LARGE``)
WIDE_GAP = fast_exp.LARGE


@inner_helper
def _decay(d):
    """``math.exp(-d)`` for ``SERIES_GAP <= d < WIDE_GAP`` (any double elsewhere): the
    factor of a wide gap, in a loop LLVM vectorizes where
    :data:`~softorder.core.fast_exp.FAST_EXP`.
    """
    if fast_exp.FAST_EXP:
        return fast_exp.exp_main(-d)
    return math.exp(-d) if SERIES_GAP <= d < WIDE_GAP else 0.0


@helper
def log_rank_probability(z0, z1):
    """``log(F(z1) - F(z0))`` for ``z0 <= z1``, stable in both tails: there
    ``F(z1) - F(z0) = f(z) (1 - exp(z0 - z1))`` with ``z`` the end nearer 0, and the log of the
    second factor is :func:`_log1mexp`.
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


#: ranks whose ``log d`` (the gap between their two boundaries) :func:`_loss_by_rank` takes
#: as one log of their product
LOG_GROUP = 8
#: the smallest gap whose ``log d`` joins a product: ``LOG_GROUP`` of them stay above 1e-280,
#: far from underflow (a smaller gap, a tie's, takes its own log)
PRODUCT_MIN_GAP = 1e-35


@helper
def _loss_by_rank(r, inv_alpha, anchor, offset, byrank):
    """``-sum_k log P_k`` of one row whose target ranks are a permutation, from the values by
    rank ``byrank`` (:func:`_values_by_rank`) and the boundaries ``anchor``, ``offset``.

    ``log P_k`` is :func:`log_rank_probability`. Where both boundaries are on one side of the
    element (the usual case) it is ``log(1/2) - |z| + log(1 - exp(-d))`` (``z`` the nearer
    boundary, ``d = z1 - z0`` the gap): for a gap in [PRODUCT_MIN_GAP, SERIES_GAP) by the
    series ``log d - d/2 + even(d)``, for a gap in [SERIES_GAP, WIDE_GAP) as it is. The logs
    of :data:`LOG_GROUP` such ranks' factors (``d``, or ``1 - exp(-d)``, at least 0.095) are
    one log of their product, summed apart: one ``log`` per 8 ranks instead of one each. The
    product's 7 roundings move its log by at most 3.5 eps, less than the roundings of the 8
    logs it replaces; every part is positive, so nothing cancels (tests: within 16 eps of 40
    digits, closer on average than the element-by-element sum).

    The ranks come :data:`~softorder.core.sort.TBLOCK` at a time: their values and their
    boundaries' anchor values and offsets into rows on the stack, then the usual ranks' terms
    and gaps from those rows alone (:func:`_usual_log_terms`, a loop LLVM vectorizes), then
    the sums in the ranks' order, the other ranks' :func:`log_rank_probability` among them
    (the row's ends, an element between or far from its boundaries, a tie).
    """
    n = r.shape[0]
    b_t, b_ra = stack_rows(2, _SLOTS, np.float64)
    b_ri, b_term, b_gap = stack_rows(3, TBLOCK, np.float64)
    loss = 0.0
    logs = 0.0
    product = 1.0
    count = 0
    for k0 in range(0, n, TBLOCK):
        kn = TBLOCK if n - k0 >= TBLOCK else n - k0
        for kk in range(kn + 1):  # boundary k0 + kk - 1 (b_0 = -inf, b_n = +inf: NaN)
            j = k0 + kk - 1
            inside = j >= 0 and j < n - 1
            b_t[kk] = offset[j] if inside else 0.0
            b_ra[kk] = r[anchor[j]] if inside else np.nan
        for kk in range(kn):
            b_ri[kk] = byrank[k0 + kk]
        _usual_log_terms(inv_alpha, b_t, b_ra, b_ri, b_term, b_gap)
        for kk in range(kn):  # the element of target rank k + 1, between boundaries k, k + 1
            d = b_gap[kk]
            if d == d:  # the usual rank
                loss -= b_term[kk]
                product *= d
                count += 1
                if count == LOG_GROUP:
                    logs += math.log(product)
                    product = 1.0
                    count = 0
            else:
                k = k0 + kk
                ri = b_ri[kk]
                z0 = offset_z(b_ra[kk], ri, inv_alpha, b_t[kk]) if k > 0 else -INF
                z1 = offset_z(b_ra[kk + 1], ri, inv_alpha, b_t[kk + 1]) if k < n - 1 else INF
                loss -= log_rank_probability(z0, z1)
    return loss - (logs + math.log(product))  # (log(1) = 0: nothing left over)


@inner_helper
def _usual_log_terms(inv_alpha, b_t, b_ra, b_ri, b_term, b_gap):
    """The usual ranks' terms of :func:`_loss_by_rank` from its block's rows alone (slot
    ``kk`` a rank's value and its lower boundary, ``kk + 1`` its upper one), with its
    operations, so their values to the bit: ``b_term`` the term less the log of ``b_gap``,
    which is the gap ``d`` below SERIES_GAP and ``1 - exp(-d)`` above, NaN for the other
    ranks. Loops LLVM vectorizes (a short last block's extra slots hold values never used);
    the second, for wide gaps' ``exp`` (:func:`_decay`), runs only where a block has one.
    """
    wide_gaps = False
    for kk in range(TBLOCK):
        ri = b_ri[kk]
        z0 = _offset_z_select(b_ra[kk], ri, inv_alpha, b_t[kk])
        z1 = _offset_z_select(b_ra[kk + 1], ri, inv_alpha, b_t[kk + 1])
        d = z1 - z0
        below = z1 <= 0.0
        one_side = below | (z0 >= 0.0)
        series = (PRODUCT_MIN_GAP <= d) & (d < SERIES_GAP) & one_side
        wide = (d >= SERIES_GAP) & (d < WIDE_GAP) & one_side
        wide_gaps |= wide
        near = z1 if below else -z0  # -|z| of the boundary nearer the element
        b_term[kk] = (
            (LOG_HALF + near) + (_log1mexp_even(d) - 0.5 * d) if series else LOG_HALF + near
        )
        b_gap[kk] = d if series else (-d if wide else np.nan)  # (a wide gap marked by its sign)
    if wide_gaps:
        for kk in range(TBLOCK):
            g = b_gap[kk]
            e = _decay(-g)  # (for every slot, then a select: the loop stays vectorized)
            b_gap[kk] = 1.0 - e if g < 0.0 else g


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
def _rank_terms(z0, z1, finite, c, inv_alpha):
    """The direct terms of the element between boundaries ``z0 <= z1`` (its standardized
    distances from them), ``finite``: the element's value is finite (0 terms otherwise), loss
    cotangent ``c``: its gradient ``rb``, the cotangents ``up`` and ``down`` of the upper and
    lower boundary, and their parts of ``alpha_bar`` before the sign, ``up * z1`` and
    ``down * z0`` (the callers subtract them one after the other, in that order).

    Scalars only: an inlined helper that takes arrays increfs and decrefs each of them on
    every call (atomic operations), which took three quarters of the VJP's direct terms.
    """
    rb = 0.0
    up = 0.0
    down = 0.0
    up_z1 = 0.0
    down_z0 = 0.0
    if finite:
        g0, g1 = density_ratios(z0, z1)
        # d(-log P)/dz1 = -f(z1)/P and d(-log P)/dz0 = f(z0)/P
        if abs(z1) != INF:
            up = -g1 * c * inv_alpha
            rb -= up
            up_z1 = up * z1
        if abs(z0) != INF:
            down = g0 * c * inv_alpha
            rb -= down
            down_z0 = down * z0
    return rb, up, down, up_z1, down_z0


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
        # (_boundary_z's values, read here: see _rank_terms)
        ri = byrank[k]
        z0 = offset_z(r[an[k - 1]], ri, inv_alpha, off[k - 1]) if k > 0 else -INF
        z1 = offset_z(r[an[k]], ri, inv_alpha, off[k]) if k < n - 1 else INF
        rb, up, down, up_z1, down_z0 = _rank_terms(z0, z1, abs(ri) != INF, c, inv_alpha)
        abar -= up_z1
        abar -= down_z0
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


@kernel
def permutation_forward(xs, order, alpha, w, worder, out, anchor, offset, work):
    """Soft permutation matrices ``out`` (rows, n, n); boundaries into ``anchor``/``offset``
    (rows, n-1). ``work``: (rows, FORWARD_WORK, n) scratch.
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            for k in range(n):  # (loops: slice assignments compile NumPy's setitem)
                for i in range(n):
                    out[row, k, i] = np.nan
            for k in range(anchor.shape[1]):
                anchor[row, k] = 0
                offset[row, k] = np.nan
            continue
        inv_alpha = 1.0 / alpha[row]
        # the tables with moments (O(n) beside the O(n^2) matrix), whose E, A, B are those of
        # sum_tables to the bit: the gradient's helper, so a process compiles one of the two
        E, A, B, Ad, Bd, S = _call_moment_tables(r, inv_alpha, work[row])
        # b_k = S^-1(k) for k = 1..n-1: a ladder, which solve_ladder inverts without reading w
        # or worder (no values wanted: alpha is not read)
        an = anchor[row]
        off = offset[row]
        _call_solve_ladder(r, 1.0, inv_alpha, E, A, B, 1.0, an, off, S[:0])
        for i in range(n):
            col = order[row, i]
            lo = -INF
            for k in range(n):
                hi = _boundary_z(r, inv_alpha, an, off, k + 1, r[i])
                out[row, k, col] = cdf_diff(lo, hi)
                lo = hi


@kernel
def permutation_vjp(xs, order, alpha, anchor, offset, worder, V, x_bar, alpha_bar, work, twork):
    """Cotangent ``V`` (rows, n, n) -> ``x_bar`` (rows, n), ``alpha_bar`` (rows,). O(n^2), the
    size of ``V``; the chain through the boundaries is O(n). ``work``: (rows, GRADIENT_WORK,
    n) and ``twork``: (rows, BOUNDARY_WORK, n - 1) scratch.
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
        tables = _call_moment_tables(r, inv_alpha, work[row])
        an = anchor[row]
        off = offset[row]
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
                z = _boundary_z(r, inv_alpha, an, off, k, r[i])
                if abs(z) == INF:
                    continue
                gamma = 0.5 * math.exp(-abs(z)) * (V[row, k - 1, col] - V[row, k, col]) * inv_alpha
                beta[k - 1] += gamma
                rbar[i] -= gamma
                abar -= gamma * z
        # beta through the boundaries into rbar; the pullback's injections go in S's row
        # (spent) and the last row of work
        alpha_bar[row] = abar + _call_inverse_pullback(
            r,
            a,
            tables,
            an,
            off,
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


@kernel
def _loss_forward_repeated(xs, order, alpha, target, w, worder, out, anchor, offset, work):
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
@kernel
def permutation_loss_forward(xs, order, alpha, target, w, worder, out, anchor, offset, work):
    """``out[row] = -sum_i log P[target_i - 1, i]`` for 1-based target ranks (rows, n).

    ``work``: (rows, LOSS_FORWARD_WORK, n) scratch.
    """
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
        E, A, B, Ad, Bd, S = _call_sum_tables(r, inv_alpha, work[row])
        _call_solve_ladder(r, 1.0, inv_alpha, E, A, B, 1.0, anchor[row], offset[row], S[:0])
        # the tables are spent once the boundaries are solved
        terms = work[row, 0]
        if not _values_by_rank(r, order[row], target[row], terms):
            out[row] = np.nan
            repeated += 1
            continue
        out[row] = _loss_by_rank(r, inv_alpha, anchor[row], offset[row], terms)
    return repeated


@kernel
def _loss_vjp_repeated(
    xs, order, alpha, target, anchor, offset, worder, cot, x_bar, alpha_bar, work, twork
):
    """:func:`permutation_loss_vjp` of the rows whose target ranks repeat, element by element."""
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r) or _values_by_rank(r, order[row], target[row], work[row, 3]):
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        tables = _call_moment_tables(r, inv_alpha, work[row])
        beta = twork[row, 0]
        beta[:] = 0.0
        rbar = work[row, TABLES_WITH_MOMENTS]
        rbar[:] = 0.0
        abar = _loss_row_vjp(
            r, inv_alpha, order[row], target[row], anchor[row], offset[row], cot[row], beta, rbar
        )
        # beta through the boundaries into rbar; the pullback's injections go in S's row
        # (spent) and x_bar's row (free until the scatter)
        alpha_bar[row] = abar + _call_inverse_pullback(
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
@kernel
def permutation_loss_vjp(
    xs, order, alpha, target, anchor, offset, worder, cot, x_bar, alpha_bar, work, twork
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
        tables = _call_moment_tables(r, inv_alpha, work[row])
        # beta through the boundaries into rbar
        alpha_bar[row] = abar + _call_inverse_pullback(
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
    one O(n) merge, the rest is O(n^2), the size of ``P``. ``work``: (rows, GRADIENT_WORK, n)
    and ``twork``: (rows, BOUNDARY_WORK, n - 1) scratch.
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
            # an infinite entry's column is constant, as the VJP has it: in a block of equal
            # infinities b_k - r_i = alpha z stays finite, and dz = (db_k - dr_i - z dalpha) /
            # alpha would leave -z dalpha / alpha there (db_k is 0 at an infinite boundary)
            finite = abs(r[i]) != INF
            lower = 0.0  # f(z_k,i) dz_k,i of the previous boundary; 0 at b_0 = -inf
            for k in range(n):
                upper = 0.0
                if finite and k + 1 < n:
                    z = _boundary_z(r, inv_alpha, anchor[row], offset[row], k + 1, r[i])
                    if abs(z) != INF:
                        dz = (b_dot[k] - rdot[i] - z * alpha_dot[row]) * inv_alpha
                        upper = 0.5 * math.exp(-abs(z)) * dz
                out[row, k, col] = upper - lower
                lower = upper


# The CPU kernels of the loss that the API calls: int32 anchors, and a VJP in 3 rows of
# scratch (the general kernels above fill 7 rows and a row of n - 1 for the boundaries'
# cotangents).

#: rows of scratch of :func:`ladder_loss_forward`: E, A, B (the values by rank then go in E's)
LADDER_FORWARD_WORK = 3
#: rows of scratch of :func:`ladder_loss_vjp`: E, B, Bd (the values by rank, then the direct
#: terms by rank, go in the row of ``x_bar``)
LADDER_VJP_WORK = 3

#: the rows of :func:`_ladder_loss_row_vjp`'s block of ranks: each rank's value, its direct
#: terms (:func:`_rank_terms`' five) and whether they are the usual rank's
_RANK_ROWS = 7
#: the slots of its boundaries' rows: one more than the ranks, for the last one's upper boundary
_SLOTS = TBLOCK + 1

_I32_1 = types.Array(types.int32, 1, "C")


@helper
def _tables_from_decays(E, A, B):
    """``A`` and ``B`` of :func:`~softorder.core.lapsum.prefix_tables_halves` (the operations of
    :func:`~softorder.core.lapsum.prefix_sums`, so the same values to the bit) from the decays
    ``E`` (:func:`~softorder.core.rank.decays`: ``exp`` in a loop LLVM vectorizes): the two
    recurrences side by side, ``A`` up and ``B`` down, each one's latency hiding the other's.
    """
    n = E.shape[0]
    A[0] = 1.0
    B[n - 1] = 1.0
    a = 1.0
    b = 1.0
    for i in range(1, n):
        a = 1.0 + E[i] * a
        A[i] = a
        j = np.uint64(n - 1 - i)  # (unsigned: no wraparound)
        b = 1.0 + E[j + np.uint64(1)] * b
        B[j] = b


#: the per-row helpers of the ladder kernels, called by symbol (compiled once, not again
#: inside each kernel)
_LADDER_CALLS = SymbolCalls(
    # r, inv_alpha, E (the same helper and types as soft sort's forward: compiled once)
    decays=(decays, (_F1, _F, _F1)),
    # E, A, B
    tables_from_decays=(_tables_from_decays, (_F1, _F1, _F1)),
    # r, alpha, inv_alpha, E, A, B, w0, anchor, t, out
    solve_ladder=(solve_ladder, (_F1, _F, _F, _F1, _F1, _F1, _F, _I32_1, _F1, _F1)),
    # r, inv_alpha, E, B, Bd
    descending_from_decays=(_descending_from_decays, (_F1, _F, _F1, _F1, _F1)),
    # r, inv_alpha, anchor, offset, byrank
    loss_by_rank=(_loss_by_rank, (_F1, _F, _I32_1, _F1, _F1)),
)
_call_decays = _LADDER_CALLS.decays
_call_tables_from_decays = _LADDER_CALLS.tables_from_decays
_call_solve_ladder_int32 = _LADDER_CALLS.solve_ladder
_call_descending_from_decays = _LADDER_CALLS.descending_from_decays
_call_loss_by_rank = _LADDER_CALLS.loss_by_rank


@kernel
def _ladder_forward_rows(xs, order, alpha, target, out, anchor, offset, work):
    """:func:`permutation_loss_forward` with int32 anchors in 3 rows of scratch (``S`` is not
    stored: :func:`~softorder.core.lapsum.solve_ladder` computes it in its count): the same
    boundaries and losses to the bit. Rows whose target ranks repeat get NaN; returns their
    count.
    """
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
        E = work[row, 0]
        A = work[row, 1]
        B = work[row, 2]
        an = anchor[row]
        off = offset[row]
        _call_decays(r, inv_alpha, E)
        _call_tables_from_decays(E, A, B)
        _call_solve_ladder_int32(r, 1.0, inv_alpha, E, A, B, 1.0, an, off, E[:0])
        terms = E  # spent once the boundaries are solved
        if not _values_by_rank(r, order[row], target[row], terms):
            out[row] = np.nan
            repeated += 1
            continue
        out[row] = _call_loss_by_rank(r, inv_alpha, an, off, terms)
    return repeated


@kernel
def _ladder_forward_repeated(xs, order, alpha, target, out, anchor, offset, work):
    """:func:`_loss_forward_repeated` for :func:`ladder_loss_forward` (int32 anchors)."""
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r) or _values_by_rank(r, order[row], target[row], work[row, 0]):
            continue
        inv_alpha = 1.0 / alpha[row]
        out[row] = _loss_row(r, inv_alpha, order[row], target[row], anchor[row], offset[row])


def ladder_loss_forward(xs, order, alpha, target, out, anchor, offset, work, repeated=True):
    """``out[row] = -sum_i log P[target_i - 1, i]`` (1-based target ranks, rows (rows, n))
    with the boundaries into int32 ``anchor`` (rows shorter than 2**31) and ``offset``
    (rows, n - 1); ``work`` (rows, :data:`LADDER_FORWARD_WORK`, n). The same values to the
    bit as :func:`permutation_loss_forward`. Rows whose target ranks repeat run element by
    element in a kernel of their own, compiled when first needed, or, with ``repeated``
    false (a caller that refuses them: the API), keep a NaN loss. Returns their count (rows
    with NaN are not counted: their ranks are not read), which lets the API check the ranks'
    permutations here instead of in a pass of its own.
    """
    count = _ladder_forward_rows(xs, order, alpha, target, out, anchor, offset, work)
    if count and repeated:
        _ladder_forward_repeated(xs, order, alpha, target, out, anchor, offset, work)
    return count


@helper
def _ladder_loss_row_vjp(r, alpha, inv_alpha, E, B, Bd, anchor, offset, c, byrank):
    """The direct terms of :func:`_loss_by_rank_vjp` and the pullback of the boundaries'
    cotangents ``beta`` (:func:`~softorder.core.lapsum.inverse_pullback`) in one pass over
    the ranks: boundary ``k - 1``'s cotangent is complete at rank ``k``, and the boundaries
    (targets ``1..n-1``) ascend, so each is pulled back as it comes, with ``beta`` in a
    register instead of a row. With ``M`` the largest left point ``L`` so far, later
    boundaries have ``L >= M - 2`` (a ladder), so ``B`` and ``Bd`` are never read again at the
    points up to ``M - 2``: those slots take their points' injections, moved there from a
    window of :data:`~softorder.core.sort.WINDOW` points :data:`~softorder.core.sort.BATCH` at a
    time, and ``A``, ``Ad`` come from their recurrences ``BATCH`` points at a time; the other
    targets by :func:`~softorder.core.sort._other_target`. Every injection is added in the
    boundaries' order, as in the rows of injections of ``inverse_pullback``. Writes the
    direct terms into ``byrank`` (rank order) and returns ``(direct alpha_bar, pullback
    alpha_bar, done)``: the same operations in the same order as the general kernel, so the
    same bits. ``done`` false: a target out of order, or a tie that throws an injection
    beyond the window (``byrank``, ``B``, ``Bd`` then hold nothing usable; the caller takes
    the general path).

    The ranks come :data:`~softorder.core.sort.TBLOCK` at a time, as the targets of soft
    sort's :func:`~softorder.core.sort._ladder_pullback`, in three passes: the first reads
    each rank's value and its lower boundary's values at its points into the block's rows
    (on the stack; the upper boundary is the next slot's lower one); the second computes the
    usual ranks' direct terms (:func:`_usual_rank_terms`) and the usual boundaries' weights
    (:func:`~softorder.core.sort._usual_weights`) from those rows alone, in loops LLVM
    vectorizes (``B[R]``, ``Bd[R]`` read ahead: the block's earlier injections go to the
    points below ``F <= M - 1 <= R``); the third sums the terms in the ranks' order and adds
    the injections in the boundaries' order. The other ranks (a row's ends, an element
    between or far from its boundaries, an infinite value) take :func:`_rank_terms` there,
    the other boundaries (ties, rounding, a factor outside ``exp_main``'s range)
    :func:`~softorder.core.sort._other_target` through
    :data:`~softorder.core.sort.OTHER_TARGET` (the rare path, compiled when a row first needs
    it), or, while it is not linked, stop with ``done`` false.
    """
    n = r.shape[0]
    win_up = empty((WINDOW,), np.float64)
    win_down = empty((WINDOW,), np.float64)
    for i in range(WINDOW):
        win_up[i] = 0.0
        win_down[i] = 0.0
    mask = WINDOW - 1
    # the block's rows on the stack: slot kk holds rank k0 + kk and its lower boundary
    # k0 + kk - 1 (the boundaries' rows one slot longer, for the last rank's upper one)
    b_t, b_ra, b_rl, b_rr, b_br, b_bdr, b_el, b_er, b_zl, b_gr, b_zr = stack_rows(
        _BLOCK_ROWS, _SLOTS, np.float64
    )
    b_ri, b_rb, b_up, b_down, b_upz, b_downz, b_usual = stack_rows(_RANK_ROWS, TBLOCK, np.float64)
    left = stack_rows(1, _SLOTS, np.int64)[0]
    M = 1  # the largest L so far (at least 1)
    F = 0  # the points below F hold their injections; the window those from F on
    P = 0  # A, Ad are known at the points up to P - 1, kept from P - WINDOW on
    a_win = empty((WINDOW,), np.float64)
    ad_win = empty((WINDOW,), np.float64)
    a = 1.0
    ad = 0.0
    lo = r[0]  # r[P - 1] once P > 0
    abar = 0.0  # the direct terms' part, summed in the ranks' order
    alpha_bar = 0.0  # the pullback's part, summed in the boundaries' order
    pending = 0.0  # the cotangent of boundary k from the rank below
    for k0 in range(0, n, TBLOCK):
        kn = TBLOCK if n - k0 >= TBLOCK else n - k0
        for kk in range(kn + 1):  # boundary j = k0 + kk - 1: its points and values there
            j = k0 + kk - 1
            if j >= 0 and j < n - 1:
                an = np.int64(anchor[j])
                _target_points(
                    r, B, Bd, an, offset[j], kk, left, b_t, b_ra, b_rl, b_rr, b_br, b_bdr
                )
            else:  # b_0 = -inf and b_n = +inf: a NaN anchor value, never the usual case
                left[kk] = 0
                b_t[kk] = 0.0
                b_ra[kk] = np.nan
                b_rl[kk] = np.nan
                b_rr[kk] = np.nan
                b_br[kk] = 0.0
                b_bdr[kk] = 0.0
        for kk in range(kn):
            b_ri[kk] = byrank[k0 + kk]
        _usual_rank_terms(
            inv_alpha, c, b_t, b_ra, b_ri, b_rb, b_up, b_down, b_upz, b_downz, b_usual
        )
        _usual_weights(
            alpha, inv_alpha, b_t, b_ra, b_rl, b_rr, b_br, b_bdr, b_el, b_er, b_zl, b_gr, b_zr
        )
        for kk in range(kn):  # the terms in the ranks' order, the injections in the boundaries'
            k = k0 + kk
            if b_usual[kk] != 0.0:
                rb = b_rb[kk]
                up = b_up[kk]
                down = b_down[kk]
                up_z1 = b_upz[kk]
                down_z0 = b_downz[kk]
            else:
                ri = b_ri[kk]
                z0 = offset_z(b_ra[kk], ri, inv_alpha, b_t[kk]) if k > 0 else -INF
                z1 = offset_z(b_ra[kk + 1], ri, inv_alpha, b_t[kk + 1]) if k < n - 1 else INF
                rb, up, down, up_z1, down_z0 = _rank_terms(z0, z1, abs(ri) != INF, c, inv_alpha)
            abar -= up_z1
            abar -= down_z0
            byrank[k] = rb
            if k == 0:
                pending = up
                continue
            uj = pending + down  # beta[k - 1]: boundary j = k - 1 is complete
            pending = up
            el = b_el[kk]
            if uj == 0.0 or el == _SKIP:  # (_SKIP: the target's position is infinite)
                continue
            L = left[kk]
            R = L + 1
            if L < M - 2:
                return abar, alpha_bar, False
            M = L if L > M else M
            F = _move_to_rows(F, M, B, Bd, win_up, win_down)
            P, a, ad, lo = _moments_up_to(L, P, r, E, inv_alpha, a, ad, lo, a_win, ad_win)
            aL = a_win[L & mask] if L >= 0 else 0.0
            adL = ad_win[L & mask] if L >= 0 else 0.0
            if el >= 0.0:  # the usual target: target_weights' G and Z (written out, as in
                # soft sort's pullback: an inlined helper for it made the loop slower)
                G = aL * el + b_gr[kk]
                Z = (b_zl[kk] * aL + adL) * el + b_zr[kk]
                cj = uj / G
                # (a boundary beyond a row's end has one point)
                if R < n:
                    win_up[R & mask] += cj * b_er[kk]
                if L >= 0:
                    if L < F:
                        Bd[np.uint64(L)] += cj * el
                    else:
                        win_down[L & mask] += cj * el
                alpha_bar += uj * Z / G
                continue
            ra, t, bR, bdR = b_ra[kk], b_t[kk], b_br[kk], b_bdr[kk]
            linked, found = _call_other_target(
                r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR, uj, F, B, Bd, win_up, win_down, False
            )
            code, term = found
            if not linked or code == _BEYOND:
                return abar, alpha_bar, False
            if code == _ADDED:
                alpha_bar += term
    # the window's injections into their points; the points above it have none (all the
    # targets may have been skipped: a zero cotangent)
    for q in range(F, n):
        inside = q < F + WINDOW
        B[q] = win_up[q & mask] if inside else 0.0
        Bd[q] = win_down[q & mask] if inside else 0.0
    return abar, alpha_bar, True


@inner_helper
def _usual_rank_terms(inv_alpha, c, b_t, b_ra, b_ri, b_rb, b_up, b_down, b_upz, b_downz, b_usual):
    """The second pass of :func:`_ladder_loss_row_vjp` over its block of ranks: the direct
    terms of :func:`_rank_terms` of the usual rank (a finite element on one side of its two
    finite boundaries, their gap ``d`` below :data:`WIDE_GAP`: :func:`density_ratios`'
    ratios ``1/u`` and ``1 + 1/u`` from :func:`_inv_expm1`) with their operations, so their
    values to the bit, from the block's rows alone (slot ``kk`` the rank's lower boundary,
    ``kk + 1`` its upper one); ``b_usual`` 1 for those ranks, 0 for the others (the third
    pass takes :func:`_rank_terms` for them). :func:`~softorder.core.laplace.offset_z` is
    written with selects: loops LLVM vectorizes (a short last block's extra slots hold values
    never used). Gaps from SERIES_GAP on, whose ratios take an ``exp``, are marked in the
    first loop (``b_usual`` ``-d``) and done in two more, which run only where a block has
    one (:func:`_wide_rank_terms`).
    """
    wide_gaps = False
    for kk in range(TBLOCK):
        ri = b_ri[kk]
        z0 = _offset_z_select(b_ra[kk], ri, inv_alpha, b_t[kk])
        z1 = _offset_z_select(b_ra[kk + 1], ri, inv_alpha, b_t[kk + 1])
        d = z1 - z0
        below = z1 <= 0.0
        usual = (abs(ri) != INF) & (abs(z0) != INF) & (abs(z1) != INF) & (z0 != z1)
        usual = usual & (below | (z0 >= 0.0))
        wide = usual & (d >= SERIES_GAP) & (d < WIDE_GAP)
        wide_gaps |= wide
        rb, up, down, up_z1, down_z0 = _ratio_terms(
            _inv_expm1_series(d), below, z0, z1, c, inv_alpha
        )
        b_rb[kk] = rb
        b_up[kk] = up
        b_down[kk] = down
        b_upz[kk] = up_z1
        b_downz[kk] = down_z0
        b_usual[kk] = 1.0 if usual & (d < SERIES_GAP) else (-d if wide else 0.0)
    if wide_gaps:
        _wide_rank_terms(inv_alpha, c, b_t, b_ra, b_ri, b_rb, b_up, b_down, b_upz, b_downz, b_usual)


@inner_helper
def _ratio_terms(far, below, z0, z1, c, inv_alpha):
    """:func:`_rank_terms` of a usual rank from its ratio ``far`` (:func:`density_ratios`'
    ``1/u``; ``below``: both boundaries at or below the element's 0), with its operations.
    """
    near = 1.0 + far
    g0 = far if below else near
    g1 = near if below else far
    up = -g1 * c * inv_alpha
    down = g0 * c * inv_alpha
    rb = 0.0
    rb -= up
    rb -= down
    return rb, up, down, up * z1, down * z0


@inner_helper
def _wide_rank_terms(inv_alpha, c, b_t, b_ra, b_ri, b_rb, b_up, b_down, b_upz, b_downz, b_usual):
    """The terms of :func:`_usual_rank_terms`' wide gaps (``b_usual`` ``-d``): their
    :func:`_decay` into ``b_usual`` in a loop of its own (inside the next, LLVM kept ``exp``
    scalar), then their ratios ``e / (1 - e)`` (:func:`_inv_expm1`) and terms, ``b_usual`` 1.
    """
    for kk in range(TBLOCK):
        g = b_usual[kk]
        e = _decay(-g)  # (for every slot, then a select: the loop stays vectorized)
        b_usual[kk] = e if g < 0.0 else g  # (a decay lies in (0, 1): still told apart)
    for kk in range(TBLOCK):
        e = b_usual[kk]
        wide = (e > 0.0) & (e < 1.0)
        ri = b_ri[kk]
        z0 = _offset_z_select(b_ra[kk], ri, inv_alpha, b_t[kk])
        z1 = _offset_z_select(b_ra[kk + 1], ri, inv_alpha, b_t[kk + 1])
        far = _inv_expm1_of_decay(e)
        rb, up, down, up_z1, down_z0 = _ratio_terms(far, z1 <= 0.0, z0, z1, c, inv_alpha)
        b_rb[kk] = rb if wide else b_rb[kk]
        b_up[kk] = up if wide else b_up[kk]
        b_down[kk] = down if wide else b_down[kk]
        b_upz[kk] = up_z1 if wide else b_upz[kk]
        b_downz[kk] = down_z0 if wide else b_downz[kk]
        b_usual[kk] = 1.0 if wide else e


@helper
def _offset_z_select(r_anchor, r_i, inv_alpha, t):
    """:func:`~softorder.core.laplace.offset_z` (its operations, so its value to the bit)
    with selects for its branches, for a loop LLVM vectorizes.
    """
    same = r_anchor == r_i
    up = r_anchor - r_i
    down = -(r_i - r_anchor)
    d = 0.0 if same else (up if r_anchor >= r_i else down)
    dz = d * inv_alpha
    z = dz + t
    return dz if z != z else z


@helper
def _ladder_carry_and_scatter(r, order, target, E, inj_up, inj_down, xb):
    """``xb[order[i]] = (direct + carried down) + carried up``, 0 at infinite entries, from
    the direct terms by rank in ``xb``: the general kernel's gradient (the direct terms, then
    :func:`~softorder.core.kernel_sums.carry_injections` adding its two passes, then the
    scatter), the same sums in the same order. The sums go in ``inj_up`` (each slot read
    just before), from where they are scattered once every direct term is read.

    The two carries run side by side (:func:`~softorder.core.kernel_sums.carry_both_ways`);
    the totals take a pass of their own (their random reads inside the carries' loop slowed
    it at n = 1e6).
    """
    n = r.shape[0]
    carry_both_ways_inline(E, inj_up, inj_down)
    ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
    for i in range(n):
        if ahead:  # (as in _values_by_rank)
            prefetch(target, order[i + ahead if i + ahead < n else n - 1])
            h = i + ahead // 2
            prefetch(xb, target[order[h if h < n else n - 1]] - 1)
        total = (xb[target[order[i]] - 1] + inj_down[i]) + inj_up[i]
        inj_up[i] = total if abs(r[i]) != INF else 0.0
    for i in range(n):
        xb[np.uint64(order[i])] = inj_up[i]  # (unsigned: no wraparound)


#: the ladder VJP's pass over the ranks, called by symbol (compiled once, not linked into
#: the kernel and optimised again there; int32 anchors: :func:`ladder_loss_vjp` narrows
#: others)
_LADDER_VJP_CALLS = SymbolCalls(
    # r, alpha, inv_alpha, E, B, Bd, anchor, offset, c, byrank
    row_vjp=(_ladder_loss_row_vjp, (_F1, _F, _F, _F1, _F1, _F1, _I32_1, _F1, _F, _F1)),
)
_call_row_vjp = _LADDER_VJP_CALLS.row_vjp


@kernel
def _ladder_vjp_rows(
    xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar, work, redo_only
):
    """The rows of :func:`ladder_loss_vjp` that its ladder path takes; the others get a NaN
    ``alpha_bar`` (left for the general path); returns their count.

    While :data:`~softorder.core.sort.OTHER_TARGET` is not linked for float64 rows, it also
    leaves the rows that meet a rare target (ties, rounding: integer values at a small alpha).
    ``redo_only``: run only the rows left before (a NaN ``alpha_bar``).
    """
    rows, n = xs.shape
    general = 0
    for row in prange(rows):
        if redo_only and alpha_bar[row] == alpha_bar[row]:
            continue
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        w = work[row]
        byrank = x_bar[row]
        if not _values_by_rank(r, order[row], target[row], byrank):
            alpha_bar[row] = np.nan
            general += 1
            continue
        E = w[0, :n]
        B = w[1, :n]
        Bd = w[2, :n]
        _call_decays(r, inv_alpha, E)
        _call_descending_from_decays(r, inv_alpha, E, B, Bd)
        direct, pulled, done = _call_row_vjp(
            r, a, inv_alpha, E, B, Bd, anchor[row], offset[row], cot[row], byrank
        )
        if not done:
            alpha_bar[row] = np.nan
            general += 1
            continue
        alpha_bar[row] = direct + pulled
        _ladder_carry_and_scatter(r, order[row], target[row], E, B, Bd, x_bar[row])
    return general


@kernel
def _ladder_vjp_general(xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar):
    """The general kernel's VJP (:func:`permutation_loss_vjp`, :func:`_loss_vjp_repeated`) of
    the rows that :func:`_ladder_vjp_rows` left (a NaN ``alpha_bar`` in a row without NaN),
    with scratch of their own and an int64 copy of the row's anchors.
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r) or alpha_bar[row] == alpha_bar[row]:
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        work = np.empty((TABLES_WITH_MOMENTS + 2, n))
        beta = np.zeros(max(n - 1, 1))[: n - 1]
        an = anchor[row].astype(np.int64)
        rbar = work[TABLES_WITH_MOMENTS]
        byrank = work[TABLES_WITH_MOMENTS + 1]
        if _values_by_rank(r, order[row], target[row], byrank):
            abar = _loss_by_rank_vjp(
                r, inv_alpha, order[row], target[row], an, offset[row], cot[row], byrank, beta, rbar
            )
        else:
            rbar[:] = 0.0
            abar = _loss_row_vjp(
                r, inv_alpha, order[row], target[row], an, offset[row], cot[row], beta, rbar
            )
        tables = _call_moment_tables(r, inv_alpha, work)
        alpha_bar[row] = abar + _call_inverse_pullback(
            r,
            a,
            tables,
            an,
            offset[row],
            beta,
            rbar,
            beta[:0],
            work[3, :n],
            byrank,
            False,
            False,
        )
        scatter_finite(r, order[row], rbar, x_bar[row])


@_then_linked("OTHER_TARGET", _ladder_vjp_rows)
def _ladder_rows(xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar, work):
    """:func:`_ladder_vjp_rows` on every row, then, once the rare targets' helper is linked,
    on the rows it left for want of it; returns the count of rows still left (for the general
    kernel).
    """


def ladder_vjp_left_rows(xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar):
    """The rows that :func:`_ladder_vjp_rows` left (a NaN ``alpha_bar`` in a row without NaN),
    on the calling thread, with int32 ``anchor``: what :func:`ladder_loss_vjp` does after the
    ladder, for callers that ran the ladder kernel themselves on threads of their own (the JAX
    bridge's FFI handlers). Rows with rare targets, left while
    :data:`~softorder.core.sort.OTHER_TARGET` was not linked, go to the ladder again once it
    is; the others to the general kernel, compiled when first needed, here as in
    :func:`ladder_loss_vjp`.

    Examples
    --------
    A row handed to the general kernel gets :func:`ladder_loss_vjp`'s gradients:

    >>> import numpy as np
    >>> from softorder.core import permutation as perm
    >>> x = np.array([[0.3, -1.0, 2.0, 0.5]])
    >>> order = np.argsort(x, axis=1).astype(np.int32)
    >>> xs, ranks, alpha = np.sort(x, axis=1), np.array([[2, 1, 4, 3]], np.int32), np.ones(1)
    >>> loss, anchor, offset = np.empty(1), np.empty((1, 3), np.int32), np.empty((1, 3))
    >>> work = np.empty((1, perm.LADDER_FORWARD_WORK, 4))
    >>> perm.ladder_loss_forward(xs, order, alpha, ranks, loss, anchor, offset, work)
    0
    >>> saved = (xs, order, alpha, ranks, anchor, offset, np.ones(1))
    >>> x_bar, alpha_bar = np.empty((1, 4)), np.array([np.nan])  # (NaN: the row is left)
    >>> perm.ladder_vjp_left_rows(*saved, x_bar, alpha_bar)
    >>> ladder_x_bar, ladder_alpha_bar = np.empty((1, 4)), np.empty(1)
    >>> work = np.empty((1, perm.LADDER_VJP_WORK, 4))
    >>> perm.ladder_loss_vjp(*saved, ladder_x_bar, ladder_alpha_bar, work)
    >>> np.array_equal(x_bar, ladder_x_bar), np.array_equal(alpha_bar, ladder_alpha_bar)
    (True, True)
    """
    args = (xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar)
    if not OTHER_TARGET.linked("float64"):  # (rows with rare targets were left: the ladder's)
        OTHER_TARGET.link("float64")
        work = np.empty((xs.shape[0], LADDER_VJP_WORK, xs.shape[1]))
        if not _ladder_vjp_rows.serial(*args, work, True):
            return
    _ladder_vjp_general.serial(*args)


def ladder_loss_vjp(xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar, work):
    """:func:`permutation_loss_vjp` (the same values to the bit) in :data:`LADDER_VJP_WORK`
    rows of scratch ``work`` (rows, 3, n) instead of 8 rows of n and one of n - 1: cotangent
    ``cot`` (rows,) -> ``x_bar`` (rows, n) and ``alpha_bar`` (rows,). ``anchor``: int32 or
    int64.

    The direct terms and the pullback through the boundaries run in one pass over the ranks
    (:func:`_ladder_loss_row_vjp`): the tables ``E``, ``B``, ``Bd`` in rows, ``A``, ``Ad`` by
    their recurrences, the injections in the rows of ``B`` and ``Bd`` behind the ascending
    boundaries, the boundaries' cotangents in a register; the values by rank, then the direct
    terms by rank, in the row of ``x_bar``, read by rank in the last passes. Rows with
    repeated target ranks, boundaries out of order or a far tie take the general kernel's
    path in a kernel of their own (:func:`_ladder_vjp_general`), compiled when first needed;
    rows with rare targets call :func:`~softorder.core.sort._other_target`, compiled when a
    row first needs one (until then the ladder leaves them, and runs again on them once it is
    linked).
    """
    if anchor.dtype != np.int32:  # (rows shorter than 2**31: the ladder's pass takes int32)
        anchor = anchor.astype(np.int32)
    args = (xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar)
    if _ladder_rows(*args, work):
        _ladder_vjp_general(*args)
