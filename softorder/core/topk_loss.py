"""Top-k cross-entropy (Petersen et al. 2022, eq. 2 and the split form of eq. 4) on LapSum
memberships.

The kernels see ``r = -logits`` sorted (the API negates), so "top-k largest logits" is the
smallest-k membership of ``r``. For the label ``y`` and ``P_K`` over k = 1..K:

    topk(r)  = -log sum_k P_K(k) p^(k)_y       (logsumexp of log P_K(k) + log p^(k)_y)
    split    = P_K(1) * softmax_CE + (1 - P_K(1)) * topk over k >= 2 (eq. 4, as written there)

All K memberships come from one inversion pass; the gradient costs O(K n) per row.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from softorder.core._jit import helper, kernel
from softorder.core.laplace import INF, log_cdf, offset_z
from softorder.core.lapsum import has_nan, row_tables, scatter_finite, solve_targets
from softorder.core.topk import FORWARD_WORK, GRADIENT_WORK, gradient_scratch, target_terms

__all__ = ["FORWARD_WORK", "GRADIENT_WORK", "topk_loss_forward", "topk_loss_vjp"]


@helper
def _label_position(order_row, label):
    for i in range(order_row.shape[0]):
        if order_row[i] == label:
            return i
    return -1


@helper
def _softmax_ce(r, iy):
    """``logsumexp(-r) + r_y`` (softmax cross-entropy of the logits ``-r``)."""
    n = r.shape[0]
    top = -r[0]
    if top == INF:
        return np.nan  # a +inf logit has no finite softmax
    s = 0.0
    for i in range(n):
        s += math.exp(-r[i] - top)
    return top + math.log(s) + r[iy]


@helper
def _first_topk(split):
    """Index of the first k that enters the top-k term: k = 2 in the split form."""
    return 1 if split else 0


@helper
def _mixture_terms(r, inv_alpha, anchor, offset, iy, log_pk, split, terms):
    """``terms[j] = log P_K(j+1) + log p^(j+1)_y`` (-inf where P_K is 0 or k = 1 is split off);
    returns ``(top, sum_j exp(terms[j] - top))`` for a stable logsumexp.
    """
    top = -INF
    for j in range(terms.shape[0]):
        terms[j] = -INF
        if j >= _first_topk(split) and log_pk[j] != -INF:
            zy = offset_z(r[anchor[j]], r[iy], inv_alpha, offset[j])
            terms[j] = log_pk[j] + log_cdf(zy)
            top = max(top, terms[j])
    total = 0.0
    if top > -INF:
        for j in range(terms.shape[0]):
            total += math.exp(terms[j] - top)
    return top, total


@kernel
def topk_loss_forward(xs, order, alpha, labels, log_pk, split, pk1, out, anchor, offset, work):
    """Per-row loss ``out`` (rows,); ``log_pk`` (rows, K) holds log P_K(k) for k = 1..K."""
    rows, n = xs.shape
    K = log_pk.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row] = np.nan
            anchor[row, :] = 0
            offset[row, :] = np.nan
            continue
        inv_alpha = 1.0 / alpha[row]
        E, A, B, Ad, Bd, S = row_tables(r, inv_alpha, False, work[row])
        w = np.empty(K)
        worder = np.empty(K, dtype=np.int64)
        for j in range(K):
            w[j] = j + 1.0
            worder[j] = j
        solve_targets(r, inv_alpha, E, A, B, S, w, worder, anchor[row], offset[row])
        iy = _label_position(order[row], labels[row])
        terms = np.empty(K)
        top, total = _mixture_terms(
            r, inv_alpha, anchor[row], offset[row], iy, log_pk[row], split, terms
        )
        loss = -(top + math.log(total)) if top > -INF else 0.0
        if split:
            loss = (
                pk1[row] * _softmax_ce(r, iy) + (1.0 - pk1[row]) * loss
                if pk1[row] > 0.0
                else ((1.0 - pk1[row]) * loss)
            )
        out[row] = loss


@kernel
def topk_loss_vjp(
    xs, order, alpha, labels, log_pk, split, pk1, anchor, offset, cot, x_bar, alpha_bar, work
):
    """Cotangent ``cot`` (rows,) -> ``x_bar`` (rows, n; gradient in ``r``), ``alpha_bar``."""
    rows, n = xs.shape
    K = log_pk.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        tables = row_tables(r, inv_alpha, True, work[row])
        z, kappa, omega, rbar = gradient_scratch(work[row], n)
        iy = _label_position(order[row], labels[row])
        # Mixture weights pi_k = softmax_k(log P_K(k) + log p^(k)_y).
        terms = np.empty(K)
        top, s = _mixture_terms(
            r, inv_alpha, anchor[row], offset[row], iy, log_pk[row], split, terms
        )
        weight = cot[row] * ((1.0 - pk1[row]) if split else 1.0)
        rbar[:] = 0.0
        abar = 0.0
        if top > -INF and weight != 0.0:
            for j in range(K):
                if terms[j] == -INF:
                    continue
                pi = math.exp(terms[j] - top) / s * weight
                zg, inv_g_abs = target_terms(
                    r, a, tables, anchor[row, j], offset[row, j], True, z, kappa, omega
                )
                ky = kappa[iy]
                if ky == 0.0:
                    continue
                # d(-log p_y) = -kappa_y (sum_l omega_l dr_l - dr_y + (Z/G - z_y) dalpha)
                for i in range(n):
                    rbar[i] -= pi * ky * omega[i]
                rbar[iy] += pi * ky
                abar -= pi * ky * (zg - z[iy])
        if split and pk1[row] > 0.0:
            # d softmax_CE / dr_l = delta_ly - softmax(-r)_l
            c = cot[row] * pk1[row]
            top_logit = -r[0]
            s = 0.0
            for i in range(n):
                s += math.exp(-r[i] - top_logit)
            for i in range(n):
                rbar[i] -= c * math.exp(-r[i] - top_logit) / s
            rbar[iy] += c
        alpha_bar[row] = abar
        scatter_finite(r, order[row], rbar, x_bar[row])
