"""The kernels of softorder.core against tests/naive.py, on raw (rows, n) arrays."""

import numpy as np
import pytest

from softorder import core
from tests import naive


def sorted_rows(x):
    order = np.argsort(x, axis=1)
    return np.take_along_axis(x, order, axis=1), order


@pytest.mark.parametrize("alpha", [0.05, 0.7, 30.0])
def test_lapsum_at_points_matches_direct_sum(rng, alpha):
    x = rng.normal(size=(4, 9))
    x[1, 3] = x[1, 5]  # a tie
    xs, _ = sorted_rows(x)
    points = np.concatenate([rng.normal(size=(4, 5)) * 3, xs[:, :3]], axis=1)
    out = np.empty(points.shape)
    core.lapsum_kernel(xs, np.full(4, alpha), points, out, core.workspace(4, core.lapsum.TABLES, 9))
    expected = np.stack([naive.lapsum(x[i], points[i], alpha) for i in range(4)])
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.05, 0.7, 30.0])
def test_inverse_matches_bisection(rng, alpha):
    x = rng.normal(size=(3, 8))
    x[2, :4] = x[2, 4]  # a block of ties
    xs, _ = sorted_rows(x)
    w = rng.uniform(0.01, 7.99, size=(3, 6))
    w[:, 0] = [1.0, 4.0, 7.0]  # integer targets
    worder = np.argsort(w, axis=1)
    out = np.empty(w.shape)
    anchor = np.empty(w.shape, dtype=np.int64)
    offset = np.empty(w.shape)
    core.inverse_kernel(
        xs, np.full(3, alpha), w, worder, out, anchor, offset, core.workspace(3, 4, 8)
    )
    expected = np.stack([naive.lapsum_inverse(x[i], w[i], alpha) for i in range(3)])
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-10 * alpha)
    # and S(out) == w
    s = np.stack([naive.lapsum(x[i], out[i], alpha) for i in range(3)])
    np.testing.assert_allclose(s, w, rtol=1e-10)


def test_kernels_never_write_their_inputs(rng):
    x = rng.normal(size=(2, 6))
    xs, order = sorted_rows(x)
    xs0, order0 = xs.copy(), order.copy()
    alpha = np.full(2, 0.5)
    v = rng.normal(size=(2, 6))
    v0 = v.copy()
    out = np.empty((2, 6))
    decay = np.empty((2, 6))
    core.rank_forward(xs, order, alpha, out, decay, core.workspace(2, core.rank.FORWARD_WORK, 6))
    decay0 = decay.copy()
    core.rank_vjp(
        xs, order, alpha, decay, v, out, np.empty(2), core.workspace(2, core.rank.LINEAR_WORK, 6)
    )
    np.testing.assert_array_equal(decay, decay0)
    np.testing.assert_array_equal(xs, xs0)
    np.testing.assert_array_equal(order, order0)
    np.testing.assert_array_equal(v, v0)


@pytest.mark.parametrize("alpha", [1e-3, 0.7])
def test_row_tables_are_sum_tables_or_moment_tables(rng, alpha):
    """``row_tables`` (kernels call its two halves) against the naive sums: the same ``E``,
    ``A``, ``B``, ``S`` either way, and ``Ad``, ``Bd`` with the moments."""
    import numba

    from softorder.core import lapsum

    @numba.njit
    def tables(r, inv_alpha, moments, work):
        return lapsum.row_tables(r, inv_alpha, moments, work)

    r = np.sort(rng.normal(size=12))
    r[4] = r[5]  # a tie
    out = {}
    for moments in (False, True):
        work = np.full((lapsum.TABLES_WITH_MOMENTS, 12), np.nan)
        out[moments] = [np.array(t) for t in tables(r, 1.0 / alpha, moments, work)]
    d = np.abs(r[:, None] - r[None, :]) / alpha
    lower = np.tril(np.ones((12, 12), dtype=bool))  # j <= i
    A = np.where(lower, np.exp(-d), 0.0).sum(axis=1)
    B = np.where(lower.T, np.exp(-d), 0.0).sum(axis=1)
    Ad = np.where(lower, d * np.exp(-d), 0.0).sum(axis=1)
    Bd = np.where(lower.T, d * np.exp(-d), 0.0).sum(axis=1)
    S = np.arange(12) + 0.5 + 0.5 * (B - A)
    for moments, (E_, A_, B_, Ad_, Bd_, S_) in out.items():
        np.testing.assert_allclose(E_[1:], np.exp(-np.diff(r) / alpha), rtol=1e-12)
        for got, expected in ((A_, A), (B_, B), (S_, S)):
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-300)
        if moments:
            np.testing.assert_allclose(Ad_, Ad, rtol=1e-12, atol=1e-300)
            np.testing.assert_allclose(Bd_, Bd, rtol=1e-12, atol=1e-300)
        else:
            assert Ad_.size == Bd_.size == 0
    for a, b in zip(out[False][:3], out[True][:3], strict=True):
        np.testing.assert_array_equal(a, b)


def test_empty_allocates_c_ordered_arrays_as_numpy_does():
    """``lapsum.empty``, the kernels' in-place allocation: NumPy's shape, dtype, C strides
    and alignment; each array its own memory; a size past intp raises, never wraps.
    """
    import numba

    from softorder.core.lapsum import empty

    @numba.njit
    def make(rows, n):
        a = empty((rows, 3, n), np.float64)
        b = empty((n,), np.int32)
        c = empty((rows, n), np.uint8)
        a[:] = 1.5
        b[:] = 7
        c[:] = 2
        return a, b, c

    a, b, c = make(4, 5)
    for got, like in ((a, np.empty((4, 3, 5))), (b, np.empty(5, np.int32))):
        assert got.shape == like.shape and got.dtype == like.dtype
        assert got.strides == like.strides and got.flags.c_contiguous and got.flags.writeable
        assert got.ctypes.data % got.dtype.alignment == 0
    assert c.shape == (4, 5) and c.strides == (5, 1)
    assert (a == 1.5).all() and (b == 7).all() and (c == 2).all()
    with pytest.raises(ValueError, match="softorder: an array of that size is too big"):
        make(2**40, 2**40)
