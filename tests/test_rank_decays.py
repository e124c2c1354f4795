"""rank_forward computes its decays in a pass of their own (fast_exp.exp_main where libm's
``exp`` allows, ``math.exp`` at the decays outside its range) and then the recurrences: its
decays are ``math.exp``'s to the bit, and its ranks those of the plain prefix sums."""

import math

import numpy as np
import pytest

from softorder.core import fast_exp
from softorder.core.rank import FORWARD_WORK, rank_forward


def _rows(rng, n):
    """Rows of one length with every kind of gap: ordinary ones, ties, gaps too far for the
    main path of ``exp`` (its result underflows), gaps too small for it (``|x| < 2^-54``), and
    infinities at both ends."""
    x = rng.standard_normal((6, n))
    x[1] = np.round(x[1] * 2) / 2  # ties
    x[2] = np.cumsum(np.abs(x[2])) * 1e3  # far gaps
    m = len(x[2, 1::4])
    x[2, 1::4] = x[2, 0::4][:m] + 0.6 + 0.12 * rng.random(m)  # 600-720 alpha at alpha = 1e-3
    x[3] = 1.0 + np.arange(n) * 2.0**-52 * rng.integers(1, 4, n)  # tiny gaps
    x[4, : n // 3] = -np.inf
    x[4, -(n // 4) :] = np.inf
    x[5, ::2] = x[5, 0]  # half the row one value
    return x


def _reference(r, order, alpha):
    """Decays by ``math.exp`` and ranks from the recurrences of
    :func:`~softorder.core.lapsum.prefix_sums` in Python (the same operations), equal values
    given equal ranks, scattered."""
    n = r.shape[0]
    r64 = [float(value) for value in r]
    inv_alpha = 1.0 / alpha
    E = [0.0] + [
        math.exp(-(0.0 if r64[i] == r64[i - 1] else r64[i] - r64[i - 1]) * inv_alpha)
        for i in range(1, n)
    ]
    A = [1.0] * n
    B = [1.0] * n
    for i in range(1, n):
        A[i] = 1.0 + E[i] * A[i - 1]
    for i in range(n - 2, -1, -1):
        B[i] = 1.0 + E[i + 1] * B[i + 1]
    ranks = [(i + 1.0) + 0.5 * (B[i] - A[i]) for i in range(n)]
    for i in range(1, n):
        if r64[i] == r64[i - 1]:
            ranks[i] = ranks[i - 1]
    out = np.empty(n)
    out[order] = ranks
    return np.array(E), out


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 200, 1001])
@pytest.mark.parametrize("alpha", [1e-8, 1e-3, 0.1, 1.0, 1e3, 1e8])
def test_decays_and_ranks_to_the_bit(rng, dtype, n, alpha):
    x = _rows(rng, n).astype(dtype)
    order = np.argsort(x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, -1)
    rows = x.shape[0]
    out = np.empty((rows, n), dtype)
    decay = np.empty((rows, n))
    work = np.empty((rows, FORWARD_WORK, n))
    rank_forward(xs, order, np.full(rows, alpha), out, decay, work)
    for row in range(rows):
        E, ranks = _reference(xs[row], order[row], alpha)
        assert decay[row].tobytes() == E.tobytes()
        assert out[row].tobytes() == ranks.astype(dtype).tobytes()


def test_the_rows_reach_both_passes():
    """The rows above hold decays on the main path of ``exp``, beyond ``UNDERFLOW`` (0
    without a call) and between (libm's ``exp`` in the second pass), besides tiny gaps, ties
    and infinities, so every branch of the decays runs where :data:`FAST_EXP` is on."""
    x = _rows(np.random.default_rng(0), 200)
    xs = np.sort(x, axis=-1)
    with np.errstate(all="ignore"):  # inf - inf between equal infinities
        z = np.abs(np.diff(xs, axis=-1) / 1e-3)
        inside = (z >= fast_exp.TINY) & (z < fast_exp.LARGE)
        between = (z >= fast_exp.LARGE) & (z <= -fast_exp.UNDERFLOW)
        under = np.isfinite(z) & (z > -fast_exp.UNDERFLOW)
    assert inside.any() and between.any() and under.any() and (z < fast_exp.TINY).any()
