"""``lapsum.prefix_sums_halves`` is ``lapsum.prefix_sums_ab`` (and ``prefix_tables_halves`` is
``prefix_sums``) in another order: the same tables to the bit, for every row length (odd and
even halves), ties and infinities included."""

import numpy as np
import pytest

from softorder.core import lapsum


@pytest.fixture(scope="module")
def both():
    import numba

    @numba.njit
    def run(r, inv_alpha, A1, B1, A2, B2):
        lapsum.prefix_sums_ab(r, inv_alpha, A1, B1)
        lapsum.prefix_sums_halves(r, inv_alpha, A2, B2)

    return run


@pytest.mark.parametrize("alpha", [1e-3, 0.7, 50.0])
def test_prefix_sums_halves_is_prefix_sums_ab_to_the_bit(rng, both, alpha):
    for n in [*range(1, 24), 999, 1000]:
        r = np.sort(rng.normal(size=n))
        if n > 4:
            r[n // 2] = r[n // 2 - 1]  # a tie between the halves
            r[1] = r[0] = -np.inf
        if n > 6:
            r[-1] = np.inf
        out = [np.full(n, np.nan) for _ in range(4)]
        both(r, 1.0 / alpha, *out)
        np.testing.assert_array_equal(out[2], out[0])
        np.testing.assert_array_equal(out[3], out[1])


@pytest.mark.parametrize("alpha", [1e-3, 0.7, 50.0])
def test_prefix_tables_halves_is_prefix_sums_to_the_bit(rng, alpha):
    """The three tables of soft sort's forward (E, A, B), computed in halves."""
    import numba

    @numba.njit
    def run(r, inv_alpha, E1, A1, B1, E2, A2, B2):
        lapsum.prefix_sums(r, inv_alpha, E1, A1, B1)
        lapsum.prefix_tables_halves(r, inv_alpha, E2, A2, B2)

    for n in [*range(1, 24), 999, 1000]:
        r = np.sort(rng.normal(size=n))
        if n > 4:
            r[n // 2] = r[n // 2 - 1]
            r[1] = r[0] = -np.inf
        if n > 6:
            r[-1] = np.inf
        out = [np.full(n, np.nan) for _ in range(6)]
        run(r, 1.0 / alpha, *out)
        for plain, halves in zip(out[:3], out[3:], strict=True):
            np.testing.assert_array_equal(halves, plain)
