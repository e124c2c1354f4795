"""GPU form of :mod:`softorder.core.rank`: soft rank and its gradients. Same arguments as the
CPU kernels, as (rows, ...) device arrays.

Every pass of the CPU kernels over a sorted row is an affine scan
(:mod:`softorder.core.cuda.scan`) with the decays ``E`` as factors, and what the CPU computes
per element inside those loops is an elementwise kernel before or after the scans:

* forward: the tables ``E, A, B`` (the steps of :func:`softorder.core.cuda.lapsum.row_tables`,
  with ``E`` written into ``decay`` and ``A, B`` into the two slots of ``work``), the ranks in
  sorted order, and one scan with factors in {0, 1} that copies the first rank of each run of
  equal values over the run, so that ties are exactly equal, as on the CPU;
* gradients: ``A, B, Ad, Bd`` from the saved decays, the kernel sums of ``v`` to the left
  (``lv``) and to the right (``rv``) by one scan each, then one elementwise kernel for
  ``J v + (d rank / d alpha) alpha_v``, and a row sum for the alpha cotangent.

``row_tables`` itself does not fit (it needs 4, or 6, slots of ``work`` where the rank
kernels get 2, or 3, and keeps ``E`` in ``work``): its steps
(:func:`~softorder.core.cuda.lapsum.prefix_sums`,
:func:`~softorder.core.cuda.lapsum.prefix_moments`) are composed here, with ``E`` in
``decay``.
"""

from __future__ import annotations

from softorder.core.cuda import _launch
from softorder.core.cuda._launch import F1, F2
from softorder.core.cuda.lapsum import prefix_moments, prefix_sums
from softorder.core.cuda.rows import element, gather_finite, nan_rows, scatter
from softorder.core.cuda.scan import affine_scan, fill, row_sums

#: Scratch of the gradients beyond ``work``: Ad, Bd and the left and right kernel sums of v.
_LINEAR_TEMPS = 4


@_launch.kernel(F2, F2, F2)
def _sorted_ranks(xs, A, B):
    """``B <- i + 1 + (B_i - A_i) / 2`` (the rank of sorted point ``i``) and ``A <- 0``, except
    where ``r[i] == r[i-1]``: there ``A <- 1``, ``B <- 0``, so that the scan
    ``y_i = A_i y_(i-1) + B_i`` carries the first rank of each run of equal values over the run.
    """
    row, i, inside = element(xs.shape)
    if inside:
        tie = i > 0 and xs[row, i] == xs[row, i - 1]
        rank = i + 1.0 + 0.5 * (B[row, i] - A[row, i])
        A[row, i] = 1.0 if tie else 0.0
        B[row, i] = 0.0 if tie else rank


def rank_forward(xs, order, alpha, out, decay, work) -> None:
    """GPU :func:`softorder.core.rank.rank_forward`: ``out[row, order[row, i]] = rank of
    xs[row, i]``, and the decays ``E`` into ``decay``.

    ``work``: (rows, >= 2, >= n).
    """
    n = xs.shape[1]
    A, B = work[:, 0, :n], work[:, 1, :n]
    prefix_sums(xs, alpha, decay, A, B)
    _launch.for_each(_sorted_ranks, xs.size, xs, A, B)
    affine_scan(A, B, B)
    scatter(xs, order, B, out)
    nan_rows(xs, decay)


@_launch.kernel(F1, F2, F2, F2, F2, F2, F2, F2, F1, F2, "boolean")
def _linear_terms(alpha, E, A, B, Ad, Bd, left, right, alpha_v, vs, dot):
    """``vs <- (J v)_i + (d rank_i / d alpha) alpha_v`` in sorted order (``v_i`` is used up),
    and with ``dot`` ``Ad <- v_i d rank_i / d alpha`` (``Ad_i`` is used up).

    ``left_i = sum_(j <= i) v_j e_ij`` and ``right_i = sum_(j >= i) v_j e_ij``, so
    ``sum_(j < i) (v_i - v_j) e_ij = E_i (v_i A_(i-1) - left_(i-1))``, and the same to the right.
    """
    row, i, inside = element(vs.shape)
    if inside:
        n = vs.shape[1]
        scale = 0.5 * (1.0 / alpha[row])
        vi = vs[row, i]
        # sum_(j != i) (v_i - v_j) e_ij, each side as E times the neighbour's sums (the CPU's
        # operations): v_i A_i - left_i would cancel the two v_i and lose the rest
        lower = E[row, i] * (vi * A[row, i - 1] - left[row, i - 1]) if i > 0 else 0.0
        upper = E[row, i + 1] * (vi * B[row, i + 1] - right[row, i + 1]) if i + 1 < n else 0.0
        d_alpha = -(Ad[row, i] - Bd[row, i]) * scale
        vs[row, i] = (lower + upper) * scale + d_alpha * alpha_v[row]
        if dot:
            Ad[row, i] = vi * d_alpha


def _rank_linear(xs, order, alpha, decay, v, alpha_v, out, dot, work):
    """``out = J v + (d rank / d alpha) alpha_v`` for every row (NaN rows give NaN); with
    ``dot`` returns the terms ``v_i d rank_i / d alpha`` (rows, n) of alpha's cotangent.

    Entries at +-inf neither receive nor pass on anything. ``work``: (rows, >= 3, >= n).
    """
    rows, n = xs.shape
    vs, A, B = (work[:, k, :n] for k in range(3))
    temps = _launch.empty((rows, _LINEAR_TEMPS, n))
    Ad, Bd, left, right = (temps[:, k, :] for k in range(_LINEAR_TEMPS))
    gather_finite(xs, order, v, vs)
    prefix_sums(xs, alpha, decay, A, B, decays=False)
    prefix_moments(xs, alpha, decay, A, B, Ad, Bd)
    affine_scan(decay, vs, left)
    affine_scan(decay, vs, right, reverse=True)
    _launch.for_each(
        _linear_terms, xs.size, alpha, decay, A, B, Ad, Bd, left, right, alpha_v, vs, dot
    )
    scatter(xs, order, vs, out, finite=True)
    return Ad if dot else None


def rank_vjp(xs, order, alpha, decay, v, x_bar, alpha_bar, work) -> None:
    """GPU :func:`softorder.core.rank.rank_vjp`: cotangent ``v`` (rows, n) -> ``x_bar``
    (rows, n) and ``alpha_bar`` (rows,).

    ``work``: (rows, >= 3, >= n).
    """
    rows, n = xs.shape
    no_alpha = _launch.empty((rows,))
    fill(no_alpha.reshape(rows, 1), 0.0)
    dot_terms = _rank_linear(xs, order, alpha, decay, v, no_alpha, x_bar, True, work)
    row_sums(dot_terms, alpha_bar)
    nan_rows(xs, alpha_bar)


def rank_jvp(xs, order, alpha, decay, x_dot, alpha_dot, out, work) -> None:
    """GPU :func:`softorder.core.rank.rank_jvp`: tangents ``x_dot`` (rows, n) and
    ``alpha_dot`` (rows,) -> tangent of the ranks ``out`` (rows, n).

    ``work``: (rows, >= 3, >= n).
    """
    _rank_linear(xs, order, alpha, decay, x_dot, alpha_dot, out, False, work)


__all__ = ["rank_forward", "rank_jvp", "rank_vjp"]
