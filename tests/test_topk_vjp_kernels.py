"""The top-k VJP's two kernels (issue 14: a first call compiles only the one it needs):
``_vjp_one`` (one target per row) gives what ``_vjp_several`` gives with one target, to the
bit, on rows with ties, infinities and NaN, at extreme alphas, with ``x_bar`` apart from ``v``
or ``v`` itself; ``topk_vjp`` runs the one that fits; ``_vjp_one`` refuses other counts."""

import numpy as np
import pytest

from softorder.core import topk


def _row_cases(rng):
    n = 40
    plain = rng.normal(size=n)
    ties = np.round(rng.normal(size=n) * 2) / 2
    infinite = rng.normal(size=n)
    infinite[[3, 17]] = np.inf
    infinite[25] = -np.inf
    nan = rng.normal(size=n)
    nan[5] = np.nan
    far = rng.normal(size=n) * 1e6
    return np.stack([plain, ties, infinite, nan, far])


def _forward(x, k, alpha, log):
    rows, n = x.shape
    order = np.argsort(x, axis=1, kind="stable").astype(np.int32)
    xs = np.take_along_axis(x, order, 1)
    anchor = np.empty((rows, 1), np.int64)
    offset = np.empty((rows, 1))
    topk.topk_forward(
        xs,
        order,
        np.full(rows, alpha),
        np.full((rows, 1), k),
        np.zeros((rows, 1), np.int64),
        log,
        np.empty((rows, 1, n)),
        anchor,
        offset,
        np.empty((rows, topk.FORWARD_WORK, n)),
    )
    return xs, order, anchor, offset


def _vjp(run, xs, order, alpha, anchor, offset, log, v, same):
    rows, n = xs.shape
    v = v.copy()
    x_bar = v.reshape(rows, n) if same else np.empty((rows, n))
    w_bar, alpha_bar = np.empty((rows, 1)), np.empty(rows)
    work = np.empty((rows, topk.VJP_WORK, n))
    run(xs, order, np.full(rows, alpha), anchor, offset, log, v, x_bar, w_bar, alpha_bar, work)
    return x_bar, w_bar, alpha_bar


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("alpha", [1e-8, 0.3, 1e8])
@pytest.mark.parametrize("k", [1.0, 7.5, 39.0])
@pytest.mark.parametrize("same", [False, True])
def test_one_target_kernel_matches_the_general_one(rng, log, alpha, k, same):
    x = _row_cases(rng)
    xs, order, anchor, offset = _forward(x, k, alpha, log)
    v = rng.normal(size=(x.shape[0], 1, x.shape[1]))
    v[0, 0, ::3] = 0.0  # zero cotangents take a branch of their own
    one = _vjp(topk._vjp_one, xs, order, alpha, anchor, offset, log, v, same)
    several = _vjp(topk._vjp_several, xs, order, alpha, anchor, offset, log, v, same)
    via = _vjp(topk.topk_vjp, xs, order, alpha, anchor, offset, log, v, same)
    for a, b, c in zip(one, several, via, strict=True):
        assert a.tobytes() == b.tobytes() == c.tobytes()
    assert np.isnan(one[0][3]).all() and np.isfinite(one[0][[0, 1, 4]]).all()


def test_one_target_kernel_refuses_several_targets(rng):
    x = rng.normal(size=(2, 10))
    xs = np.sort(x, axis=1)
    order = np.argsort(x, axis=1).astype(np.int32)
    anchor, offset = np.zeros((2, 2), np.int64), np.zeros((2, 2))
    args = (np.ones(2), anchor, offset, False, np.ones((2, 2, 10)), np.empty((2, 10)))
    rest = (np.empty((2, 2)), np.empty(2), np.empty((2, topk.VJP_WORK, 10)))
    with pytest.raises(ValueError, match="softorder: _vjp_one takes one target per row"):
        topk._vjp_one(xs, order, *args, *rest)
    topk.topk_vjp(xs, order, *args, *rest)  # several targets: the general kernel
    assert topk.topk_vjp.serial is topk._vjp_one.serial


def _near_rows(rng):
    """Rows whose target's nearest point carries nearly all of G for a fractional k (the other
    points 20 to 40 alphas off), next to 1e6, and with a tie at that point."""
    base = np.arange(12) * 40.0 + rng.uniform(-3.0, 3.0, 12)
    tie = base.copy()
    tie[5] = tie[4]
    return np.stack([rng.permutation(base), base + 1e6, tie, base * 0.5])


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("k", [4.5, 4.03, 0.2, 11.9])
@pytest.mark.parametrize("same", [False, True])
def test_nearest_point_terms_are_the_same_bits_in_every_kernel(rng, log, k, same):
    """The nearest point's terms formed apart (``topk.anchor_term``, below ``NEAR_SHARE_G``):
    from the terms left in the gradient's row (``_vjp_one``, ``_vjp_several``'s first target)
    or formed anew (``topk_vjp_narrow``): the same bits, zero and underflowing terms included;
    the float32 kernel's gradient is the float64 one, rounded once."""
    x = _near_rows(rng)
    xs, order, anchor, offset = _forward(x, k, 1.0, log)
    v = rng.normal(size=(x.shape[0], 1, x.shape[1]))
    v[0, 0, ::3] = 0.0
    v[1, 0, ::2] *= -1e-300  # terms that underflow to signed zeros
    one = _vjp(topk._vjp_one, xs, order, 1.0, anchor, offset, log, v, same)
    several = _vjp(topk._vjp_several, xs, order, 1.0, anchor, offset, log, v, same)
    for a, b in zip(one, several, strict=True):
        assert a.tobytes() == b.tobytes()
    rows, n = xs.shape
    x_bar = np.empty((rows, n), np.float32)
    w_bar, alpha_bar = np.empty((rows, 1)), np.empty(rows)
    work = np.empty((rows, topk.ONE_TARGET_VJP_WORK, n))
    args = (xs, order, np.ones(rows), anchor, offset, log, v, x_bar, w_bar, alpha_bar, work)
    topk.topk_vjp_narrow(*args)
    assert x_bar.tobytes() == one[0].astype(np.float32).tobytes()
    assert w_bar.tobytes() == one[1].tobytes() and alpha_bar.tobytes() == one[2].tobytes()


def test_shift_and_nearest_is_the_smallest_distance_and_its_point(rng):
    """``topk.shift_and_nearest`` (the VJP kernels' one helper for both) at solved targets:
    ``min_i |z_i|`` over the row, brute force, and a point at that distance, the one
    ``nearest_point`` gives; ``(inf, -1)`` for a target at infinite distance."""
    import numba

    both = numba.njit(lambda r, inv_alpha, a, t: topk.shift_and_nearest(r, inv_alpha, a, t))
    nearest = numba.njit(lambda r, inv_alpha, a, t: topk.nearest_point(r, inv_alpha, a, t))
    offset_z = numba.njit(lambda ra, ri, inv_alpha, t: topk.offset_z(ra, ri, inv_alpha, t))
    x = _row_cases(rng)
    checked = 0
    for k in (0.2, 4.5, 11.9, 20.0, 39.7):
        for alpha in (1.0, 1e-3, 1e3):
            xs, _, anchor, offset = _forward(x, k, alpha, False)
            for r, a, t in zip(xs, anchor[:, 0], offset[:, 0], strict=True):
                if np.isnan(r[-1]):
                    continue
                a, t = int(a), float(t)
                z = np.array([abs(offset_z(r[a], ri, 1.0 / alpha, t)) for ri in r])
                shift, near = both(r, 1.0 / alpha, a, t)
                assert shift == z.min() and near == nearest(r, 1.0 / alpha, a, t)
                assert near == -1 if shift == np.inf else z[near] == shift
                checked += near >= 0
    assert checked > 40
