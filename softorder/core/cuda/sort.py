"""GPU form of :mod:`softorder.core.sort`: gradients of the inverse values (soft sort with
``w = k - 1/2``, soft quantile with ``w = q n``). Same arguments as the CPU kernels.
"""

from __future__ import annotations

from softorder.core.cuda import _launch
from softorder.core.cuda.lapsum import inverse_pullback, inverse_pushforward, row_tables
from softorder.core.cuda.rows import gather_finite, nan_rows, scatter
from softorder.core.cuda.scan import fill, row_sums
from softorder.core.lapsum import TABLES_WITH_MOMENTS


def inverse_vjp(
    xs, order, alpha, anchor, offset, worder, u, x_bar, w_bar, alpha_bar, work, twork
) -> None:
    """GPU :func:`softorder.core.sort.inverse_vjp` (``worder`` and ``twork`` are not needed)."""
    tables = row_tables(xs, alpha, True, work)
    rbar = work[:, TABLES_WITH_MOMENTS, :]
    fill(rbar, 0.0)
    alpha_terms = _launch.empty(anchor.shape)
    inverse_pullback(xs, alpha, tables, anchor, offset, u, rbar, w_bar, alpha_terms)
    row_sums(alpha_terms, alpha_bar)
    scatter(xs, order, rbar, x_bar, finite=True)
    nan_rows(xs, w_bar, alpha_bar)


def inverse_jvp(
    xs, order, alpha, anchor, offset, worder, x_dot, w_dot, alpha_dot, out, work, twork
) -> None:
    """GPU :func:`softorder.core.sort.inverse_jvp` (``worder`` and ``twork`` are not needed)."""
    tables = row_tables(xs, alpha, True, work)
    rdot = work[:, TABLES_WITH_MOMENTS, :]
    gather_finite(xs, order, x_dot, rdot)
    inverse_pushforward(xs, alpha, tables, anchor, offset, rdot, w_dot, alpha_dot, out)
    nan_rows(xs, out)
