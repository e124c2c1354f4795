"""``topk.finite_z`` (the forward's distances in rows without infinities) is
``laplace.offset_z`` to the bit for finite values, offsets and ``1 / alpha``: signed zeros,
ties, subnormals, huge values whose difference overflows."""

import numpy as np
import pytest

from softorder.core import topk
from softorder.core.laplace import offset_z


@pytest.fixture(scope="module")
def both():
    import numba

    @numba.njit
    def run(ra, ri, inv_alpha, t, out):
        for k in range(ra.shape[0]):
            out[0, k] = offset_z(ra[k], ri[k], inv_alpha[k], t[k])
            out[1, k] = topk.finite_z(ra[k], ri[k], inv_alpha[k], t[k])

    return run


def test_finite_z_is_offset_z_to_the_bit(rng, both):
    special = np.array([0.0, -0.0, 5e-324, -5e-324, 1e-300, 1.5, -1.5, 1e308, -1e308, 1.7e308])
    size = 200_000
    ra = np.concatenate([rng.choice(special, size), rng.normal(size=size) * 10.0])
    ri = np.concatenate([rng.choice(special, size), rng.normal(size=size) * 10.0])
    ri[::7] = ra[::7]  # ties
    t = np.concatenate([rng.choice([0.0, -0.0, 0.3, -2.0, 1e300], size), rng.normal(size=size)])
    inv_alpha = rng.choice([1e-3, 1.0, 10.0, 1e300], 2 * size)
    out = np.empty((2, 2 * size))
    both(ra, ri, inv_alpha, t, out)
    np.testing.assert_array_equal(out[1].view(np.int64), out[0].view(np.int64))


def test_finite_row_refuses_infinite_ends_and_alpha():
    import numba

    @numba.njit
    def run(r, inv_alpha):
        return topk.finite_row(r, inv_alpha)

    assert run(np.array([-1.0, 0.0, 2.0]), 10.0)
    assert not run(np.array([-np.inf, 0.0, 2.0]), 10.0)
    assert not run(np.array([-1.0, 0.0, np.inf]), 10.0)
    assert not run(np.array([-1.0, 0.0, 2.0]), np.inf)
