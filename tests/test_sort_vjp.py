"""Soft sort's own VJP kernel (:func:`softorder.core.sort.sort_vjp`) against the general
:func:`~softorder.core.sort.inverse_vjp` at the targets k - 1/2, bit for bit, including NaN
rows, ties, infinities, ``x_bar`` written into the cotangent, targets out of order and float32
cotangents and gradients.
"""

import numpy as np
import pytest

import softorder
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
    anchor, offset = _ladder(xs, alpha)
    u = rng.normal(size=(rows, n))
    x_bar, alpha_bar = _inverse_vjp(xs, order, alpha, anchor, offset, u)
    work = core.workspace(rows, core.sort.SORT_VJP_WORK, n)
    got, got_alpha = np.empty((rows, n)), np.empty(rows)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u, got, got_alpha, work)
    np.testing.assert_array_equal(got, x_bar)
    np.testing.assert_array_equal(got_alpha, alpha_bar)
    in_place, in_place_alpha = u.copy(), np.empty(rows)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, in_place, in_place, in_place_alpha, work)
    np.testing.assert_array_equal(in_place, x_bar)
    np.testing.assert_array_equal(in_place_alpha, alpha_bar)


def _ladder(xs, alpha):
    rows, n = xs.shape
    anchor, offset = np.empty((rows, n), np.int64), np.empty((rows, n))
    core.lapsum.sort_kernel(
        xs, alpha, np.empty((rows, n)), anchor, offset, core.workspace(rows, 3, n)
    )
    return anchor, offset


def _inverse_vjp(xs, order, alpha, anchor, offset, u):
    rows, n = xs.shape
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
    return x_bar, alpha_bar


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "spread"])
def test_sort_vjp_takes_targets_in_any_order(rng, kind):
    # the targets' left points out of order restart the recurrences of A and Ad: the same
    # values as the general VJP, which reads them from rows
    rows, n = 2, 300
    xs, order = _rows(rng, kind, rows, n)
    alpha = rng.uniform(1e-2, 1.0, rows)
    anchor, offset = _ladder(xs, alpha)
    shuffle = np.stack([rng.permutation(n) for _ in range(rows)])
    anchor = np.take_along_axis(anchor, shuffle, 1)
    offset = np.take_along_axis(offset, shuffle, 1)
    u = rng.normal(size=(rows, n))
    want, want_alpha = _inverse_vjp(xs, order, alpha, anchor, offset, u)
    got, got_alpha = np.empty((rows, n)), np.empty(rows)
    work = core.workspace(rows, core.sort.SORT_VJP_WORK, n)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u, got, got_alpha, work)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_alpha, want_alpha)


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "nan", "spread"])
def test_sort_vjp_of_float32_cotangents_is_the_float64_one_rounded(rng, kind):
    rows, n = 3, 200
    xs, order = _rows(rng, kind, rows, n)
    order = order.astype(np.int32)  # the host's index dtype
    alpha = rng.uniform(1e-2, 1.0, rows)
    anchor, offset = _ladder(xs, alpha)
    u32 = rng.normal(size=(rows, n)).astype(np.float32)
    u32[:, ::7] = 0.0
    want, want_alpha = _inverse_vjp(xs, order, alpha, anchor, offset, u32.astype(np.float64))
    got, got_alpha = np.empty((rows, n), np.float32), np.empty(rows)
    work = core.workspace(rows, core.sort.SORT_VJP_WORK, n)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u32, got, got_alpha, work)
    np.testing.assert_array_equal(got.view(np.int32), want.astype(np.float32).view(np.int32))
    np.testing.assert_array_equal(got_alpha, want_alpha)


@pytest.mark.parametrize("descending", [False, True])
def test_float32_soft_sort_gradients_are_the_float64_ones_rounded(rng, descending):
    x32 = rng.normal(size=(3, 50)).astype(np.float32)
    x32[1, ::5] = x32[1, 2]  # ties
    x64 = x32.astype(np.float64)
    for alpha in (0.01, 0.5, 4.0):
        out32, pull32 = softorder.vjp(softorder.soft_sort, x32, alpha=alpha, descending=descending)
        _, pull64 = softorder.vjp(softorder.soft_sort, x64, alpha=alpha, descending=descending)
        u = rng.normal(size=out32.shape).astype(np.float32)
        want = [np.asarray(g).astype(np.float32) for g in pull64(u.astype(np.float64))]
        for cotangent in (u, u.astype(np.float64)):  # read in place / softorder's copy
            for g, w in zip(pull32(cotangent), want, strict=True):
                assert np.asarray(g).dtype == np.float32
                np.testing.assert_array_equal(np.asarray(g).view(np.int32), w.view(np.int32))


def test_sort_vjp_of_a_target_beyond_a_long_tie_block(rng):
    # a target just above a block of 20 equal values, anchored at its first: its injection
    # lands far from the target
    n = 100
    x = np.sort(rng.normal(size=n))
    x[40:60] = x[40]
    xs, order = x.reshape(1, n), np.arange(n).reshape(1, n)
    alpha = np.array([0.05])
    anchor, offset = _ladder(xs, alpha)
    j = int(np.searchsorted(anchor[0], 40))
    anchor[0, j], offset[0, j] = 40, 0.01
    u = rng.normal(size=(1, n))
    want, want_alpha = _inverse_vjp(xs, order, alpha, anchor, offset, u)
    got, got_alpha = np.empty((1, n)), np.empty(1)
    work = core.workspace(1, core.sort.SORT_VJP_WORK, n)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u, got, got_alpha, work)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_alpha, want_alpha)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sort_pullback_allocates_the_gradient_and_five_rows(dtype):
    from tests.test_memory import N, _pullback_peak

    x = np.random.default_rng(3).standard_normal(N).astype(dtype)
    # the gradient (float32 for a float32 input: no float64 copy of the cotangent) and 5 rows
    # of scratch (inverse_vjp's path: a float64 gradient and 7 rows, 64 bytes per element)
    itemsize = np.dtype(dtype).itemsize
    assert _pullback_peak(softorder.soft_sort, x) <= (40 + itemsize) * N + 4096


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "nan", "spread"])
def test_sort_forward_is_sort_kernel_with_int32_anchors(rng, kind):
    rows, n = 3, 300
    xs, _ = _rows(rng, kind, rows, n)
    alpha = rng.uniform(1e-3, 3.0, rows)
    want = np.empty((rows, n))
    anchor, offset = np.empty((rows, n), np.int64), np.empty((rows, n))
    work = core.workspace(rows, core.lapsum.SORT_TABLES, n)
    core.lapsum.sort_kernel(xs, alpha, want, anchor, offset, work)
    for dtype in (np.float64, np.float32):
        out = np.empty((rows, n), dtype)
        anchor32, offset32 = np.empty((rows, n), np.int32), np.empty((rows, n))
        core.lapsum.sort_forward(xs, alpha, out, anchor32, offset32, work)
        np.testing.assert_array_equal(out, want.astype(dtype))
        np.testing.assert_array_equal(anchor32, anchor)
        np.testing.assert_array_equal(offset32, offset)


@pytest.mark.parametrize("zeros", ["head", "tail", "all"])
def test_soft_sort_gradient_with_zero_cotangents_matches_finite_differences(rng, zeros):
    # zero cotangents skip targets in the pullback: the gradient of <u, soft_sort(x)> must
    # still be its directional derivative (a kernel that kept table values in the skipped
    # slots once gave gradients of 55.8 for a zero cotangent)
    n = 100
    x = rng.normal(size=n)
    u = rng.normal(size=n)
    if zeros == "head":
        u[: n - 3] = 0.0
    elif zeros == "tail":
        u[3:] = 0.0
    else:
        u[:] = 0.0
    out, pullback = softorder.vjp(softorder.soft_sort, x, 0.3)
    x_bar, alpha_bar = pullback(u)
    xs, order = np.sort(x).reshape(1, n), np.argsort(x).reshape(1, n)
    anchor, offset = _ladder(xs, np.array([0.3]))
    want, want_alpha = _inverse_vjp(xs, order, np.array([0.3]), anchor, offset, u.reshape(1, n))
    np.testing.assert_array_equal(x_bar, want[0])
    np.testing.assert_array_equal(alpha_bar, want_alpha[0])
    d = rng.normal(size=n)
    h = 1e-6
    plus = softorder.soft_sort(x + h * d, 0.3)
    minus = softorder.soft_sort(x - h * d, 0.3)
    np.testing.assert_allclose(x_bar @ d, u @ (plus - minus) / (2 * h), rtol=1e-5, atol=1e-7)
