"""Gradients of the inverse values: soft sort (``w = k - 1/2``) and soft quantile (``w = q n``).

The forward pass is :func:`softorder.core.lapsum.inverse_kernel`. With ``b_j = S^-1(w_j)``:

    db_j/dr_i = e_ji / E_j,   db_j/dw_j = 1 / G_j,
    db_j/dalpha = sum_i e_ji (b_j - r_i) / (alpha E_j)

(``e_ji = exp(-|b_j - r_i| / alpha)``). Both products are one merge of the sorted row with the
sorted targets, O(n + m) per row.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from softorder.core._jit import kernel
from softorder.core.lapsum import (
    TABLES_WITH_MOMENTS,
    inverse_pullback,
    inverse_pushforward,
    row_tables,
)
from softorder.core.rows import gather_finite, has_nan, scatter_finite

#: rows of scratch: the tables and the gradient (the CPU kernel keeps the gradient in the row
#: of ``S`` and the pullback's upward injections in the last row)
VJP_WORK = TABLES_WITH_MOMENTS + 1
#: the tables and the tangent (the CPU kernel keeps it in the row of ``S``: one row untouched)
JVP_WORK = TABLES_WITH_MOMENTS + 1


@kernel
def inverse_vjp(xs, order, alpha, anchor, offset, worder, u, x_bar, w_bar, alpha_bar, work, twork):
    """Cotangent ``u`` (rows, m) on the targets -> ``x_bar`` (rows, n; original element order),
    ``w_bar`` (rows, m) and ``alpha_bar`` (rows,). Scratch: ``work`` (rows, VJP_WORK, n),
    ``twork`` (rows, PULLBACK_WORK, m; only the GPU twin uses it). A ``w_bar`` of width 0 asks
    for no ``w_bar`` (soft sort discards it; it costs an ``exp`` per target).
    """
    rows, n = xs.shape
    want_wbar = w_bar.shape[1] == anchor.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            w_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        tables = row_tables(r, 1.0 / a, True, work[row])
        rbar = work[row, 3, :n]  # S: the gradients do not read it
        rbar[:] = 0.0
        alpha_bar[row] = inverse_pullback(
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            u[row],
            rbar,
            w_bar[row],
            work[row, TABLES_WITH_MOMENTS, :n],
            rbar,
            want_wbar,
            True,
        )
        scatter_finite(r, order[row], rbar, x_bar[row])


@kernel
def inverse_jvp(
    xs, order, alpha, anchor, offset, worder, x_dot, w_dot, alpha_dot, out, work, twork
):
    """Tangents ``x_dot`` (rows, n; original order), ``w_dot`` (rows, m), ``alpha_dot`` (rows,)
    -> tangent of the targets ``out`` (rows, m). Scratch: ``work`` (rows, JVP_WORK, n),
    ``twork`` (rows, PUSHFORWARD_WORK, m).
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :] = np.nan
            continue
        a = alpha[row]
        tables = row_tables(r, 1.0 / a, True, work[row])
        rdot = work[row, 3, :n]  # S: the gradients do not read it (row 6 stays untouched)
        gather_finite(r, order[row], x_dot[row], rdot)
        inverse_pushforward(
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            worder[row],
            rdot,
            w_dot[row],
            alpha_dot[row],
            out[row],
            twork[row],
        )
