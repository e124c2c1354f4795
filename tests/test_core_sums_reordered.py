"""Kernels' sums computed in another order give the same values to the bit as the plain
passes they replace: ``lapsum.neighbour_sums`` and ``sort.few_tables`` against the full
tables of ``lapsum.moment_tables``, on rows with ties, infinities, zero and negative-zero
coefficients and targets at both ends."""

import numpy as np
import pytest

from softorder.core import lapsum, sort


def _rows(rng, n, trial):
    """A sorted row of n with ties between the halves, infinities at both ends on later trials."""
    r = np.sort(rng.normal(size=n))
    if n > 4 and trial > 0:
        r[n // 2] = r[n // 2 - 1]
        r[1] = r[0] = -np.inf
    if n > 6 and trial > 1:
        r[-1] = np.inf
    if n > 8 and trial > 5:
        r[-2] = np.inf
        r[2] = -np.inf
    return r


def _decays(r, alpha):
    with np.errstate(invalid="ignore"):
        d = np.diff(r, prepend=r[0])
    d[np.isnan(d)] = 0.0  # equal infinities: gap 0
    return np.exp(-d / alpha)


@pytest.mark.parametrize("alpha", [1e-3, 0.1, 50.0])
def test_neighbour_sums_and_few_tables_are_moment_tables_to_the_bit(rng, alpha):
    import numba

    @numba.njit
    def run(r, inv_alpha, anchor, offset, work, E1, sums, E2, marks, few_at):
        lapsum.moment_tables(r, inv_alpha, work)
        lapsum.neighbour_sums(r, inv_alpha, E1, anchor, offset, sums)
        E, A, B, Ad, Bd, _ = sort.few_tables(r, inv_alpha, anchor, offset, E2, marks)
        n = r.shape[0]
        for j in range(anchor.shape[0]):  # the few tables hold their values at these only
            left = anchor[j] - 1 if offset[j] <= 0.0 else anchor[j]
            if left >= 0:
                few_at[0, j] = A[left]
                few_at[1, j] = Ad[left]
            if left + 1 < n:
                few_at[2, j] = B[left + 1]
                few_at[3, j] = Bd[left + 1]

    for n in [*range(1, 30), 999, 1000]:
        for trial in range(8):
            r = _rows(rng, n, trial)
            K = int(rng.integers(1, 9))
            anchor = rng.integers(0, n, size=K)
            if trial > 4 and K > 1:
                anchor[:2] = [0, n - 1]  # targets at both ends (no left or no right point)
            offset = rng.choice([-0.3, 0.0, 0.4], size=K)
            work = np.full((6, n), np.nan)
            E1, E2, marks = np.full(n, np.nan), np.full(n, np.nan), np.zeros(n)
            sums, few_at = np.full((5, K), np.nan), np.full((4, K), np.nan)
            run(r, 1.0 / alpha, anchor, offset, work, E1, sums, E2, marks, few_at)
            E, A, B, S, Ad, Bd = work
            np.testing.assert_array_equal(E1, E)
            np.testing.assert_array_equal(E2, E)
            left = np.where(offset <= 0.0, anchor - 1, anchor)
            np.testing.assert_array_equal(sums[0], left)
            has_left, has_right = left >= 0, left + 1 < n
            lo, hi = left[has_left], left[has_right] + 1
            for got, want, where in [
                (sums[1], A[lo], has_left),
                (sums[2], Ad[lo], has_left),
                (sums[3], B[hi], has_right),
                (sums[4], Bd[hi], has_right),
                (few_at[0], A[lo], has_left),
                (few_at[1], Ad[lo], has_left),
                (few_at[2], B[hi], has_right),
                (few_at[3], Bd[hi], has_right),
            ]:
                np.testing.assert_array_equal(got[where], want)
            assert np.all(sums[1:, ~has_left][:2] == 0.0) and np.all(sums[3:, ~has_right] == 0.0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_few_inverse_vjp_is_inverse_vjp_to_the_bit(rng, dtype):
    """The few-target pullback (its tables at the targets' points, its two carrying passes
    beside each other) against the general one, on rows with ties, infinities, a NaN row,
    targets at both ends and zero cotangents of both signs."""
    from softorder.core import sort

    for n in [*range(1, 30), 999, 1000]:
        for trial in range(8):
            rows = 3
            x = np.stack([_rows(rng, n, trial) for _ in range(rows)]).astype(dtype)
            x = x.astype(np.float64)
            if trial == 5 and n > 1:
                x[1, -1] = np.nan
            m = int(rng.integers(1, 5))
            w = np.sort(rng.uniform(0.0, n, size=(rows, m)), axis=1)
            if trial > 5:
                w[:, 0] = 0.5 / (n + 1)
                w[:, -1] = n - 0.5 / (n + 1)
            alpha = rng.choice([1e-3, 0.1, 50.0], size=rows)
            out = np.empty((rows, m))
            anchor, offset = np.empty((rows, m), np.int64), np.empty((rows, m))
            lapsum.inverse_kernel(
                x, alpha, w, np.argsort(w, axis=1), out, anchor, offset, np.empty((rows, 4, n))
            )
            order = np.argsort(rng.standard_normal((rows, n)), axis=1)
            u = rng.standard_normal((rows, m)) * rng.choice([0.0, 1.0, -0.0], size=(rows, m))
            got = []
            kernels = [(sort.few_inverse_vjp, sort.FEW_VJP_WORK), (sort.inverse_vjp, sort.VJP_WORK)]
            for kernel, width in kernels:
                x_bar, w_bar, alpha_bar = (
                    np.full((rows, n), 7.0),
                    np.full((rows, m), 7.0),
                    np.ones(rows),
                )
                work = np.full((rows, width, n), 3.0)
                worder, twork = np.empty((rows, 0), np.int64), np.empty((rows, 0, m))
                kernel(
                    x, order, alpha, anchor, offset, worder, u, x_bar, w_bar, alpha_bar, work, twork
                )
                got.append((x_bar, w_bar, alpha_bar))
            for few, general in zip(*got, strict=True):
                np.testing.assert_array_equal(few, general)
                np.testing.assert_array_equal(np.signbit(few), np.signbit(general))
