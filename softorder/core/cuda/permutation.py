"""GPU form of :mod:`softorder.core.permutation`: the soft permutation matrix, its loss and
their gradients. Same arguments as the CPU kernels (device arrays; ``w``/``worder`` 1-D).

* The (rows, n, n) outputs take one thread per matrix element ``(row, k, i)``, writing
  ``out[row, k, order[row, i]]``.
* The matrix VJP's two sums take one thread per boundary (``beta[k - 1]``, a sum over elements)
  and one thread per element (``rbar[i]``, a sum over boundaries), each recomputing its terms:
  O(n^2) work, the size of ``V``, and no O(n^2) scratch.
* The loss and its VJP are O(n): one thread per element, the per-row sums by
  :func:`~softorder.core.cuda.scan.row_sums`, the boundary cotangents by atomic adds.

The boundaries come from the GPU :func:`~softorder.core.cuda.lapsum.solve_targets`, and their
gradients from :func:`~softorder.core.cuda.lapsum.inverse_pullback` and
:func:`~softorder.core.cuda.lapsum.inverse_pushforward`.
"""

from __future__ import annotations

import math

from numba import cuda

from softorder.core import permutation as cpu
from softorder.core.cuda import _launch
from softorder.core.cuda._launch import F1, F2, F3, I2
from softorder.core.cuda.lapsum import (
    inverse_pullback,
    inverse_pushforward,
    row_tables,
    solve_targets,
)
from softorder.core.cuda.rows import element, gather_finite, nan_row, nan_rows, scatter
from softorder.core.cuda.scan import fill, row_sums
from softorder.core.laplace import INF, cdf_diff
from softorder.core.lapsum import TABLES_WITH_MOMENTS

_boundary_z = _launch.device(cpu._boundary_z)
_cdf_diff = _launch.device(cdf_diff)
_log_rank_probability = _launch.device(cpu.log_rank_probability)
_density_ratios = _launch.device(cpu.density_ratios)


@cuda.jit(device=True, inline="always")
def _matrix_element(shape):
    """``(row, k, i, inside)`` of this thread for a (rows, n, n) launch; ``i`` varies fastest."""
    idx = cuda.grid(1)
    n = shape[2]
    row = idx // (n * n)
    rest = idx - row * n * n
    k = rest // n
    return row, k, rest - k * n, idx < shape[0] * n * n


@cuda.jit(device=True, inline="always")
def _z(xs, alpha, anchor, offset, row, k, i):
    """``z_k,i = (b_k - r_i) / alpha`` of boundary ``k`` in 0..n and element ``i``."""
    r = xs[row]
    return _boundary_z(r, 1.0 / alpha[row], anchor[row], offset[row], k, r[i])


@_launch.kernel(F2, I2, F1, I2, F2, F3)
def _matrix(xs, order, alpha, anchor, offset, out):
    """``P[k, i] = F(z_(k+1),i) - F(z_k,i)``; NaN rows give NaN."""
    row, k, i, inside = _matrix_element(out.shape)
    if inside:
        col = order[row, i]
        if nan_row(xs, row):
            out[row, k, col] = math.nan
            return
        lo = _z(xs, alpha, anchor, offset, row, k, i)
        hi = _z(xs, alpha, anchor, offset, row, k + 1, i)
        out[row, k, col] = _cdf_diff(lo, hi)


@cuda.jit(device=True, inline="always")
def _matrix_gamma(xs, order, alpha, anchor, offset, V, row, k, i):
    """``(gamma, z)`` of boundary ``k`` (1..n-1) and element ``i``: the cotangent ``V`` puts on
    ``b_k`` through ``P[k - 1, i]`` and ``P[k, i]`` (``(0, 0)`` for infinite ``r_i`` or ``z``).
    """
    if abs(xs[row, i]) == INF:
        return 0.0, 0.0
    z = _z(xs, alpha, anchor, offset, row, k, i)
    if abs(z) == INF:
        return 0.0, 0.0
    col = order[row, i]
    dv = V[row, k - 1, col] - V[row, k, col]
    return 0.5 * math.exp(-abs(z)) * dv * (1.0 / alpha[row]), z


@_launch.kernel(F2, I2, F1, I2, F2, F3, F2, F2)
def _boundary_cotangents(xs, order, alpha, anchor, offset, V, beta, alpha_terms):
    """One thread per boundary ``k = j + 1``: ``beta[j] = sum_i gamma_k,i`` and its part of
    alpha's cotangent, ``-sum_i gamma_k,i z_k,i``.
    """
    row, j, inside = element(beta.shape)
    if inside:
        b = 0.0
        a = 0.0
        if not nan_row(xs, row):
            for i in range(xs.shape[1]):
                gamma, z = _matrix_gamma(xs, order, alpha, anchor, offset, V, row, j + 1, i)
                b += gamma
                a -= gamma * z
        beta[row, j] = b
        alpha_terms[row, j] = a


@_launch.kernel(F2, I2, F1, I2, F2, F3, F2)
def _element_cotangents(xs, order, alpha, anchor, offset, V, rbar):
    """One thread per element: ``rbar[i] = -sum_k gamma_k,i`` (sorted order)."""
    row, i, inside = element(rbar.shape)
    if inside:
        acc = 0.0
        if not nan_row(xs, row):
            for k in range(1, xs.shape[1]):
                gamma, _ = _matrix_gamma(xs, order, alpha, anchor, offset, V, row, k, i)
                acc -= gamma
        rbar[row, i] = acc


@cuda.jit(device=True, inline="always")
def _tangent_term(xs, alpha, anchor, offset, rdot, alpha_dot, b_dot, row, k, i):
    """``f(z_k,i) dz_k,i`` with ``dz = (db_k - dr_i - z dalpha) / alpha``; 0 at ``b_0``,
    ``b_n`` and at infinite ``z``.
    """
    if k == 0 or k == xs.shape[1] or abs(xs[row, i]) == INF:
        return 0.0  # an infinite entry's column is constant (the CPU kernel's reason)
    z = _z(xs, alpha, anchor, offset, row, k, i)
    if abs(z) == INF:
        return 0.0
    dz = (b_dot[row, k - 1] - rdot[row, i] - z * alpha_dot[row]) * (1.0 / alpha[row])
    return 0.5 * math.exp(-abs(z)) * dz


@_launch.kernel(F2, I2, F1, I2, F2, F2, F1, F2, F3)
def _matrix_tangent(xs, order, alpha, anchor, offset, rdot, alpha_dot, b_dot, out):
    """``dP[k, i] = f(z_(k+1),i) dz_(k+1),i - f(z_k,i) dz_k,i``; NaN rows give NaN."""
    row, k, i, inside = _matrix_element(out.shape)
    if inside:
        col = order[row, i]
        if nan_row(xs, row):
            out[row, k, col] = math.nan
            return
        upper = _tangent_term(xs, alpha, anchor, offset, rdot, alpha_dot, b_dot, row, k + 1, i)
        lower = _tangent_term(xs, alpha, anchor, offset, rdot, alpha_dot, b_dot, row, k, i)
        out[row, k, col] = upper - lower


@_launch.kernel(F2, I2, F1, I2, I2, F2, F2)
def _loss_terms(xs, order, alpha, target, anchor, offset, terms):
    """One thread per element: ``-log P[t_i - 1, i]`` from its two boundaries."""
    row, i, inside = element(terms.shape)
    if inside:
        k = target[row, order[row, i]] - 1
        z0 = _z(xs, alpha, anchor, offset, row, k, i)
        z1 = _z(xs, alpha, anchor, offset, row, k + 1, i)
        terms[row, i] = -_log_rank_probability(z0, z1)


@_launch.kernel(F2, I2, F1, I2, I2, F2, F1, F2, F2, F2)
def _loss_cotangents(xs, order, alpha, target, anchor, offset, cot, beta, rbar, alpha_terms):
    """One thread per element: adds its cotangents on its two boundaries to ``beta`` (which
    starts at 0), and writes ``rbar[i]`` and its part of alpha's cotangent.
    """
    row, i, inside = element(rbar.shape)
    if inside:
        acc = 0.0
        a = 0.0
        if not nan_row(xs, row) and abs(xs[row, i]) != INF:
            c = cot[row]
            inv_alpha = 1.0 / alpha[row]
            k = target[row, order[row, i]] - 1
            z0 = _z(xs, alpha, anchor, offset, row, k, i)
            z1 = _z(xs, alpha, anchor, offset, row, k + 1, i)
            g0, g1 = _density_ratios(z0, z1)
            # d(-log P)/dz1 = -f(z1)/P and d(-log P)/dz0 = f(z0)/P
            if abs(z1) != INF:
                gamma = -g1 * c * inv_alpha
                cuda.atomic.add(beta, (row, k), gamma)
                acc -= gamma
                a -= gamma * z1
            if abs(z0) != INF:
                gamma = g0 * c * inv_alpha
                cuda.atomic.add(beta, (row, k - 1), gamma)
                acc -= gamma
                a -= gamma * z0
        rbar[row, i] = acc
        alpha_terms[row, i] = a


def _boundaries(xs, alpha, w, anchor, offset, work) -> None:
    """Solve ``S(b_k) = k`` for k = 1..n-1 into ``anchor``/``offset`` (NaN rows: 0, NaN)."""
    tables = row_tables(xs, alpha, False, work)
    solve_targets(xs, alpha, tables, w, anchor, offset)


def _finish_gradient(
    xs, order, alpha, tables, anchor, offset, beta, rbar, twork, alpha_terms, x_bar, alpha_bar
) -> None:
    """Chain ``beta`` through the boundaries into ``rbar`` and their terms into the last
    ``m`` columns of ``alpha_terms``; write ``x_bar`` (original order) and ``alpha_bar``.
    """
    m = anchor.shape[1]
    split = alpha_terms.shape[1] - m
    wbar = twork[:, 1, :m]
    inverse_pullback(xs, alpha, tables, anchor, offset, beta, rbar, wbar, alpha_terms[:, split:])
    row_sums(alpha_terms, alpha_bar)
    scatter(xs, order, rbar, x_bar, finite=True)
    nan_rows(xs, alpha_bar)


def permutation_forward(xs, order, alpha, w, worder, out, anchor, offset, work) -> None:
    """GPU :func:`softorder.core.permutation.permutation_forward` (``worder`` is not needed).

    Parameters
    ----------
    xs, order, alpha
        Sorted rows (rows, n), their argsort (int64) and one alpha per row (rows,).
    w, worder
        Boundary targets ``1..n-1`` and their order, 1-D, shared by all rows.
    out
        Soft permutation matrices (rows, n, n), written.
    anchor, offset
        Boundaries (rows, n - 1), written.
    work
        Scratch (rows, ``FORWARD_WORK``, n).
    """
    _boundaries(xs, alpha, w, anchor, offset, work)
    _launch.for_each(_matrix, out.size, xs, order, alpha, anchor, offset, out)


def permutation_vjp(
    xs, order, alpha, anchor, offset, worder, V, x_bar, alpha_bar, work, twork
) -> None:
    """GPU :func:`softorder.core.permutation.permutation_vjp` (``worder`` is not needed).

    Parameters
    ----------
    xs, order, alpha, anchor, offset
        As saved by :func:`permutation_forward`.
    worder
        Order of the boundary targets (unused).
    V
        Cotangent of the matrices (rows, n, n).
    x_bar, alpha_bar
        Cotangents (rows, n) in original order and (rows,), written.
    work, twork
        Scratch (rows, ``GRADIENT_WORK``, n) and (rows, ``BOUNDARY_WORK``, >= n - 1).
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    tables = row_tables(xs, alpha, True, work)
    rbar = work[:, TABLES_WITH_MOMENTS, :n]
    beta = twork[:, 0, :m]
    alpha_terms = _launch.empty((rows, 2 * m))
    args = (xs, order, alpha, anchor, offset, V)
    _launch.for_each(_boundary_cotangents, rows * m, *args, beta, alpha_terms[:, :m])
    _launch.for_each(_element_cotangents, rows * n, *args, rbar)
    _finish_gradient(
        xs, order, alpha, tables, anchor, offset, beta, rbar, twork, alpha_terms, x_bar, alpha_bar
    )


def permutation_jvp(
    xs, order, alpha, anchor, offset, worder, x_dot, alpha_dot, out, work, twork
) -> None:
    """GPU :func:`softorder.core.permutation.permutation_jvp` (``worder`` is not needed).

    Parameters
    ----------
    xs, order, alpha, anchor, offset
        As saved by :func:`permutation_forward`.
    worder
        Order of the boundary targets (unused).
    x_dot, alpha_dot
        Tangents (rows, n) in original order and (rows,).
    out
        Tangent of the matrices (rows, n, n), written.
    work, twork
        Scratch (rows, ``GRADIENT_WORK``, n) and (rows, ``BOUNDARY_WORK``, >= n - 1).
    """
    n = xs.shape[1]
    m = anchor.shape[1]
    tables = row_tables(xs, alpha, True, work)
    rdot = work[:, TABLES_WITH_MOMENTS, :n]
    gather_finite(xs, order, x_dot, rdot)
    b_dot = twork[:, 0, :m]
    w_dot = twork[:, 1, :m]
    fill(w_dot, 0.0)
    inverse_pushforward(xs, alpha, tables, anchor, offset, rdot, w_dot, alpha_dot, b_dot)
    _launch.for_each(
        _matrix_tangent, out.size, xs, order, alpha, anchor, offset, rdot, alpha_dot, b_dot, out
    )


def permutation_loss_forward(
    xs, order, alpha, target, w, worder, out, anchor, offset, work
) -> None:
    """GPU :func:`softorder.core.permutation.permutation_loss_forward` (``worder`` is not
    needed).

    Parameters
    ----------
    xs, order, alpha
        Sorted rows (rows, n), their argsort (int64) and one alpha per row (rows,).
    target
        1-based target ranks (rows, n), int64, in original order.
    w, worder
        Boundary targets ``1..n-1`` and their order, 1-D, shared by all rows.
    out
        Loss per row (rows,), written.
    anchor, offset
        Boundaries (rows, n - 1), written.
    work
        Scratch (rows, ``FORWARD_WORK``, n).
    """
    _boundaries(xs, alpha, w, anchor, offset, work)
    terms = _launch.empty(xs.shape)
    _launch.for_each(_loss_terms, xs.size, xs, order, alpha, target, anchor, offset, terms)
    row_sums(terms, out)
    nan_rows(xs, out)


def permutation_loss_vjp(
    xs, order, alpha, target, anchor, offset, worder, cot, x_bar, alpha_bar, work, twork
) -> None:
    """GPU :func:`softorder.core.permutation.permutation_loss_vjp` (``worder`` is not needed).

    Parameters
    ----------
    xs, order, alpha, target, anchor, offset
        As given to and saved by :func:`permutation_loss_forward`.
    worder
        Order of the boundary targets (unused).
    cot
        Cotangent of the per-row losses (rows,).
    x_bar, alpha_bar
        Cotangents (rows, n) in original order and (rows,), written.
    work, twork
        Scratch (rows, ``GRADIENT_WORK``, n) and (rows, ``BOUNDARY_WORK``, >= n - 1).
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    tables = row_tables(xs, alpha, True, work)
    rbar = work[:, TABLES_WITH_MOMENTS, :n]
    beta = twork[:, 0, :m]
    fill(beta, 0.0)
    alpha_terms = _launch.empty((rows, n + m))
    _launch.for_each(
        _loss_cotangents,
        xs.size,
        xs,
        order,
        alpha,
        target,
        anchor,
        offset,
        cot,
        beta,
        rbar,
        alpha_terms[:, :n],
    )
    _finish_gradient(
        xs, order, alpha, tables, anchor, offset, beta, rbar, twork, alpha_terms, x_bar, alpha_bar
    )


__all__ = [
    "permutation_forward",
    "permutation_jvp",
    "permutation_loss_forward",
    "permutation_loss_vjp",
    "permutation_vjp",
]
