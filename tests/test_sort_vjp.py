"""Soft sort's own VJP kernel (:func:`softorder.core.sort.sort_vjp`) against the general
:func:`~softorder.core.sort.inverse_vjp` at the targets k - 1/2, bit for bit, including NaN
rows, ties, infinities and ``x_bar`` written into the cotangent.
"""

import numpy as np
import pytest

from softorder import core


def _rows(rng, kind, rows, n):
    x = rng.normal(size=(rows, n))
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "infinite" and n >= 3:
        x[0, :3] = np.inf
        x[-1, 0] = -np.inf
        x[-1, 1:3] = x[-1, 3 % n]
    elif kind == "nan":
        x[0, n // 2] = np.nan
    elif kind == "spread":
        x *= 1e4
    order = np.argsort(x, axis=1)
    return np.take_along_axis(x, order, axis=1), order


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "nan", "spread"])
@pytest.mark.parametrize("shape", [(3, 1), (2, 2), (3, 40), (2, 1000)])
def test_sort_vjp_equals_inverse_vjp_bitwise(rng, kind, shape):
    rows, n = shape
    xs, order = _rows(rng, kind, rows, n)
    alpha = rng.uniform(1e-3, 3.0, rows)
    anchor, offset = np.empty((rows, n), np.int64), np.empty((rows, n))
    core.lapsum.sort_kernel(
        xs, alpha, np.empty((rows, n)), anchor, offset, core.workspace(rows, 3, n)
    )
    u = rng.normal(size=(rows, n))
    x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
    core.inverse_vjp(
        xs,
        order,
        alpha,
        anchor,
        offset,
        np.empty((rows, 0), np.int64),
        u,
        x_bar,
        np.empty((rows, 0)),
        alpha_bar,
        core.workspace(rows, core.sort.VJP_WORK, n),
        core.workspace(rows, 0, n),
    )
    work = core.workspace(rows, core.sort.VJP_WORK, n)
    got, got_alpha = np.empty((rows, n)), np.empty(rows)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u, got, got_alpha, work)
    np.testing.assert_array_equal(got, x_bar)
    np.testing.assert_array_equal(got_alpha, alpha_bar)
    in_place, in_place_alpha = u.copy(), np.empty(rows)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, in_place, in_place, in_place_alpha, work)
    np.testing.assert_array_equal(in_place, x_bar)
    np.testing.assert_array_equal(in_place_alpha, alpha_bar)
