"""Kernels that invert the ladder targets ``w0 + q`` without a search (soft sort, the
permutation boundaries), and the permutation loss kernels with any target ranks, against the
general inverse and tests/naive.py.
"""

import numpy as np
import pytest

from softorder import core
from tests import naive


def _rows(rng, kind):
    x = rng.normal(size=(3, 40))
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "infinite":
        x[0, :3] = np.inf
        x[1, 0] = -np.inf
        x[2, 5:9] = x[2, 4]
    elif kind == "spread":
        x *= 1e4
    order = np.argsort(x, axis=1)
    return np.take_along_axis(x, order, axis=1), order


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "spread"])
@pytest.mark.parametrize("alpha", [1e-3, 0.3, 20.0])
def test_sort_kernel_is_the_inverse_at_half_integers(rng, kind, alpha):
    xs, _ = _rows(rng, kind)
    rows, n = xs.shape
    a = np.full(rows, alpha)
    w = np.tile(np.arange(n) + 0.5, (rows, 1))
    outs = []
    for call in ("sort", "inverse"):
        out, anchor, offset = (
            np.empty((rows, n)),
            np.empty((rows, n), np.int64),
            np.empty((rows, n)),
        )
        if call == "sort":
            work = core.workspace(rows, core.lapsum.SORT_TABLES, n)
            core.lapsum.sort_kernel(xs, a, out, anchor, offset, work)
        else:
            work = core.workspace(rows, core.lapsum.TABLES, n)
            worder = np.tile(np.arange(n), (rows, 1))
            core.inverse_kernel(xs, a, w, worder, out, anchor, offset, work)
        outs.append((out, anchor, offset))
    for got, expected in zip(*outs, strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("repeats", [False, True], ids=["permutation", "repeats"])
def test_permutation_loss_kernels(rng, repeats):
    rows, n, alpha = 3, 7, 0.4
    x = rng.normal(size=(rows, n))
    if repeats:
        target = rng.integers(1, n + 1, size=(rows, n))
        target[:, 0] = target[:, 1]  # at least one rank twice in every row
    else:
        target = np.argsort(rng.normal(size=(rows, n)), axis=1) + 1
    a = np.full(rows, alpha)
    w, worder = np.arange(1.0, n), np.arange(n - 1)

    def loss(x):
        order = np.argsort(x, axis=1)
        xs = np.take_along_axis(x, order, axis=1)
        out = np.empty(rows)
        anchor, offset = np.empty((rows, n - 1), np.int64), np.empty((rows, n - 1))
        work = core.workspace(rows, core.permutation.FORWARD_WORK, n)
        core.permutation_loss_forward(xs, order, a, target, w, worder, out, anchor, offset, work)
        return out, (xs, order, anchor, offset)

    out, (xs, order, anchor, offset) = loss(x)
    expected = [
        -sum(np.log(naive.soft_permutation(x[i], alpha)[t - 1, j]) for j, t in enumerate(target[i]))
        for i in range(rows)
    ]
    np.testing.assert_allclose(out, expected, rtol=1e-10)

    x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
    core.permutation_loss_vjp(
        xs,
        order,
        a,
        target,
        anchor,
        offset,
        worder,
        np.ones(rows),
        x_bar,
        alpha_bar,
        core.workspace(rows, core.permutation.GRADIENT_WORK, n),
        core.workspace(rows, core.permutation.LOSS_BOUNDARY_WORK, n - 1),
    )
    direction = rng.normal(size=(rows, n))
    numeric = naive.central_difference(lambda y: loss(y)[0], x, direction)
    np.testing.assert_allclose((x_bar * direction).sum(axis=1), numeric, rtol=1e-6, atol=1e-8)
