"""Kernels' sums computed in another order, or with their merge points found first, give the
same values to the bit as the plain passes they replace: ``topk_loss._spread_joined`` against
``kernel_sums.spread_to_points``, on rows with ties, infinities, infinite offsets, zero and
negative-zero coefficients, and any order of the sources."""

import numpy as np
import pytest

from softorder.core import kernel_sums, topk_loss


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


@pytest.fixture(scope="module")
def spreads():
    import numba

    @numba.njit
    def run(r, inv_alpha, E, anchor, offset, c, shift, order, out1, out2, up_at, down_at):
        kernel_sums.spread_to_points(r, inv_alpha, E, anchor, offset, c, shift, order, out1)
        topk_loss._spread_joined(
            r, inv_alpha, E, anchor, offset, c, shift, order, out2, up_at, down_at
        )

    return run


@pytest.mark.parametrize("alpha", [1e-3, 0.1, 50.0])
def test_spread_joined_is_spread_to_points_to_the_bit(rng, spreads, alpha):
    for n in [*range(1, 24), 999, 1000]:
        for trial in range(12):
            r = _rows(rng, n, trial)
            E = _decays(r, alpha)
            K = int(rng.integers(1, 7))
            anchor = np.sort(rng.integers(0, n, size=K))
            choices = [-0.3, 0.0, 0.4] + ([np.inf, -np.inf] if trial > 8 else [])
            offset = rng.choice(choices, size=K)
            with np.errstate(invalid="ignore"):
                position = r[anchor] + alpha * offset
            order = np.argsort(position, kind="stable") if trial % 3 else rng.permutation(K)
            c = rng.standard_normal(K) * rng.choice([0.0, 1.0, 1e-300, -0.0], size=K)
            shift = -np.abs(rng.standard_normal(K))
            out1 = rng.standard_normal(n) * (trial % 2)
            out2 = out1.copy()
            spreads(r, 1.0 / alpha, E, anchor, offset, c, shift, order, out1, out2,
                    np.empty(K), np.empty(K))  # fmt: skip
            np.testing.assert_array_equal(out2, out1)
            np.testing.assert_array_equal(np.signbit(out2), np.signbit(out1))
