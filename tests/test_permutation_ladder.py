"""The permutation loss's CPU kernels that the API calls (int32 anchors, the VJP in 4 rows of
scratch: :func:`softorder.core.permutation.ladder_loss_vjp`) against the general kernels,
bit for bit: ties, infinities, NaN rows, zero and NaN cotangents, repeated target ranks, rows
whose boundaries leave the ladder path, int32 and int64 anchors.
"""

import numpy as np
import pytest

from softorder import core
from softorder.core import permutation as perm


def _case(rng, kind, rows=4, n=60):
    x = rng.normal(size=(rows, n))
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "few values":
        x = rng.integers(0, 3, size=(rows, n)).astype(float)
    elif kind == "infinite":
        x[0, :3] = np.inf
        x[1, 0] = -np.inf
        x[1, -2:] = np.inf
        x[2, 5:9] = x[2, 4]
        x[3, :] = np.inf
    elif kind == "nan":
        x[1, 3] = np.nan
    elif kind == "spread":
        x *= 1e4
    elif kind == "constant":
        x[:] = 1.5
    elif kind == "signed zeros":  # equal values of both signs: offsets and gaps of -0.0
        x[0] = rng.choice([0.0, -0.0], size=n)
        x[1] = rng.choice([0.0, -0.0, 1.0, -1.0], size=n)
        x[2] = rng.choice([0.0, -0.0, np.inf, -np.inf], size=n)
        x[3, ::2] = -0.0
    target = np.argsort(rng.normal(size=(rows, n)), axis=1) + 1
    if kind == "repeated":
        target[1, 0] = target[1, 1]
    return x, target


def _general(x, target, a, cot):
    rows, n = x.shape
    order = np.argsort(x, axis=1)
    xs = np.take_along_axis(x, order, axis=1)
    w, worder = np.arange(1.0, n), np.arange(n - 1)
    out = np.empty(rows)
    anchor, offset = np.empty((rows, n - 1), np.int64), np.empty((rows, n - 1))
    work = core.workspace(rows, perm.FORWARD_WORK, n)
    core.permutation_loss_forward(xs, order, a, target, w, worder, out, anchor, offset, work)
    x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
    core.permutation_loss_vjp(
        xs,
        order,
        a,
        target,
        anchor,
        offset,
        worder,
        cot,
        x_bar,
        alpha_bar,
        core.workspace(rows, perm.GRADIENT_WORK, n),
        core.workspace(rows, perm.LOSS_BOUNDARY_WORK, max(n - 1, 1)),
    )
    return out, anchor, offset, x_bar, alpha_bar, (xs, order)


def _ladder(xs, order, target, a, cot, anchor_dtype=np.int32):
    rows, n = xs.shape
    out = np.empty(rows)
    anchor, offset = np.empty((rows, n - 1), anchor_dtype), np.empty((rows, n - 1))
    if anchor_dtype == np.int32:
        work = core.workspace(rows, perm.LADDER_FORWARD_WORK, n)
        perm.ladder_loss_forward(xs, order, a, target, out, anchor, offset, work)
    else:  # the anchors a bridge hands back (int64), from the general forward
        w, worder = np.arange(1.0, n), np.arange(n - 1)
        work = core.workspace(rows, perm.FORWARD_WORK, n)
        core.permutation_loss_forward(xs, order, a, target, w, worder, out, anchor, offset, work)
    x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
    work = core.workspace(rows, perm.LADDER_VJP_WORK, n)
    perm.ladder_loss_vjp(xs, order, a, target, anchor, offset, cot, x_bar, alpha_bar, work)
    return out, anchor, offset, x_bar, alpha_bar


KINDS = [
    "normal",
    "ties",
    "few values",
    "infinite",
    "nan",
    "spread",
    "constant",
    "signed zeros",
    "repeated",
]


def _assert_same_bits(got, expected):
    """Equal arrays: integers (int32 or int64 anchors) by value, floats bit for bit (signed
    zeros and NaN payloads included).
    """
    got, expected = np.asarray(got), np.asarray(expected)
    if expected.dtype.kind in "iu":
        np.testing.assert_array_equal(got, expected)
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha", [1e-3, 0.3, 20.0])
def test_ladder_kernels_match_the_general_ones_bitwise(rng, kind, alpha):
    x, target = _case(rng, kind)
    rows = x.shape[0]
    a = np.full(rows, alpha)
    cot = rng.normal(size=rows)
    cot[0] = 0.0  # a zero cotangent: every boundary's cotangent is 0, no injection at all
    expected = _general(x, target, a, cot)
    xs, order = expected[-1]
    for anchor_dtype in (np.int32, np.int64):
        got = _ladder(xs, order, target, a, cot, anchor_dtype=anchor_dtype)
        for g, e in zip(got, expected[:-1], strict=True):
            _assert_same_bits(g, e)


def test_ladder_vjp_nan_cotangent_and_short_rows(rng):
    for n in (1, 2, 3, 17):
        x, target = _case(rng, "normal", rows=2, n=n)
        a = np.full(2, 0.5)
        cot = np.array([np.nan, 1.0])
        expected = _general(x, target, a, cot)
        xs, order = expected[-1]
        got = _ladder(xs, order, target, a, cot)
        for g, e in zip(got, expected[:-1], strict=True):
            np.testing.assert_array_equal(g, e)


def test_ladder_vjp_falls_back_on_boundaries_out_of_order(rng):
    """Boundaries whose anchors step back (never solved so: made by hand) leave the ladder
    path; the general path then gives the general kernel's values.
    """
    x, target = _case(rng, "normal", rows=2, n=40)
    a = np.full(2, 0.3)
    cot = np.ones(2)
    _, anchor, offset, _, _, (xs, order) = _general(x, target, a, cot)
    anchor[0, 20:] = anchor[0, ::-1][20:]
    offset[0, 20:] = offset[0, ::-1][20:]
    rows, n = xs.shape
    expected = [np.empty((rows, n)), np.empty(rows)]
    core.permutation_loss_vjp(
        xs,
        order,
        a,
        target,
        anchor,
        offset,
        np.arange(n - 1),
        cot,
        *expected,
        core.workspace(rows, perm.GRADIENT_WORK, n),
        core.workspace(rows, perm.LOSS_BOUNDARY_WORK, n - 1),
    )
    got = [np.empty((rows, n)), np.empty(rows)]
    work = core.workspace(rows, perm.LADDER_VJP_WORK, n)
    perm.ladder_loss_vjp(xs, order, a, target, anchor.astype(np.int32), offset, cot, *got, work)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)


def test_ladder_vjp_signed_zeros_bitwise():
    """Rows of signed zeros (with ones and infinities) on 20 seeds: equal values of both
    signs, where ``ra - ri`` is ``-0.0`` and offset_z's gap ``+0.0`` (about 1 in 1000 of the
    distances the VJP reads), so a kernel that computed its distances without offset_z's
    branch would be checked here; every output has the general kernel's bits.
    """
    for seed in range(20):
        rng = np.random.default_rng(seed)
        for alpha in (1e-3, 0.3, 20.0):
            x, target = _case(rng, "signed zeros")
            a = np.full(x.shape[0], alpha)
            cot = rng.normal(size=x.shape[0])
            expected = _general(x, target, a, cot)
            xs, order = expected[-1]
            got = _ladder(xs, order, target, a, cot)
            for g, e in zip(got, expected[:-1], strict=True):
                _assert_same_bits(g, e)


def _loss_by_rank_unblocked(r, inv_alpha, anchor, offset, byrank):
    """:func:`softorder.core.permutation._loss_by_rank` rank by rank, without its blocks: the
    reference its blocks keep to the bit.
    """
    n = r.shape[0]
    loss = 0.0
    logs = 0.0
    product = 1.0
    count = 0
    t_lo = 0.0
    ra_lo = 0.0
    for k in range(n):
        ri = byrank[k]
        z0 = perm.offset_z(ra_lo, ri, inv_alpha, t_lo) if k > 0 else -np.inf
        z1 = np.inf
        if k < n - 1:
            t_lo = offset[k]
            ra_lo = r[anchor[k]]
            z1 = perm.offset_z(ra_lo, ri, inv_alpha, t_lo)
        d = z1 - z0
        one_side = z1 <= 0.0 or z0 >= 0.0
        near = z1 if z1 <= 0.0 else -z0
        if perm.PRODUCT_MIN_GAP <= d < perm.SERIES_GAP and one_side:
            loss -= (perm.LOG_HALF + near) + (perm._log1mexp_even(d) - 0.5 * d)
            factor = d
        elif perm.SERIES_GAP <= d < perm.WIDE_GAP and one_side:  # log(1 - exp(-d)) grouped
            loss -= perm.LOG_HALF + near
            factor = 1.0 - np.exp(-d)
        else:
            loss -= perm.log_rank_probability(z0, z1)
            continue
        product *= factor
        count += 1
        if count == perm.LOG_GROUP:
            logs += np.log(product)
            product = 1.0
            count = 0
    return loss - (logs + np.log(product))


@pytest.mark.parametrize("kind", ["normal", "ties", "far", "signed zeros"])
@pytest.mark.parametrize("n", [63, 64, 65, 200])
@pytest.mark.parametrize("targets", ["random", "true", "near"])
def test_ladder_blocks_match_bitwise(rng, kind, n, targets):
    """Rows of several blocks of TBLOCK ranks (and a short last one): the VJP's usual ranks
    and boundaries computed ahead, the others (row ends, elements between their boundaries:
    the true ranks, far gaps: factors outside exp_main's range or below its underflow,
    ties, infinities) rank by rank; the VJP has the general kernel's bits, the loss those of
    the unblocked rank-by-rank sum.
    """
    import numba

    assert core.sort.TBLOCK == 64
    rows = 4
    x, target = _case(rng, "normal", rows=rows, n=n)
    if kind == "ties":
        x = np.round(x * 4) / 4
        x[3, : n // 3] = np.inf
    elif kind == "far":
        x[0] = np.arange(n) * 600.0 * 0.3  # exp(-600): outside exp_main's range, above 0
        x[1] = np.arange(n) * 800.0 * 0.3  # exp(-800): 0
        x[2, ::5] *= 1e6
    elif kind == "signed zeros":
        x = rng.choice([0.0, -0.0, 1.0, -1.0, np.inf], size=(rows, n))
    if targets == "true":  # each element between its two boundaries
        target = np.argsort(np.argsort(x, axis=1, kind="stable"), axis=1) + 1
    elif targets == "near":
        noisy = x + rng.normal(size=x.shape) * 0.3
        target = np.argsort(np.argsort(noisy, axis=1, kind="stable"), axis=1) + 1
    a = np.array([0.3, 1e-3, 0.3, 20.0])
    cot = rng.normal(size=rows)
    expected = _general(x, target, a, cot)
    xs, order = expected[-1]
    got = _ladder(xs, order, target, a, cot)
    for g, e in zip(got, expected[:-1], strict=True):
        _assert_same_bits(g, e)
    reference = numba.njit(_loss_by_rank_unblocked)
    _, anchor, offset, _, _ = got
    for row in range(rows):
        if np.isnan(xs[row]).any():
            continue
        byrank = np.empty(n)
        byrank[target[row][order[row]] - 1] = xs[row]
        want = reference(xs[row], 1.0 / a[row], anchor[row], offset[row], byrank)
        _assert_same_bits(got[0][row : row + 1], np.array([want]))
