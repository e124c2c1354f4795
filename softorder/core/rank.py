"""Soft rank ``rank_i = 1/2 + sum_j F((r_i - r_j) / alpha) = S(r_i) + 1/2``, in (1/2, n + 1/2).

Its Jacobian in ``r`` is symmetric: ``d rank_i / d r_l = delta_il K[1]_i - K_il`` / (2 alpha) with
the Laplace kernel ``K_il = exp(-|r_i - r_l| / alpha)``, and
``d rank_i / d alpha = -(Ad_i - Bd_i) / (2 alpha)``. So the VJP and the JVP are one formula,
evaluated with two O(n) kernel passes over the sorted row.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from softorder.core._jit import helper, kernel
from softorder.core.kernel_sums import self_sum
from softorder.core.lapsum import has_nan, row_tables


@kernel
def rank_forward(xs, order, alpha, out):
    """``out[row, order[row, i]] = S(xs[row, i]) + 1/2``."""
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :] = np.nan
            continue
        E, A, B, Ad, Bd, S = row_tables(r, 1.0 / alpha[row], False)
        for i in range(n):
            out[row, order[row, i]] = S[i] + 0.5


@helper
def _rank_linear(r, alpha, v, alpha_v, out):
    """``out = J v + (d rank/d alpha) alpha_v`` on a sorted row; returns ``<v, d rank/d alpha>``."""
    n = r.shape[0]
    inv_alpha = 1.0 / alpha
    E, A, B, Ad, Bd, S = row_tables(r, inv_alpha, True)
    kv = np.empty(n)
    self_sum(E, v, kv)
    scale = 0.5 * inv_alpha
    dot = 0.0
    for i in range(n):
        if abs(r[i]) == np.inf:
            out[i] = 0.0
            continue
        d_alpha = -(Ad[i] - Bd[i]) * scale
        out[i] = (v[i] * (A[i] + B[i] - 1.0) - kv[i]) * scale + d_alpha * alpha_v
        dot += v[i] * d_alpha
    return dot


@kernel
def rank_vjp(xs, order, alpha, v, x_bar, alpha_bar):
    """Cotangent ``v`` (rows, n) -> ``x_bar`` (rows, n) and ``alpha_bar`` (rows,)."""
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        vs = np.empty(n)
        for i in range(n):
            vs[i] = v[row, order[row, i]] if abs(r[i]) != np.inf else 0.0
        out = np.empty(n)
        alpha_bar[row] = _rank_linear(r, alpha[row], vs, 0.0, out)
        for i in range(n):
            x_bar[row, order[row, i]] = out[i]


@kernel
def rank_jvp(xs, order, alpha, x_dot, alpha_dot, out):
    """Tangents ``x_dot`` (rows, n), ``alpha_dot`` (rows,) -> tangent of the ranks (rows, n)."""
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :] = np.nan
            continue
        vs = np.empty(n)
        for i in range(n):
            vs[i] = x_dot[row, order[row, i]] if abs(r[i]) != np.inf else 0.0
        res = np.empty(n)
        _rank_linear(r, alpha[row], vs, alpha_dot[row], res)
        for i in range(n):
            out[row, order[row, i]] = res[i]
