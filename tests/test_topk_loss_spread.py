"""The top-k loss's ``_spread_to_points`` (each source's joining points found first) is
``kernel_sums.spread_to_points`` to the bit: rows with ties and infinities, sources from
real inversions and made-up ones (offsets of both signs and 0, infinite ones), in ascending
and in random order, zero coefficients of both signs."""

import numpy as np
import pytest

from softorder.core import kernel_sums, lapsum, topk_loss


@pytest.fixture(scope="module")
def both():
    import numba

    @numba.njit
    def run(r, inv_alpha, E, anchor, offset, c, shift, order, out1, out2, joins):
        kernel_sums.spread_to_points(r, inv_alpha, E, anchor, offset, c, shift, order, out1)
        topk_loss._spread_to_points(r, inv_alpha, E, anchor, offset, c, shift, order, out2, joins)

    return run


def _row(rng, n, trial):
    r = np.sort(rng.normal(size=n))
    if n > 4 and trial % 4 > 0:
        r[n // 2] = r[n // 2 - 1] = r[n // 2 + 1] if n > 5 else r[n // 2]
        r[1] = r[0]
    if n > 6 and trial % 4 > 1:
        r[0] = r[1] = -np.inf
        r[-1] = np.inf
    if n > 6 and trial % 4 > 2:
        r[-2] = np.inf
    return r


@pytest.mark.parametrize("alpha", [1e-3, 0.1, 50.0])
def test_spread_to_points_is_kernel_sums_to_the_bit(rng, both, alpha):
    for n in [*range(1, 20), 200, 1000]:
        for trial in range(12):
            r = _row(rng, n, trial)
            E = np.zeros(n)
            with np.errstate(invalid="ignore"):
                d = np.diff(r)
            d[np.isnan(d)] = 0.0
            E[1:] = np.exp(-d / alpha)
            m = int(rng.integers(1, 8))
            if trial < 6:  # targets of the inverse, as the loss has them
                w = np.sort(rng.uniform(0.0, n, size=m))
                anchor, offset = np.empty(m, np.int64), np.empty(m)
                work = np.empty((4, n))
                lapsum.inverse_kernel(
                    r[None],
                    np.array([alpha]),
                    w[None],
                    np.argsort(w)[None],
                    np.empty((1, m)),
                    anchor[None],
                    offset[None],
                    work[None],
                )
            else:
                anchor = rng.integers(0, n, size=m)
                offset = rng.choice([0.0, -0.0, 0.3, -0.3, 2.5, -7.0, np.inf, -np.inf], size=m)
            order = np.argsort(anchor + 0.5 * np.tanh(offset)) if trial % 2 else rng.permutation(m)
            c = rng.normal(size=m) * rng.choice([1.0, 0.0, -0.0], size=m)
            shift = np.zeros(m)
            out1 = rng.normal(size=n)
            out2 = out1.copy()
            joins = np.full((2, m), np.nan)
            both(r, 1.0 / alpha, E, anchor, offset, c, shift, order, out1, out2, joins)
            np.testing.assert_array_equal(out2, out1)
            np.testing.assert_array_equal(np.signbit(out2), np.signbit(out1))
