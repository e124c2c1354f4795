"""GPU form of :mod:`softorder.core.topk_loss`: the top-k cross-entropy and its gradient.
Same arguments as the CPU kernels.

Parallel form (n the number of classes, K the number of k values, few and below n):

* the Lap-sum tables are affine scans, the targets ``w = 1..K`` (one (1, K) row shared by all
  rows) are inverted by one thread per (row, target);
* the label's sorted position: one thread per element of ``order``, the one holding the label
  writes it; the softmax normaliser of the split form: one term per element and a ``row_sums``;
* the mixture of a row (:func:`softorder.core.topk_loss._mixture_terms`, a logsumexp over the K
  targets): one thread per row, looping over its K targets;
* the gradient: one thread per (row, target) for its coefficient, one
  :func:`~softorder.core.cuda.lapsum.spread_to_points` (scans) for the sum over targets, one
  thread per element for the label and softmax terms.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from softorder.core import lapsum
from softorder.core import topk_loss as cpu
from softorder.core.cuda import _launch
from softorder.core.cuda._launch import F1, F2, I1, I2
from softorder.core.cuda.lapsum import row_tables, solve_targets, spread_to_points
from softorder.core.cuda.rows import element, nan_row, nan_rows, scatter
from softorder.core.cuda.scan import fill, row_sums
from softorder.core.laplace import INF, hazard, offset_z

_hazard = _launch.device(hazard)
_offset_z = _launch.device(offset_z)
_target_position = _launch.device(lapsum.target_position)
_target_sums = _launch.device(lapsum.target_sums)
_mixture_terms = _launch.device(cpu._mixture_terms)
_softmax_ce_of = _launch.device(cpu._softmax_ce_of)
_row_loss = _launch.device(cpu.row_loss)


@_launch.kernel(F2)
def _one_to_k(w):
    """The targets ``w = 1..K`` into a (1, K) array."""
    row, j, inside = element(w.shape)
    if inside:
        w[row, j] = j + 1.0


@_launch.kernel(I2, I1, I1)
def _label_positions(order, labels, iy):
    """One thread per element of ``order``: the one holding the row's label writes its
    sorted position into ``iy``.
    """
    row, i, inside = element(order.shape)
    if inside and order[row, i] == labels[row]:
        iy[row] = i


@_launch.kernel(F2, F2)
def _softmax_terms(xs, terms):
    """One thread per element: its term of the softmax normaliser of the logits ``-r``,
    ``exp(-r_i - top)`` with ``top = -r[0]`` (:func:`softorder.core.topk_loss._softmax_normaliser`);
    in a row with +inf logits (``r[0] = -inf``), or of -inf logits only (``r[0] = inf``), the
    indicator of the largest, which sums to their count (the ``total`` of
    :func:`softorder.core.topk_loss._softmax_ce_of`).
    """
    row, i, inside = element(xs.shape)
    if inside:
        if abs(xs[row, 0]) == INF:
            terms[row, i] = 1.0 if xs[row, i] == xs[row, 0] else 0.0
        else:
            top = -xs[row, 0]
            terms[row, i] = math.exp(-xs[row, i] - top)


def _labels_and_softmax(xs, order, labels, split: bool):
    """Sorted label positions (rows,) and, in the split form, the softmax normalisers (rows,)
    (uninitialized otherwise: only the split form reads them).
    """
    rows, n = xs.shape
    iy = _launch.empty((rows,), np.int64)
    _launch.for_each(_label_positions, xs.size, order, labels, iy)
    softmax = _launch.empty((rows,))
    if split:
        terms = _launch.empty((rows, n))
        _launch.for_each(_softmax_terms, xs.size, xs, terms)
        row_sums(terms, softmax)
    return iy, softmax


def _shared_targets(K: int):
    """The (1, K) targets ``w = 1..K`` of every row."""
    w = _launch.empty((1, K))
    _launch.for_each(_one_to_k, K, w)
    return w


@_launch.kernel(F2, F1, F2, "boolean", F1, I2, F2, I1, F1, F2, F1)
def _losses(xs, alpha, log_pk, split, pk1, anchor, offset, iy, softmax, terms, out):
    """One thread per row, looping over its K targets: the loss ``out[row]``."""
    row = cuda.grid(1)
    if row >= out.shape[0]:
        return
    if nan_row(xs, row):
        out[row] = math.nan
        return
    r = xs[row]
    y = iy[row]
    top, total, has_mass = _mixture_terms(
        r, 1.0 / alpha[row], anchor[row], offset[row], y, log_pk[row], split, terms[row]
    )
    softmax_ce = _softmax_ce_of(r, y, -r[0], softmax[row]) if split and pk1[row] > 0.0 else 0.0
    out[row] = _row_loss(top, total, has_mass, split, pk1[row], softmax_ce)


def topk_loss_forward(
    xs, order, alpha, labels, log_pk, split: bool, pk1, out, anchor, offset, work
) -> None:
    """GPU :func:`softorder.core.topk_loss.topk_loss_forward`.

    Tables (scans); the K shared targets inverted per (row, target); label positions and the
    softmax normalisers (split form) per element; the loss per row.
    """
    rows, K = log_pk.shape
    tables = row_tables(xs, alpha, False, work)
    solve_targets(xs, alpha, tables, _shared_targets(K), anchor, offset)
    iy, softmax = _labels_and_softmax(xs, order, labels, split)
    terms = _launch.empty((rows, K))
    _launch.for_each(
        _losses, rows, xs, alpha, log_pk, split, pk1, anchor, offset, iy, softmax, terms, out
    )


@_launch.kernel(F2, F1, F2, "boolean", F1, I2, F2, I1, F1, F1, F2, F1, F1, F1, F1)
def _row_weights(
    xs, alpha, log_pk, split, pk1, anchor, offset, iy, softmax, cot, terms, top, total, weight, cs
):
    """One thread per row, looping over its K targets: the mixture's ``terms`` and logsumexp
    ``(top, total)``, the ``weight`` of its top-k part and the cotangent ``cs`` of its softmax
    part (each 0 where that part has no gradient: an infinite loss has none).
    """
    row = cuda.grid(1)
    if row >= xs.shape[0]:
        return
    top[row] = -INF
    total[row] = 0.0
    weight[row] = 0.0
    cs[row] = 0.0
    if nan_row(xs, row):
        return
    r = xs[row]
    y = iy[row]
    t, s, has_mass = _mixture_terms(
        r, 1.0 / alpha[row], anchor[row], offset[row], y, log_pk[row], split, terms[row]
    )
    w = cot[row] * ((1.0 - pk1[row]) if split else 1.0)
    softmax_part = split and pk1[row] > 0.0
    infinite = (t == -INF and has_mass and w != 0.0) or (
        softmax_part and _softmax_ce_of(r, y, -r[0], softmax[row]) == INF
    )
    top[row] = t
    total[row] = s
    if t > -INF and w != 0.0 and not infinite:
        weight[row] = w
    if softmax_part and not infinite and abs(r[0]) != INF:
        cs[row] = cot[row] * pk1[row]


@_launch.kernel(F2, F1, F2, F2, F2, F2, I2, F2, I1, F2, F1, F1, F1, F2, F2, F2, F2)
def _target_coefficients(
    xs, alpha, A, B, Ad, Bd, anchor, offset, iy, terms, top, total, weight, c, shift, pk, abar
):
    """One thread per (row, target): what it spreads over the row (``c``, ``shift``), its
    weight ``pk`` at the label and its part ``abar`` of alpha's cotangent (all 0 when it has
    no gradient).
    """
    row, j, inside = element(anchor.shape)
    if inside:
        c[row, j] = 0.0
        shift[row, j] = 0.0
        pk[row, j] = 0.0
        abar[row, j] = 0.0
        if weight[row] == 0.0 or terms[row, j] == -INF:
            return
        r = xs[row]
        a = alpha[row]
        inv_alpha = 1.0 / a
        k = anchor[row, j]
        t = offset[row, j]
        sh, G, Z = _target_sums(r, inv_alpha, A[row], B[row], Ad[row], Bd[row], k, t)
        zy = _offset_z(r[k], r[iy[row]], inv_alpha, t)
        if G == 0.0 or abs(zy) == INF or abs(_target_position(r, a, k, t)) == INF:
            return
        p = math.exp(terms[row, j] - top[row]) / total[row] * weight[row]
        p = p * _hazard(zy) * inv_alpha
        c[row, j] = -p / G
        shift[row, j] = sh
        pk[row, j] = p
        abar[row, j] = -(p * (Z / G - zy))


@_launch.kernel(F2, I1, F1, F1, F1, F2)
def _label_and_softmax(xs, iy, pk_total, cs, softmax, rbar):
    """One thread per element: the label's term ``sum_k pk`` and the softmax part
    ``cs (delta_iy - softmax(-r)_i)``.
    """
    row, i, inside = element(rbar.shape)
    if inside:
        value = rbar[row, i]
        label = i == iy[row]
        if label:
            value += pk_total[row]
        c = cs[row]
        if c != 0.0:
            top = -xs[row, 0]
            value -= c * math.exp(-xs[row, i] - top) / softmax[row]
            if label:
                value += c
        rbar[row, i] = value


def topk_loss_vjp(
    xs, order, alpha, labels, log_pk, split: bool, pk1, anchor, offset, cot, x_bar, alpha_bar, work
) -> None:
    """GPU :func:`softorder.core.topk_loss.topk_loss_vjp`.

    Tables (scans); label positions and softmax normalisers (split form) per element; the
    mixture per row; per (row, target) coefficients, whose alpha terms and label weights are
    summed per row (``row_sums``) and whose spread over the row is
    :func:`~softorder.core.cuda.lapsum.spread_to_points`; label and softmax terms per element.
    """
    rows, K = log_pk.shape
    tables = row_tables(xs, alpha, True, work)
    E, A, B, Ad, Bd, S = tables
    rbar = work[:, lapsum.TABLES_WITH_MOMENTS, :]
    fill(rbar, 0.0)
    iy, softmax = _labels_and_softmax(xs, order, labels, split)
    terms = _launch.empty((rows, K))
    top, total, weight, cs = (_launch.empty((rows,)) for _ in range(4))
    _launch.for_each(
        _row_weights,
        rows,
        xs,
        alpha,
        log_pk,
        split,
        pk1,
        anchor,
        offset,
        iy,
        softmax,
        cot,
        terms,
        top,
        total,
        weight,
        cs,
    )
    c, shift, pk, abar = (_launch.empty((rows, K)) for _ in range(4))
    _launch.for_each(
        _target_coefficients,
        rows * K,
        xs,
        alpha,
        A,
        B,
        Ad,
        Bd,
        anchor,
        offset,
        iy,
        terms,
        top,
        total,
        weight,
        c,
        shift,
        pk,
        abar,
    )
    row_sums(abar, alpha_bar)
    pk_total = _launch.empty((rows,))
    row_sums(pk, pk_total)
    spread_to_points(xs, alpha, E, anchor, offset, c, shift, rbar)
    _launch.for_each(_label_and_softmax, xs.size, xs, iy, pk_total, cs, softmax, rbar)
    scatter(xs, order, rbar, x_bar, finite=True)
    nan_rows(xs, alpha_bar)


__all__ = ["topk_loss_forward", "topk_loss_vjp"]
