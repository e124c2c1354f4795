"""``kernel_sums._carry_both_ways`` (the two carries side by side, soft sort's and the
permutation loss's VJPs): the totals of :func:`~softorder.core.kernel_sums.carry_injections`
to the bit, and the carried sums written out by brute force.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from softorder.core import kernel_sums


def _case(n: int, seed: int):
    rng = np.random.default_rng(seed)
    E = np.exp(-rng.exponential(size=n))
    E[rng.random(n) < 0.2] = 0.0  # far gaps
    E[rng.random(n) < 0.2] = 1.0  # ties
    return E, rng.standard_normal(n), rng.standard_normal(n)


def _brute(E, up, down):
    """``sum_{j <= i} up[j] prod E[j+1..i] + sum_{j >= i} down[j] prod E[i+1..j]``."""
    n = len(E)
    out = np.zeros(n)
    for i in range(n):
        for j in range(n):
            if j <= i:
                out[i] += up[j] * np.prod(E[j + 1 : i + 1])
            if j >= i:
                out[i] += down[j] * np.prod(E[i + 1 : j + 1])
    return out


@numba.njit
def _both_compiled(E, up, down):
    kernel_sums.carry_both_ways(E, up, down)


@numba.njit
def _both_inlined(E, up, down):
    kernel_sums.carry_both_ways_inline(E, up, down)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 200])
@pytest.mark.parametrize("seed", [0, 1])
def test_totals_are_carry_injections_bits_and_the_brute_force_sums(n, seed):
    E, up, down = _case(n, seed)
    expected = np.empty(n)
    kernel_sums.carry_injections.py_func(E, up.copy(), down.copy(), expected, True)
    np.testing.assert_allclose(expected, _brute(E, up, down), rtol=1e-12, atol=1e-12)
    for run in (kernel_sums._carry_both_ways, _both_compiled, _both_inlined):
        u, d = up.copy(), down.copy()
        run(E, u, d)
        assert (d + u).tobytes() == expected.tobytes()
