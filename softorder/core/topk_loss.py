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
from softorder.core.lapsum import has_nan, row_tables, solve_targets
from softorder.core.topk import target_terms


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


@kernel
def topk_loss_forward(xs, order, alpha, labels, log_pk, split, pk1, out, anchor, offset):
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
        E, A, B, Ad, Bd, S = row_tables(r, inv_alpha, False)
        w = np.empty(K)
        worder = np.empty(K, dtype=np.int64)
        for j in range(K):
            w[j] = j + 1.0
            worder[j] = j
        solve_targets(r, inv_alpha, A, B, S, w, worder, anchor[row], offset[row])
        iy = _label_position(order[row], labels[row])
        terms = np.full(K, -INF)
        top = -INF
        for j in range(_first_topk(split), K):
            if log_pk[row, j] == -INF:
                continue
            z = offset_z(r[anchor[row, j]], r[iy], inv_alpha, offset[row, j])
            terms[j] = log_pk[row, j] + log_cdf(z)
            top = max(top, terms[j])
        loss = 0.0
        if top > -INF:
            s = 0.0
            for j in range(K):
                s += math.exp(terms[j] - top)
            loss = -(top + math.log(s))
        if split:
            loss = (
                pk1[row] * _softmax_ce(r, iy) + (1.0 - pk1[row]) * loss
                if pk1[row] > 0.0
                else ((1.0 - pk1[row]) * loss)
            )
        out[row] = loss


@kernel
def topk_loss_vjp(
    xs, order, alpha, labels, log_pk, split, pk1, anchor, offset, cot, x_bar, alpha_bar
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
        tables = row_tables(r, inv_alpha, True)
        iy = _label_position(order[row], labels[row])
        # Mixture weights pi_k = softmax_k(log P_K(k) + log p^(k)_y).
        terms = np.full(K, -INF)
        top = -INF
        for j in range(_first_topk(split), K):
            if log_pk[row, j] == -INF:
                continue
            z = offset_z(r[anchor[row, j]], r[iy], inv_alpha, offset[row, j])
            terms[j] = log_pk[row, j] + log_cdf(z)
            top = max(top, terms[j])
        weight = cot[row] * ((1.0 - pk1[row]) if split else 1.0)
        rbar = np.zeros(n)
        abar = 0.0
        if top > -INF and weight != 0.0:
            s = 0.0
            for j in range(K):
                s += math.exp(terms[j] - top)
            z = np.empty(n)
            kappa = np.empty(n)
            omega = np.empty(n)
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
        for i in range(n):
            x_bar[row, order[row, i]] = rbar[i] if abs(r[i]) != INF else 0.0
