"""Permutation cross-entropy: the closed-form density ratios of its gradient (issue 13).

The VJP takes ``d(-log P)/dz`` at the two boundaries of each element from
:func:`softorder.core.permutation.density_ratios` (one ``expm1`` in the tails) instead of
``exp(log f(z) - log P)``; checked here against extended precision and, through the whole
loss, against finite differences where the ratios take their limits.
"""

from __future__ import annotations

import math

import mpmath
import numba
import numpy as np
import pytest

import softorder as so
from softorder import core
from softorder.core import permutation as perm
from softorder.core.laplace import offset_z
from softorder.core.permutation import SERIES_GAP, density_ratios, log_rank_probability
from tests import naive

EPS = np.finfo(np.float64).eps


@numba.njit(cache=False)
def _ratios(z0, z1):
    """The compiled helper (its ``py_func`` raises on the overflow that numba gives as inf)."""
    return density_ratios(z0, z1)


@numba.njit(cache=False)
def _log_p(z0, z1):
    return log_rank_probability(z0, z1)


@numba.njit(cache=False)
def _offset_z(ra, ri, inv_alpha, t):
    return offset_z(ra, ri, inv_alpha, t)


def _exact(z0: float, z1: float) -> tuple[float, float]:
    """``(f(z0)/P, f(z1)/P)`` of the Laplace distribution in 60 digits."""
    with mpmath.workdps(60):
        a, b = mpmath.mpf(z0), mpmath.mpf(z1)
        if b <= 0:
            p = (mpmath.exp(b) - mpmath.exp(a)) / 2
        elif a >= 0:
            p = (mpmath.exp(-a) - mpmath.exp(-b)) / 2
        else:
            p = 1 - mpmath.exp(a) / 2 - mpmath.exp(-b) / 2
        return float(mpmath.exp(-abs(a)) / 2 / p), float(mpmath.exp(-abs(b)) / 2 / p), p


PAIRS = [
    (-3.0, -2.0),
    (-800.0, -799.99999),
    (-40.0, -1e-300),
    (-1e3, -1.0),  # expm1 overflows: the far ratio is 0, the near one 1
    (2.0, 3.0),
    (1e-12, 2e-12),
    (0.0, 5e-17),
    (700.0, 700.5),
    (0.5, 1e4),
    (2.0, 2.0 + SERIES_GAP * (1 - 1e-15)),  # the series' largest gap, and just past it
    (2.0, 2.0 + SERIES_GAP * (1 + 1e-15)),
    (-3.0, -3.0 + SERIES_GAP * 0.999),
    (-0.5, 0.25),  # the two sides of 0
    (-1e-9, 1e-9),
    (-30.0, 40.0),
    (-2.0, 0.0),
    (0.0, 2.0),
]


@pytest.mark.parametrize("z0, z1", PAIRS)
def test_log_rank_probability_against_extended_precision(z0, z1):
    """log P, the loss's term, within a few rounding errors of its parts' magnitudes."""
    got = _log_p(z0, z1)
    with mpmath.workdps(60):
        want = mpmath.log(_exact(z0, z1)[2])
    scale = abs(z0) + abs(z1) + abs(float(want)) + 1.0
    straddle = 1.0 if (z1 <= 0.0 or z0 >= 0.0) else max(1.0, 1.0 / float(mpmath.exp(want)))
    assert abs(got - float(want)) <= 4 * EPS * scale * straddle, (got, float(want))


def _ladder_loss(x, target, alpha):
    """The API's loss kernel on rows ``x`` (rows, n): losses, sorted rows, anchors, offsets."""
    rows, n = x.shape
    order = np.argsort(x, axis=1)
    xs = np.take_along_axis(x, order, axis=1)
    out = np.empty(rows)
    anchor, offset = np.empty((rows, n - 1), np.int32), np.empty((rows, n - 1))
    work = core.workspace(rows, perm.LADDER_FORWARD_WORK, n)
    perm.ladder_loss_forward(xs, order, np.full(rows, alpha), target, out, anchor, offset, work)
    return out, xs, order, anchor, offset


@pytest.mark.parametrize(
    "n, alpha, ties",
    [
        (60, 20.0, False),
        (300, 0.5, False),
        (2000, 5.0, False),
        (2000, 0.5, True),
        (100, 0.02, False),  # wide gaps (n alpha small): log(1 - exp(-d)) grouped
        (1000, 0.002, False),
    ],
)
def test_loss_against_extended_precision(rng, n, alpha, ties):
    """The loss takes the ``log d`` of LOG_GROUP ranks in the tails' series (and the
    ``log(1 - exp(-d))`` of wider gaps) as one log of their product: within 16 eps (relative;
    every term is positive) of the 40-digit sum of the exact ``-log P`` at the same
    boundaries, where most gaps are grouped. The element-by-element sum of
    log_rank_probability, which it replaced, was 4.6 eps off on average in the series' range
    (18 cases, up to 17), the grouped sum 2.0 (up to 7); with wide gaps, 1.8 (up to 5.8)
    against 1.4 (up to 6.7), 15 cases.
    """
    x = rng.normal(size=(1, n))
    if ties:
        x = np.round(x * 50) / 50
    target = np.argsort(rng.normal(size=(1, n)), axis=1) + 1
    out, xs, order, anchor, offset = _ladder_loss(x, target, alpha)
    r, inv_alpha = xs[0], 1.0 / alpha
    byrank = np.empty(n)
    byrank[target[0, order[0]] - 1] = r
    exact = mpmath.mpf(0)
    grouped = 0
    with mpmath.workdps(40):
        for k in range(n):
            ri = byrank[k]
            z0 = _offset_z(r[anchor[0, k - 1]], ri, inv_alpha, offset[0, k - 1]) if k else -np.inf
            z1 = _offset_z(r[anchor[0, k]], ri, inv_alpha, offset[0, k]) if k < n - 1 else np.inf
            grouped += perm.PRODUCT_MIN_GAP <= z1 - z0 < perm.WIDE_GAP and (z1 <= 0 or z0 >= 0)
            if z0 == -np.inf or z1 == np.inf:
                exact -= mpmath.log(_exact(max(z0, -1e4), min(z1, 1e4))[2])
            else:
                exact -= mpmath.log(_exact(z0, z1)[2])
    assert grouped > n // 2
    assert abs(out[0] - float(exact)) <= 16 * EPS * float(exact), (out[0], float(exact))


def test_loss_of_a_constant_row():
    """Equal values: every rank has probability 1/n, the loss is n log n (the grouped logs of
    the gaps' products give it within 6 eps, 4.9 at n = 4000, where the tails' wide gaps are
    grouped too; the element-by-element sum was 38 eps off at n = 500).
    """
    for n, alpha in ((500, 0.3), (4000, 20.0), (64, 1e-3)):
        target = np.arange(1, n + 1)[None, :]
        out = _ladder_loss(np.full((1, n), 1.5), target, alpha)[0]
        want = n * math.log(n)
        assert abs(out[0] - want) <= 6 * EPS * want, (n, out[0], want)


@pytest.mark.parametrize("z0, z1", PAIRS)
def test_density_ratios_against_extended_precision(z0, z1):
    g0, g1 = _ratios(z0, z1)
    e0, e1, p = _exact(z0, z1)
    # 1 - (f(z0) + f(z1)) loses digits only when P itself is small with z0 < 0 < z1
    tol = 8 * EPS * (1.0 if (z1 <= 0.0 or z0 >= 0.0) else max(1.0, 1.0 / float(p)))
    for got, want in ((g0, e0), (g1, e1)):
        assert math.isclose(got, want, rel_tol=tol, abs_tol=1e-300), (got, want)


def test_density_ratios_limits():
    ratios = _ratios
    assert ratios(-math.inf, -2.0) == (0.0, 1.0)  # P = F(z1): f(z1)/F(z1) = 1 below 0
    assert ratios(-math.inf, 1.0)[1] == pytest.approx(0.5 * math.exp(-1) / (1 - 0.5 * math.exp(-1)))
    assert ratios(2.0, math.inf) == (1.0, 0.0)
    assert ratios(-math.inf, math.inf) == (0.0, 0.0)
    assert ratios(1.5, 1.5) == (math.inf, math.inf)  # P = 0, as exp(log f - log 0) gives
    assert _log_p(1.5, 1.5) == -math.inf
    assert _log_p(-math.inf, math.inf) == 0.0
    assert _log_p(-math.inf, -2.0) == math.log(0.5) - 2.0


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_loss_gradient_far_from_the_boundaries(rng, scale):
    """Elements far from their target's boundaries (the ratios' tails, and at scale 300 the
    overflow of expm1), against finite differences and the brute-force loss.
    """
    rows, n, alpha = 3, 9, 0.7
    x = rng.normal(size=(rows, n)) * scale
    target = np.stack([rng.permutation(n) + 1 for _ in range(rows)])
    loss, pullback = so.vjp(so.permutation_cross_entropy, x, target, alpha, reduction="none")
    assert np.all(np.isfinite(loss))
    if scale == 1.0:  # (the brute force's P underflows at scale 300)
        expected = [naive.permutation_cross_entropy_row(x[i], target[i], alpha) for i in range(3)]
        np.testing.assert_allclose(loss, expected, rtol=1e-10)
    x_bar, alpha_bar = pullback(np.ones(rows))
    direction = rng.normal(size=(rows, n))

    def f(y):
        return so.permutation_cross_entropy(y, target, alpha, reduction="none")

    numeric = naive.central_difference(f, x, direction, eps=1e-6 * scale)
    np.testing.assert_allclose((x_bar * direction).sum(axis=1), numeric, rtol=1e-6, atol=1e-8)
    numeric_alpha = naive.central_difference(
        lambda a: so.permutation_cross_entropy(x, target, a, reduction="sum"), alpha, 1.0, 1e-7
    )
    np.testing.assert_allclose(alpha_bar, numeric_alpha, rtol=1e-6)


def test_loss_gradient_with_infinite_entries(rng):
    """Infinite entries at the ends of the target get a zero gradient; the others match finite
    differences.
    """
    n, alpha = 8, 0.5
    x = rng.normal(size=n)
    x[[1, 5]] = [np.inf, -np.inf]
    target = np.empty(n, dtype=np.int64)
    target[[5, 1]] = [1, n]  # where the infinities go (elsewhere P = 0 and the loss is inf)
    target[[0, 2, 3, 4, 6, 7]] = rng.permutation(n - 2) + 2
    loss, pullback = so.vjp(so.permutation_cross_entropy, x, target, alpha)
    assert np.isfinite(loss)
    x_bar, alpha_bar = pullback(1.0)
    assert x_bar[1] == 0.0 and x_bar[5] == 0.0 and np.isfinite(alpha_bar)
    direction = rng.normal(size=n)
    direction[[1, 5]] = 0.0
    numeric = naive.central_difference(
        lambda y: so.permutation_cross_entropy(y, target, alpha), x, direction
    )
    np.testing.assert_allclose(x_bar @ direction, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("nan_row", [False, True])
def test_repeated_ranks_refused_by_the_forward(rng, nan_row, monkeypatch):
    """The CPU forward checks the permutations as it places the values by rank: a repeated
    rank raises the error that names its row from every entry point, a row with NaN (whose
    ranks the kernel does not read) included, without running (or compiling, seconds on a
    first call) the kernel of repeated ranks; the kernel counts the rows that repeat.
    """

    def refused(*args):
        raise AssertionError("the API ran the kernel of repeated ranks it refuses")

    monkeypatch.setattr(perm, "_ladder_forward_repeated", refused)
    n = 300
    x = rng.normal(size=(3, n))
    ranks = np.stack([rng.permutation(n) + 1 for _ in range(3)])
    ranks[1, 7] = ranks[1, 8]
    if nan_row:
        x[1, 3] = np.nan
    message = rf"target_ranks must be a permutation of 1\.\.{n} .*row \(1,\) repeats rank"
    with pytest.raises(ValueError, match=message):
        so.permutation_cross_entropy(x, ranks, 0.5)
    with pytest.raises(ValueError, match=message):
        so.vjp(so.permutation_cross_entropy, x, ranks, 0.5)
    with pytest.raises(ValueError, match=message):
        so.jvp(so.permutation_cross_entropy, (x, ranks, 0.5), (x, None, 0.0))
    # in a batch, the row's index in the batch
    with pytest.raises(ValueError, match=r"row \(0, 1\) repeats rank"):
        so.permutation_cross_entropy(x.reshape(1, 3, n), ranks.reshape(1, 3, n), 0.5)
    # the kernel computes every row all the same, and counts the one that repeats
    xs = np.sort(x, axis=1)
    order = np.argsort(x, axis=1)
    out = np.empty(3)
    anchor = np.empty((3, n - 1), np.int32)
    offset = np.empty((3, n - 1))
    work = np.empty((3, perm.LADDER_FORWARD_WORK, n))
    alpha = np.full(3, 0.5)
    monkeypatch.undo()
    repeated = perm.ladder_loss_forward(xs, order, alpha, ranks, out, anchor, offset, work)
    assert repeated == (0 if nan_row else 1)
    assert np.isfinite(out[0]) and np.isfinite(out[2])
    assert np.isnan(out[1]) == nan_row
