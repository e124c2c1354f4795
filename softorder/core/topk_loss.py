"""Top-k cross-entropy (Petersen et al. 2022, eq. 2 and the split form of eq. 4) on LapSum
memberships.

The kernels see ``r = -logits`` sorted (the API negates), so "top-k largest logits" is the
smallest-k membership of ``r``. For the label ``y`` and ``P_K`` over k = 1..K:

    topk(r)  = -log sum_k P_K(k) p^(k)_y       (logsumexp of log P_K(k) + log p^(k)_y)
    split    = P_K(1) * softmax_CE + (1 - P_K(1)) * topk over k >= 2 (eq. 4, as written there)

All K memberships come from one inversion pass. With mixture weights ``pi_k``,
``d loss / d r_i = -sum_k pi_k kappa_ky (db_k/dr_i - delta_iy)``: the sum over k is one
:func:`~softorder.core.kernel_sums.spread_to_points` merge, so the gradient is O(n + K) per row.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import prange, types

from softorder.core._jit import SymbolCalls, helper, kernel
from softorder.core.kernel_sums import spread_to_points
from softorder.core.laplace import INF, hazard, log_cdf, offset_z
from softorder.core.lapsum import (
    TABLES,
    TABLES_WITH_MOMENTS,
    neighbour_sums,
    prefix_sums_halves,
    solve_targets_ab,
    target_position,
    target_sums_at,
)
from softorder.core.rows import has_nan, scatter_finite

FORWARD_WORK = TABLES
#: the GPU twin's rows of gradient scratch
GRADIENT_WORK = TABLES_WITH_MOMENTS + 1
#: the CPU VJP's: ``E`` alone (the gradient is formed in the row of ``x_bar``)
CPU_GRADIENT_WORK = 1


@helper
def _label_position(order_row, label):
    for i in range(order_row.shape[0]):
        if order_row[i] == label:
            return i
    return -1


@helper
def _softmax_ce(r, iy):
    """``logsumexp(-r) + r_y``: softmax cross-entropy of the logits ``-r``.

    With +inf logits (``r = -inf``, sorted first) this is the limit: ``log(number of +inf)``
    when the label is one of them, ``inf`` otherwise. A row of -inf logits only is a row of
    ties, like any row of equal logits: ``log(n)``.
    """
    n = r.shape[0]
    if abs(r[0]) == INF:
        count = 0
        if r[iy] == r[0]:
            while count < n and r[count] == r[0]:
                count += 1
        return _softmax_ce_of(r, iy, -r[0], float(count))
    top, total = _softmax_normaliser(r)
    return _softmax_ce_of(r, iy, top, total)


@helper
def _softmax_ce_of(r, iy, top, total):
    """:func:`_softmax_ce` from the row's normaliser ``(top, total)`` of
    :func:`_softmax_normaliser`; for a row with +inf logits, or of -inf logits only, ``total``
    is the count of the largest logits instead (``top`` unused).
    """
    if abs(r[0]) == INF:
        if r[iy] != r[0]:
            return INF
        return math.log(total)
    return top + math.log(total) + r[iy]


@helper
def _softmax_normaliser(r):
    """``(top, sum_i exp(-r_i - top))`` with ``top = max(-r) = -r[0]``: the stable softmax
    denominator of the logits ``-r`` (finite ``top`` only).
    """
    top = -r[0]
    total = 0.0
    for i in range(r.shape[0]):
        total += math.exp(-r[i] - top)
    return top, total


@helper
def _first_topk(split):
    """Index of the first k that enters the top-k term: k = 2 in the split form."""
    return 1 if split else 0


@helper
def _mixture_terms(r, inv_alpha, anchor, offset, iy, log_pk, split, terms):
    """``terms[j] = log P_K(j+1) + log p^(j+1)_y`` (-inf where P_K is 0 or k = 1 is split off).

    Returns ``(top, sum_j exp(terms[j] - top), has_mass)`` for a stable logsumexp;
    ``has_mass`` tells a top-k term with no weight (contributes 0) from a label that no k can
    select (``top = -inf`` with weight: the loss is +inf).
    """
    top = -INF
    has_mass = False
    for j in range(terms.shape[0]):
        terms[j] = -INF
        if j >= _first_topk(split) and log_pk[j] != -INF:
            has_mass = True
            zy = offset_z(r[anchor[j]], r[iy], inv_alpha, offset[j])
            terms[j] = log_pk[j] + log_cdf(zy)
            top = terms[j] if terms[j] > top else top  # max(top, terms[j])
    total = 0.0
    if top > -INF:
        for j in range(terms.shape[0]):
            total += math.exp(terms[j] - top)
    return top, total, has_mass


@helper
def row_loss(top, total, has_mass, split, pk1, softmax_ce):
    """One row's loss from its mixture's logsumexp ``(top, total)`` (:func:`_mixture_terms`)
    and, in the split form, its softmax cross-entropy (read only when ``pk1 > 0``).
    """
    if top > -INF:
        loss = -(top + math.log(total))
    else:
        loss = INF if has_mass else 0.0
    if split:
        loss = (1.0 - pk1) * loss if pk1 < 1.0 else 0.0
        if pk1 > 0.0:
            loss += pk1 * softmax_ce
    return loss


@functools.lru_cache(maxsize=32)
def _ladder(K: int) -> tuple[np.ndarray, np.ndarray]:
    """The targets ``1..K`` (float64) and their order ``0..K-1`` (kernels only read them)."""
    return np.arange(1.0, K + 1.0), np.arange(K)


def topk_loss_forward(xs, order, alpha, labels, log_pk, split, pk1, out, anchor, offset, work):
    """Per-row loss ``out`` (rows,); ``log_pk`` (rows, K) holds log P_K(k) for k = 1..K.
    ``work``: (rows, FORWARD_WORK, n) scratch.

    ``serial`` and ``parallel`` are those of the kernel :func:`_loss_forward`.
    """
    if log_pk.shape[1] > work.shape[2]:  # the terms go in a row of work (the API has K < n)
        raise ValueError(f"softorder: K = {log_pk.shape[1]} exceeds the row length {xs.shape[1]}")
    targets, worder = _ladder(log_pk.shape[1])
    _loss_forward(
        xs, order, alpha, labels, log_pk, split, pk1, out, anchor, offset, work, targets, worder
    )


_F, _F1 = types.float64, types.Array(types.float64, 1, "C")
_F2, _L1 = types.Array(types.float64, 2, "C"), types.Array(types.int64, 1, "C")
#: the per-row helpers of the kernels, called by symbol: compiled once, not linked in and
#: compiled again inside each kernel (O(n) work per call: the call costs nothing measurable)
_LOSS_CALLS = SymbolCalls(
    # r, inv_alpha, A, B
    prefix_sums=(prefix_sums_halves, (_F1, _F, _F1, _F1)),
    # r, inv_alpha, A, B, w, worder, anchor, offset (one row's)
    solve=(solve_targets_ab, (_F1, _F, _F1, _F1, _F1, _L1, _L1, _F1)),
    # r, inv_alpha, E, anchor, offset, sums
    neighbour_sums=(neighbour_sums, (_F1, _F, _F1, _L1, _F1, _F2)),
    # r, inv_alpha, E, anchor, offset, c, shift, order, out
    spread=(spread_to_points, (_F1, _F, _F1, _L1, _F1, _F1, _F1, _L1, _F1)),
)
_call_prefix_sums = _LOSS_CALLS.prefix_sums
_call_solve = _LOSS_CALLS.solve
_call_neighbour_sums = _LOSS_CALLS.neighbour_sums
_call_spread = _LOSS_CALLS.spread


@kernel
def _loss_forward(
    xs, order, alpha, labels, log_pk, split, pk1, out, anchor, offset, work, w, worder
):
    """:func:`topk_loss_forward` with the targets ``w = 1..K`` and their order from the caller:
    arrays made inside a kernel compile functions of NumPy's for each kind on a first call.
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row] = np.nan
            for j in range(w.shape[0]):  # (loops: slice assignments compile NumPy's setitem)
                anchor[row, j] = 0
                offset[row, j] = np.nan
            continue
        inv_alpha = 1.0 / alpha[row]
        A = work[row, 0]  # A and B alone (the GPU twin fills all 4 rows)
        B = work[row, 1]
        _call_prefix_sums(r, inv_alpha, A, B)
        _call_solve(r, inv_alpha, A, B, w, worder, anchor[row], offset[row])
        iy = _label_position(order[row], labels[row])
        terms = work[row, 2, : w.shape[0]]  # rows 2 and 3 are free here (K < n)
        top, total, has_mass = _mixture_terms(
            r, inv_alpha, anchor[row], offset[row], iy, log_pk[row], split, terms
        )
        softmax_ce = _softmax_ce(r, iy) if split and pk1[row] > 0.0 else 0.0
        out[row] = row_loss(top, total, has_mass, split, pk1[row], softmax_ce)


def topk_loss_vjp(
    xs, order, alpha, labels, log_pk, split, pk1, anchor, offset, cot, x_bar, alpha_bar, work
):
    """Cotangent ``cot`` (rows,) -> ``x_bar`` (rows, n; gradient in ``r``), ``alpha_bar``.
    ``work``: (rows, CPU_GRADIENT_WORK, n) scratch (GRADIENT_WORK for the GPU twin).

    An infinite loss (the label cannot be selected) has zero gradient. ``serial`` and
    ``parallel`` are those of the kernel :func:`_loss_vjp`.
    """
    K = log_pk.shape[1]
    worder, kwork = _ladder(K)[1], np.empty((xs.shape[0], 9, K))
    _loss_vjp(
        xs,
        order,
        alpha,
        labels,
        log_pk,
        split,
        pk1,
        anchor,
        offset,
        cot,
        x_bar,
        alpha_bar,
        work,
        worder,
        kwork,
    )


@kernel
def _loss_vjp(
    xs,
    order,
    alpha,
    labels,
    log_pk,
    split,
    pk1,
    anchor,
    offset,
    cot,
    x_bar,
    alpha_bar,
    work,
    worder,
    kwork,
):
    """:func:`topk_loss_vjp` with the targets' order and per-row scratch of K (``kwork``,
    rows x 9 x K: the terms, positions, coefficients, shifts, then the neighbour sums) from the
    caller (see :func:`_loss_forward`).
    """
    rows, n = xs.shape
    K = log_pk.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            for i in range(n):  # (loops: slice assignments compile NumPy's setitem)
                x_bar[row, i] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        # no tables: only E and the sums at each target's two neighbours (1 of the rows of
        # ``work`` is filled; the GPU twin fills them all)
        E = work[row, 0]
        sums = kwork[row, 4:]
        _call_neighbour_sums(r, inv_alpha, E, anchor[row], offset[row], sums)
        # the gradient in sorted order goes to the row of x_bar, then to the spent E for the
        # scatter into x_bar: one row of n less than a row of work of its own
        rbar = x_bar[row]
        for i in range(n):
            rbar[i] = 0.0
        iy = _label_position(order[row], labels[row])
        terms = kwork[row, 0]
        top, total, has_mass = _mixture_terms(
            r, inv_alpha, anchor[row], offset[row], iy, log_pk[row], split, terms
        )
        weight = cot[row] * ((1.0 - pk1[row]) if split else 1.0)
        abar = 0.0
        softmax_part = split and pk1[row] > 0.0
        infinite = (top == -INF and has_mass and weight != 0.0) or (
            softmax_part and _softmax_ce(r, iy) == INF
        )
        if top > -INF and weight != 0.0 and not infinite:
            # d(-log p^(k)_y) = -kappa_ky (sum_l db_k/dr_l dr_l - dr_y + (db_k/da - z_ky) da)
            pos = kwork[row, 1]
            c = kwork[row, 2]
            shift = kwork[row, 3]
            for j in range(K):
                c[j] = 0.0
                shift[j] = 0.0
            for j in range(K):
                pos[j] = target_position(r, a, anchor[row, j], offset[row, j])
                if terms[j] == -INF:
                    continue
                sh, G, Z = target_sums_at(
                    r,
                    inv_alpha,
                    anchor[row, j],
                    offset[row, j],
                    sums[1, j],
                    sums[2, j],
                    sums[3, j],
                    sums[4, j],
                )
                zy = offset_z(r[anchor[row, j]], r[iy], inv_alpha, offset[row, j])
                if G == 0.0 or abs(zy) == INF or abs(pos[j]) == INF:
                    continue
                pk = math.exp(terms[j] - top) / total * weight * hazard(zy) * inv_alpha
                c[j] = -pk / G
                shift[j] = sh
                rbar[iy] += pk
                abar -= pk * (Z / G - zy)
            _call_spread(r, inv_alpha, E, anchor[row], offset[row], c, shift, worder, rbar)
        if softmax_part and not infinite and abs(r[0]) != INF:
            # d softmax_CE / dr_l = delta_ly - softmax(-r)_l (no gradient at an infinite logit)
            cs = cot[row] * pk1[row]
            top_logit, s = _softmax_normaliser(r)
            for i in range(n):
                rbar[i] -= cs * math.exp(-r[i] - top_logit) / s
            rbar[iy] += cs
        alpha_bar[row] = abar
        for i in range(n):  # E is spent (a loop: an array assignment compiles NumPy's setitem)
            E[i] = rbar[i]
        scatter_finite(r, order[row], E, x_bar[row])


topk_loss_forward.serial, topk_loss_forward.parallel = _loss_forward.serial, _loss_forward.parallel
topk_loss_vjp.serial, topk_loss_vjp.parallel = _loss_vjp.serial, _loss_vjp.parallel
