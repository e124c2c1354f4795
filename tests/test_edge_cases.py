"""The edge cases: separated values, ties, tiny rows, extreme alpha and values, NaN and inf,
non-contiguous input, every axis, untouched inputs."""

import numpy as np
import pytest
from scipy.stats import rankdata

import softorder as so
from tests import naive

# Each operation with its arguments after x; OPS[name](x, **kwargs) calls it.
OP_ARGS = {
    "topk": (so.soft_topk, (2.0, 0.5)),
    "log_topk": (so.log_soft_topk, (2.0, 0.5)),
    "rank": (so.soft_rank, (0.5,)),
    "sort": (so.soft_sort, (0.5,)),
    "quantile": (so.soft_quantile, (0.3, 0.5)),
    "permutation": (so.soft_permutation, (0.5,)),
}
OPS = {
    name: (lambda x, fn=fn, args=args, **kw: fn(x, *args, **kw))
    for name, (fn, args) in OP_ARGS.items()
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_integer_k_with_values_far_apart(dtype):
    """The log-space pitfall: gaps of 1000 alpha make exp(-gap/alpha) underflow."""
    alpha = 0.01
    x = (np.arange(8) * 1000 * alpha).astype(dtype)[::-1].copy()
    for k in range(1, 8):
        p = so.soft_topk(x, k, alpha)
        assert np.all(np.isfinite(p))
        # exact 0/1 up to the true tail F(-500) = 3.6e-218 (0 in float32)
        np.testing.assert_allclose(p, (np.arange(8) < k).astype(dtype), rtol=0, atol=1e-200)
        assert p.sum(dtype=np.float64) == k
        logp = so.log_soft_topk(x, k, alpha)
        assert np.all(np.isfinite(logp))
        # the threshold sits exactly halfway between the k-th and (k+1)-th largest
        b = so.soft_quantile(x.astype(np.float64), (8 - k) / 8, alpha)
        np.testing.assert_allclose(b, (x[k - 1] + x[k]) / 2, rtol=1e-12)
        _, pullback = so.vjp(so.soft_topk, x, float(k), alpha)
        for grad in pullback(np.arange(8.0)):
            assert np.all(np.isfinite(grad))
        _, pullback = so.vjp(so.log_soft_topk, x, float(k), alpha)
        x_bar, k_bar, alpha_bar = pullback(np.ones(8))
        assert np.all(np.isfinite(x_bar)) and np.isfinite(alpha_bar)


def test_gradients_of_separated_values_stay_finite():
    x = np.array([0.0, 1500.0, 3000.0, 4500.0])
    # soft_quantile(x, 0.5) sits 750 alpha from both neighbours: db/dq = 2 alpha e^750 / 2 is
    # beyond float64 and honestly reported as inf; x and alpha gradients stay finite.
    _, pullback = so.vjp(so.soft_quantile, x, 0.5, 1.0)
    x_bar, q_bar, alpha_bar = pullback(np.ones(()))
    assert np.all(np.isfinite(x_bar)) and np.isfinite(alpha_bar) and q_bar == np.inf
    for fn, args in [
        (so.soft_rank, (x, 1.0)),
        (so.soft_sort, (x, 1.0)),
        (so.soft_quantile, (x, 0.4, 1.0)),
        (so.soft_permutation, (x, 1.0)),
        (so.permutation_cross_entropy, (x, np.array([1, 2, 3, 4]), 1.0)),
    ]:
        out, pullback = so.vjp(fn, *args)
        assert np.all(np.isfinite(out))
        for grad in pullback(np.ones_like(out)):
            assert np.all(np.isfinite(grad)), fn.__name__


def _rank_jacobian(x, alpha):
    """d rank_i / d x_l, entry by entry: the Laplace density of each gap, no sums that cancel."""
    x = np.asarray(x, np.float64)
    f = 0.5 * np.exp(-np.abs(x[:, None] - x[None, :]) / alpha) / alpha
    np.fill_diagonal(f, 0.0)
    return np.diag(f.sum(1)) - f


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("spacing", [30.0, 40.0, 80.0])
def test_rank_gradient_of_separated_values_keeps_its_diagonal(spacing, dtype):
    """d rank_i / d x_i = sum_(j != i) f_ij: from the prefix sums as v_i (A_i - 1) and
    v_i (B_i - 1), formed as v_i A_i - (v_i + ...) it lost every term below v_i's last bit
    (gaps beyond about 37 alpha), leaving 0 (or a few percent off near 34 alpha) where the
    off-diagonal entries stayed exact: rows that no longer sum to 0, a gradient that moves one
    element of a pair and not the other.
    """
    x = (np.array([0.0, 1.0, 2.0, 2.5]) * spacing).astype(dtype)
    x = x[[2, 0, 3, 1]]
    alpha = 1.0
    expected = _rank_jacobian(x, alpha)
    out, pullback = so.vjp(so.soft_rank, x, alpha)
    eye = np.eye(x.size, dtype=dtype)
    by_vjp = np.array([pullback(row)[0] for row in eye], np.float64)
    by_jvp = np.array([so.jvp(so.soft_rank, (x, alpha), (col,))[1] for col in eye], np.float64).T
    rtol = 1e-12 if dtype == np.float64 else 2e-7
    tiny = np.finfo(dtype).tiny
    for got in (by_vjp, by_jvp):
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=tiny)
    # descending ranks are n + 1 - rank: the same Jacobian, negated
    _, pullback = so.vjp(so.soft_rank, x, alpha, descending=True)
    np.testing.assert_allclose(
        np.array([pullback(row)[0] for row in eye], np.float64), -expected, rtol=rtol, atol=tiny
    )


def _topk_jacobian(x, k, alpha, largest, log):
    """d p_i / d x_l and d p_i / d alpha of soft top-k (or of its log), entry by entry from the
    bisected inverse: ``g_i (g_l / G - delta_il)`` with the diagonal's ``G - g_i`` summed over
    the other elements, and ``g_i sum_l g_l (z_l - z_i) / G`` (over ``p_i`` for logs): no entry
    is a difference of nearly equal numbers.
    """
    y = -np.asarray(x, np.float64) if largest else np.asarray(x, np.float64)
    b = naive.lapsum_inverse(y, k, alpha)[0]
    z = (b - y) / alpha
    g = 0.5 * np.exp(-np.abs(z)) / alpha
    jac = g[:, None] * g[None, :] / g.sum()
    rest = np.array([np.delete(g, i).sum() for i in range(g.size)])
    np.fill_diagonal(jac, -g * rest / g.sum())
    d_alpha = g * (g[None, :] * (z[None, :] - z[:, None])).sum(1) / g.sum()
    if log:  # d log p_i = dp_i / p_i, with g_i / p_i the hazard (1 / alpha for z <= 0)
        hazard = np.where(z <= 0.0, 1.0 / alpha, g / naive.laplace_cdf(z))
        jac *= (hazard / g)[:, None]
        d_alpha *= hazard / g
    return (-jac if largest else jac), d_alpha


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("largest", [False, True])
@pytest.mark.parametrize(
    "name, x, ks, alpha",
    [
        ("soft_topk", [0.0, 40.0, 80.0], [1.5], 1.0),
        ("soft_topk", [60.0, 0.0, 30.0], [1.3], 1.0),
        ("soft_topk", [0.0, 40.0, 80.0], [1.5, 1.3, 0.2], 1.0),
        ("log_soft_topk", [47.68, 7.39, 0.79], [2.032], 0.5),
        ("log_soft_topk", [47.68, 0.79, 30.0, 7.39], [2.032, 3.5, 1.0], 0.5),
    ],
)
def test_topk_gradient_keeps_the_diagonal_of_the_nearest_element(
    name, x, ks, alpha, largest, dtype
):
    """With a fractional k and one element close to the threshold (the others far off), that
    element carries nearly all of G, and its diagonal entry ``kappa (omega - 1)`` was formed
    as ``omega phi - v kappa``, a difference of nearly equal numbers: all its bits lost, 0 or
    twice the exact value (x = [0, 40, 80], k = 1.5), rows that no longer sum to 0. Its alpha
    derivative ``kappa (Z / G - z)`` likewise (0 where it is 1e-16).
    """
    x = np.asarray(x, np.float64) * alpha
    if largest:
        x = -x
    x = x.astype(dtype)
    fn = getattr(so, name)
    log = name == "log_soft_topk"
    k = ks[0] if len(ks) == 1 else np.array(ks)
    expected = [_topk_jacobian(x, kj, alpha, largest, log) for kj in ks]
    out, pullback = so.vjp(fn, x, k, alpha, largest=largest)
    eye = np.eye(x.size, dtype=dtype)
    rtol = 1e-12 if dtype == np.float64 else 2e-7
    tiny = np.finfo(dtype).tiny
    _, alpha_dot = so.jvp(fn, (x, k, alpha), (None, None, 1.0), largest=largest)
    for j in range(len(ks)):
        v = np.zeros((len(ks), x.size), dtype) if len(ks) > 1 else None
        rows, alpha_rows = [], []
        for row in eye:
            if v is not None:
                v[:] = 0.0
                v[j] = row
            grads = pullback(row if v is None else v)
            rows.append(grads[0])
            alpha_rows.append(grads[2])
        by_vjp = np.array(rows, np.float64)
        tangents = [so.jvp(fn, (x, k, alpha), (col,), largest=largest)[1] for col in eye]
        by_jvp = np.array([t if len(ks) == 1 else t[j] for t in tangents], np.float64).T
        for got in (by_vjp, by_jvp):
            np.testing.assert_allclose(got, expected[j][0], rtol=rtol, atol=tiny)
        a_jvp = alpha_dot if len(ks) == 1 else alpha_dot[j]
        for got in (np.array(alpha_rows, np.float64), np.asarray(a_jvp, np.float64)):
            np.testing.assert_allclose(got, expected[j][1], rtol=rtol, atol=tiny)


def test_ties():
    x = np.array([1.0, 2.0, 2.0, 2.0, 5.0])
    np.testing.assert_allclose(so.soft_rank(x, 1e-9), rankdata(x), atol=1e-12)
    np.testing.assert_allclose(so.soft_rank(x, 0.7), naive.soft_rank(x, 0.7), rtol=1e-12)
    p = so.soft_topk(x, 2, 1e-9)
    np.testing.assert_allclose(p, [0, 1 / 3, 1 / 3, 1 / 3, 1], atol=1e-12)
    same = np.full(6, 3.0)
    np.testing.assert_allclose(so.soft_rank(same, 0.5), 3.5)
    np.testing.assert_allclose(so.soft_topk(same, 2, 0.5), 1 / 3)
    np.testing.assert_allclose(so.soft_permutation(same, 0.5), 1 / 6)
    np.testing.assert_allclose(so.soft_sort(same, 0.5), naive.soft_sort(same, 0.5), atol=1e-12)
    for fn, args in [
        (so.soft_rank, (same, 0.5)),
        (so.soft_sort, (same, 0.5)),
        (so.soft_topk, (same, 2.0, 0.5)),
    ]:
        out, pullback = so.vjp(fn, *args)
        assert all(np.all(np.isfinite(g)) for g in pullback(np.ones_like(out)))


def test_rows_of_one_and_two():
    x = np.array([[0.7]])
    np.testing.assert_allclose(so.soft_rank(x, 0.3), [[1.0]])
    np.testing.assert_allclose(so.soft_sort(x, 0.3), x)
    np.testing.assert_allclose(so.soft_permutation(x, 0.3), [[[1.0]]])
    np.testing.assert_allclose(so.soft_topk(x, 0.25, 0.3), [[0.25]])
    np.testing.assert_allclose(so.soft_quantile(x, 0.25, 0.3), 0.7 + 0.3 * np.log(0.5))
    assert so.permutation_cross_entropy(x, [[1]], 0.3) == 0.0
    out, pullback = so.vjp(so.soft_sort, x, 0.3)
    np.testing.assert_allclose(pullback(np.ones((1, 1)))[0], [[1.0]])
    y = np.array([2.0, -1.0])
    np.testing.assert_allclose(so.soft_rank(y, 0.4), naive.soft_rank(y, 0.4), rtol=1e-12)
    np.testing.assert_allclose(so.soft_sort(y, 0.4), naive.soft_sort(y, 0.4), atol=1e-12)
    np.testing.assert_allclose(so.soft_topk(y, 1, 0.4), naive.soft_topk(y, 1, 0.4), atol=1e-12)


@pytest.mark.parametrize("alpha", [1e-8, 1e-4, 1.0, 1e4, 1e8])
def test_alpha_over_sixteen_orders_of_magnitude(rng, alpha):
    x = rng.normal(size=(3, 20))
    ranks = so.soft_rank(x, alpha)
    np.testing.assert_allclose(ranks, np.stack([naive.soft_rank(r, alpha) for r in x]), rtol=1e-10)
    p = so.soft_topk(x, 5, alpha)
    np.testing.assert_allclose(p.sum(-1), 5.0, rtol=1e-10)
    s = so.soft_sort(x, alpha)
    np.testing.assert_allclose(
        s, np.stack([naive.soft_sort(r, alpha) for r in x]), rtol=1e-9, atol=1e-9 * alpha
    )
    if alpha <= 1e-8:
        np.testing.assert_allclose(ranks, rankdata(x, axis=1), atol=1e-12)
    if alpha >= 1e4:
        np.testing.assert_allclose(ranks, 10.5, atol=100 / alpha)
    for fn, args in [
        (so.soft_rank, (x, alpha)),
        (so.soft_topk, (x, 5.0, alpha)),
        (so.soft_sort, (x, alpha)),
    ]:
        out, pullback = so.vjp(fn, *args)
        assert all(np.all(np.isfinite(g)) for g in pullback(np.ones_like(out)))


@pytest.mark.parametrize("alpha", [1.0, 1e29])
def test_values_near_1e30(rng, alpha):
    x = rng.normal(size=12) * 1e30
    ranks = so.soft_rank(x, alpha)
    if alpha == 1.0:
        np.testing.assert_allclose(ranks, rankdata(x))
        np.testing.assert_allclose(so.soft_sort(x, alpha), np.sort(x), rtol=1e-15)
        hard = np.zeros(12)
        hard[np.argsort(-x)[:4]] = 1
        np.testing.assert_array_equal(so.soft_topk(x, 4, alpha), hard)
    else:
        np.testing.assert_allclose(ranks, naive.soft_rank(x, alpha), rtol=1e-10)
        np.testing.assert_allclose(so.soft_sort(x, alpha), naive.soft_sort(x, alpha), rtol=1e-9)
    assert np.all(np.isfinite(so.soft_permutation(x, alpha)))
    out, pullback = so.vjp(so.soft_sort, x, alpha)
    assert all(np.all(np.isfinite(g)) for g in pullback(np.ones(12)))


@pytest.mark.slow
def test_float32_at_a_million(rng):
    x = rng.normal(size=1_000_000).astype(np.float32)
    ranks = so.soft_rank(x, 0.01)
    assert ranks.dtype == np.float32
    ref = so.soft_rank(x.astype(np.float64), 0.01)
    np.testing.assert_allclose(ranks, ref.astype(np.float32), rtol=1.2e-7)
    p = so.soft_topk(x, 1000.0, 0.01)
    np.testing.assert_allclose(p.astype(np.float64).sum(), 1000.0, rtol=1e-5)
    s = so.soft_sort(x, 0.001)
    assert np.all(np.diff(s) >= 0)
    _, pullback = so.vjp(so.soft_rank, x, 0.01)
    x_bar, alpha_bar = pullback(np.ones_like(x))
    assert x_bar.dtype == np.float32 and np.all(np.isfinite(x_bar))


@pytest.mark.parametrize("name", list(OPS))
def test_a_nan_row_spoils_only_itself(rng, name):
    x = rng.normal(size=(4, 9))
    x[2, 5] = np.nan
    out = OPS[name](x)
    for i in range(4):
        alone = OPS[name](x[i : i + 1])
        if i == 2:
            assert np.all(np.isnan(out[i]))
        else:
            np.testing.assert_array_equal(out[i], alone[0])


def test_a_nan_row_in_gradients_and_losses(rng):
    x = rng.normal(size=(3, 6))
    x[1, 0] = np.nan
    for fn, args in [
        (so.soft_rank, (0.5,)),
        (so.soft_sort, (0.5,)),
        (so.soft_topk, (2.0, 0.5)),
        (so.soft_quantile, (0.5, 0.5)),
        (so.soft_permutation, (0.5,)),
    ]:
        out, pullback = so.vjp(fn, x, *args)
        x_bar = pullback(np.ones_like(out))[0]
        assert np.all(np.isnan(x_bar[1]))
        _, clean = so.vjp(fn, x[[0, 2]], *args)
        np.testing.assert_array_equal(x_bar[[0, 2]], clean(np.ones_like(out[[0, 2]]))[0])
    losses = so.topk_cross_entropy(x, np.array([0, 1, 2]), [0.5, 0.5], 0.5, reduction="none")
    assert np.isnan(losses[1]) and np.all(np.isfinite(losses[[0, 2]]))
    losses = so.permutation_cross_entropy(
        x, np.tile(np.arange(1, 7), (3, 1)), 0.5, reduction="none"
    )
    assert np.isnan(losses[1]) and np.all(np.isfinite(losses[[0, 2]]))


def test_minus_inf_is_padding_for_largest_topk(rng):
    valid = rng.normal(size=5)
    x = np.concatenate([valid, [-np.inf, -np.inf]])
    for k in [1, 2.5, 4]:
        p = so.soft_topk(x, k, 0.3)
        np.testing.assert_array_equal(p[5:], 0.0)
        np.testing.assert_allclose(p[:5], so.soft_topk(valid, k, 0.3), rtol=1e-14)
        out, pullback = so.vjp(so.soft_topk, x, k, 0.3)
        x_bar, k_bar, alpha_bar = pullback(np.arange(7.0))
        np.testing.assert_array_equal(x_bar[5:], 0.0)
        _, ref = so.vjp(so.soft_topk, valid, k, 0.3)
        ref_x, ref_k, ref_alpha = ref(np.arange(5.0))
        np.testing.assert_allclose(x_bar[:5], ref_x, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose([k_bar, alpha_bar], [ref_k, ref_alpha], rtol=1e-12)
    # log memberships of padding are -inf, with zero gradient
    logp = so.log_soft_topk(x, 2, 0.3)
    assert np.all(logp[5:] == -np.inf) and np.all(np.isfinite(logp[:5]))
    # +inf entries are always selected; the rest share k - (number of +inf)
    y = np.concatenate([valid, [np.inf]])
    p = so.soft_topk(y, 3, 0.3)
    assert p[5] == 1.0
    np.testing.assert_allclose(p[:5], so.soft_topk(valid, 2, 0.3), rtol=1e-14)


def test_infinities_in_rank_sort_and_losses(rng):
    valid = rng.normal(size=4)
    x = np.concatenate([[-np.inf], valid, [np.inf, np.inf]])
    ranks = so.soft_rank(x, 0.5)
    np.testing.assert_allclose(ranks, [1.0, *(so.soft_rank(valid, 0.5) + 1), 6.5, 6.5])
    s = so.soft_sort(x, 0.5)
    assert s[0] == -np.inf and s[-1] == np.inf and np.all(np.isfinite(s[1:5]))
    logits = np.concatenate([valid, [-np.inf, -np.inf]])[None, :]
    masked = so.topk_cross_entropy(logits, [1], [0.5, 0.5], 0.5)
    np.testing.assert_allclose(
        masked, so.topk_cross_entropy(valid[None], [1], [0.5, 0.5], 0.5), rtol=1e-13
    )
    _, pullback = so.vjp(so.topk_cross_entropy, logits, [1], [0.5, 0.5], 0.5)
    grad = pullback(1.0)[0]
    np.testing.assert_array_equal(grad[0, 4:], 0.0)


@pytest.mark.parametrize("descending", [False, True])
def test_permutation_jvp_of_three_or_more_equal_infinities(rng, descending):
    """A block of >= 3 equal infinities has constant entries of P (1/3 here, for any alpha),
    so their tangent is 0, as the VJP has it; the JVP gave +-0.135 in alpha (a block of two
    hides it: its middle boundary sits at z = 0). Large finite values give the same limit."""
    x = np.array([-np.inf, -np.inf, -np.inf, 0.3, 1.0, np.inf, np.inf, np.inf])
    stand_in = np.where(np.isinf(x), np.sign(x) * 1e6, x)
    x_dot = np.where(np.isinf(x), 0.0, rng.normal(size=8))
    V = rng.normal(size=(8, 8))
    for alpha_dot in [1.0, 0.0]:
        P, P_dot = so.jvp(so.soft_permutation, (x, 0.7), (x_dot, alpha_dot), descending=descending)
        _, limit = so.jvp(
            so.soft_permutation, (stand_in, 0.7), (x_dot, alpha_dot), descending=descending
        )
        np.testing.assert_array_equal(P_dot[:, np.isinf(x)], 0.0)
        np.testing.assert_allclose(P_dot, limit, rtol=0, atol=1e-15)
        x_bar, alpha_bar = so.vjp(so.soft_permutation, x, 0.7, descending=descending)[1](V)
        np.testing.assert_allclose(
            np.sum(V * P_dot), x_bar @ x_dot + alpha_bar * alpha_dot, rtol=1e-13
        )


def test_non_contiguous_input(rng):
    base = rng.normal(size=(6, 20))
    views = [base[:, ::2], base.T[::3], base[::-1, 5:15]]
    for view in views:
        assert not view.flags.c_contiguous
        for name, op in OPS.items():
            np.testing.assert_array_equal(op(view), op(np.ascontiguousarray(view)), err_msg=name)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
@pytest.mark.parametrize("name", list(OPS))
def test_every_axis(rng, axis, name):
    x = rng.normal(size=(3, 4, 5))
    got = OPS[name](x, axis=axis)
    moved = OPS[name](np.moveaxis(x, axis, -1))
    if name == "quantile":
        expected = moved  # the axis is reduced
    elif name == "permutation":
        expected = moved  # the two matrix axes go last
    else:
        expected = np.moveaxis(moved, -1, axis)
    np.testing.assert_array_equal(got, expected)


def test_several_k_per_row_on_any_axis(rng):
    x = rng.normal(size=(5, 3))
    p = so.soft_topk(x, np.array([[1.0, 2.0, 4.0]]), 0.5, axis=0)
    assert p.shape == (3, 5, 3)  # k axis inserted before the selected axis
    for j, k in enumerate([1.0, 2.0, 4.0]):
        np.testing.assert_allclose(p[j], so.soft_topk(x, k, 0.5, axis=0), rtol=1e-14)
    per_row = so.soft_topk(x, np.array([1.0, 2.0, 4.0]), 0.5, axis=0)
    for col, k in enumerate([1.0, 2.0, 4.0]):
        np.testing.assert_allclose(per_row[:, col], so.soft_topk(x[:, col], k, 0.5), rtol=1e-14)
    q = so.soft_quantile(x, np.array([[0.2, 0.8]]), 0.5, axis=0)
    assert q.shape == (2, 3)


def test_inputs_are_never_modified(rng):
    x = rng.normal(size=(3, 6))
    x.flags.writeable = False
    k = np.array([1.0, 2.0, 3.0])
    k.flags.writeable = False
    for fn, args in [
        (so.soft_topk, (x, k, 0.5)),
        (so.log_soft_topk, (x, k, 0.5)),
        (so.soft_rank, (x, 0.5)),
        (so.soft_sort, (x, 0.5)),
        (so.soft_quantile, (x, 0.5, 0.5)),
        (so.soft_permutation, (x, 0.5)),
    ]:
        out, pullback = so.vjp(fn, *args)
        cot = np.ones_like(out)
        cot.flags.writeable = False
        pullback(cot)
    labels = np.array([0, 1, 2])
    labels.flags.writeable = False
    so.topk_cross_entropy(x, labels, [0.5, 0.5], 0.5)
    copy = x.copy()
    writable = x.copy()
    so.soft_topk(writable, 2, 0.5, largest=True)
    so.soft_sort(writable, 0.5, descending=True)
    np.testing.assert_array_equal(writable, copy)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: so.soft_rank([1.0, 2.0], 0.0), ValueError, r"alpha.*alpha=0\.0"),
        (lambda: so.soft_rank([1.0, 2.0], -1.0), ValueError, "alpha=-1.0"),
        (lambda: so.soft_rank([1.0, 2.0], np.nan), ValueError, "alpha=nan"),
        (lambda: so.soft_rank([1.0, 2.0], np.inf), ValueError, "alpha=inf"),
        (lambda: so.soft_rank([1.0, 2.0], [0.5, 0.5]), ValueError, "alpha of shape .2,. does not"),
        (lambda: so.soft_rank(np.ones((3, 2)), [0.5, 0.5]), ValueError, "batch shape .3,."),
        (lambda: so.soft_rank([1.0, 2.0], "0.5"), TypeError, "alpha"),
        (lambda: so.soft_rank(np.ones((2, 3)), [0.5, -1.0]), ValueError, "alpha=-1.0"),
        (lambda: so.soft_rank([1.0, 2.0], True), TypeError, "alpha"),
        (lambda: so.soft_topk([1.0, 2.0, 3.0], 0, 0.5), ValueError, r"k must lie.*n=3"),
        (lambda: so.soft_topk([1.0, 2.0, 3.0], 3, 0.5), ValueError, r"k must lie.*got 3"),
        (lambda: so.soft_topk([1.0, 2.0, 3.0], np.nan, 0.5), ValueError, "k must lie"),
        (lambda: so.soft_topk(np.ones((2, 3)), [1, 2, 1], 0.5), ValueError, "trailing axis"),
        (lambda: so.soft_quantile([1.0, 2.0], 1.0, 0.5), ValueError, "q must lie"),
        (lambda: so.soft_quantile([1.0, 2.0], 0.0, 0.5), ValueError, "q must lie"),
        (lambda: so.soft_rank(np.ones((2, 0)), 0.5), ValueError, "empty axis"),
        (lambda: so.soft_rank(3.0, 0.5), ValueError, "at least one axis"),
        (lambda: so.soft_rank([1.0, 2.0], 0.5, axis=1), ValueError, "axis 1 is out of range"),
        (lambda: so.soft_rank([1 + 2j, 3j], 0.5), TypeError, "complex"),
        (lambda: so.soft_rank(["a", "b"], 0.5), TypeError, "numeric"),
        (
            lambda: so.topk_cross_entropy(np.ones((2, 4)), [0, 4], [1.0], 0.5),
            ValueError,
            r"labels must lie in \[0, 3\]",
        ),
        (
            lambda: so.topk_cross_entropy(np.ones((2, 4)), [0.0, 1.0], [1.0], 0.5),
            TypeError,
            "labels must be an integer",
        ),
        (
            lambda: so.topk_cross_entropy(np.ones((2, 4)), [0, 1, 2], [1.0], 0.5),
            ValueError,
            r"labels must have shape \(2,\)",
        ),
        (
            lambda: so.topk_cross_entropy(np.ones((2, 4)), [0, 1], [0.5, 0.2], 0.5),
            ValueError,
            "probability distribution",
        ),
        (
            lambda: so.topk_cross_entropy(np.ones((2, 4)), [0, 1], [0.25] * 4, 0.5),
            ValueError,
            "K=4",
        ),
        (
            lambda: so.topk_cross_entropy(np.ones((2, 4)), [0, 1], [1.0], 0.5, reduction="max"),
            ValueError,
            "reduction",
        ),
        (
            lambda: so.permutation_cross_entropy(np.ones((1, 3)), [[1, 2, 4]], 0.5),
            ValueError,
            r"target_ranks must lie in \[1, 3\]",
        ),
        (
            lambda: so.permutation_cross_entropy(np.ones((1, 3)), [[1, 2]], 0.5),
            ValueError,
            "target_ranks must have shape",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("gap", [600.0, 640.0, 644.7, 650.0, 700.0, 5000.0])
def test_inverse_is_continuous_across_the_log_space_switch(gap):
    """The closed form switches to log space when exp(-gap/alpha) < 1e-280 (gap ~ 644.7 alpha)."""
    x = np.array([0.0, gap, 2 * gap])
    # integer targets sit at midpoints; non-integer ones at the analytic tail offsets
    np.testing.assert_allclose(
        so.soft_quantile(x, np.array([1 / 3, 2 / 3]), 1.0), [gap / 2, 3 * gap / 2], rtol=1e-14
    )
    b = so.soft_quantile(x, 1.25 / 3, 1.0)  # w = 1.25: a quarter above the 2nd point's S
    # S(b) = 1.25 with b just below x[1]: 1 + 0.5 exp((b - gap)) (other terms < e^-300)
    np.testing.assert_allclose(b, gap + np.log(0.5), rtol=1e-14)


def test_log_topk_k_gradient_for_well_separated_values():
    """d log p / dk is finite for the element below the threshold even when db/dk overflows."""
    for gap in [1500.0, 5000.0]:
        x = np.array([0.0, gap])
        _, pullback = so.vjp(so.log_soft_topk, x, 1.0, 1.0)
        np.testing.assert_allclose(pullback(np.array([0.0, 1.0]))[1], 0.5)
        assert pullback(np.zeros(2))[1] == 0.0
        _, dot = so.jvp(so.log_soft_topk, (x, 1.0, 1.0), (None, 1.0, None))
        assert dot[0] == np.inf and np.isclose(dot[1], 0.5)
    # a separated row does not spoil k_bar of the batch when its cotangent is 0
    _, pullback = so.vjp(so.log_soft_topk, np.array([[0.0, 2000.0], [0.0, 1.0]]), 1.0, 1.0)
    assert np.isfinite(pullback(np.array([[0.0, 0.0], [1.0, 1.0]]))[1])


def test_topk_cross_entropy_of_an_unselectable_label_is_infinite():
    masked = np.array([[2.0, 1.0, -np.inf, 0.5]])
    assert so.topk_cross_entropy(masked, [2], [0.5, 0.5], 0.5) == np.inf
    forced = np.array([[np.inf, np.inf, 1.0, 0.0]])
    assert so.topk_cross_entropy(forced, [2], [0.5, 0.5], 0.5) == np.inf
    # ... while a label among forced (+inf) logits costs only its share
    assert so.topk_cross_entropy(forced, [0], [0.0, 1.0], 0.5) == 0.0
    # and the softmax part of the split form takes the limit too
    np.testing.assert_allclose(
        so.topk_cross_entropy(forced, [0], [1.0], 0.5, split_top1=True), np.log(2)
    )
    assert so.topk_cross_entropy(forced, [2], [1.0], 0.5, split_top1=True) == np.inf


@pytest.mark.parametrize("name", list(OPS))
def test_an_empty_batch(name):
    x = np.empty((0, 5))
    assert OPS[name](x).size == 0
    fn, args = OP_ARGS[name]
    out, pullback = so.vjp(fn, x, *args)
    x_bar, *rest = pullback(np.zeros(out.shape))
    assert x_bar.shape == (0, 5)
    for grad in rest:  # scalar k, q and alpha: sums over no rows
        assert grad == 0.0


def test_losses_of_an_empty_batch():
    logits = np.empty((0, 4))
    labels = np.empty(0, dtype=int)
    assert np.isnan(so.topk_cross_entropy(logits, labels, [1.0], 0.5))
    assert so.topk_cross_entropy(logits, labels, [1.0], 0.5, reduction="sum") == 0.0
    _, pullback = so.vjp(so.topk_cross_entropy, logits, labels, [1.0], 0.5)
    assert pullback(1.0)[0].shape == (0, 4)
    ranks = np.empty((0, 4), dtype=int)
    _, pullback = so.vjp(so.permutation_cross_entropy, logits, ranks, 0.5)
    assert pullback(1.0)[0].shape == (0, 4)


@pytest.mark.parametrize("fn", [so.soft_topk, so.log_soft_topk])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("shape, k_shape", [((1000,), (0,)), ((3, 9), (3, 0)), ((3, 9), (1, 0))])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_an_empty_k_gives_empty_memberships_and_zero_gradients(fn, largest, shape, k_shape, dtype):
    """No targets: an empty result, zero gradients, an empty tangent (the kernels, which take
    one target or more, are not called).
    """
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    k = np.zeros(k_shape)
    out, pullback = so.vjp(fn, x, k, 0.5, largest=largest)
    assert out.shape == shape[:-1] + (0, shape[-1]) and out.dtype == dtype
    x_bar, k_bar, alpha_bar = pullback(np.ones(out.shape, dtype))
    assert x_bar.shape == shape and x_bar.dtype == dtype and not x_bar.any()
    assert k_bar.shape == k_shape and alpha_bar == 0.0
    _, tangent = so.jvp(fn, (x, k, 0.5), (np.ones_like(x), None, 1.0), largest=largest)
    assert tangent.shape == out.shape


@pytest.mark.parametrize("tiny", [1e-300, 1e-310, 1e-320, 5e-324])
def test_subnormal_k_and_q_keep_their_precision(tiny):
    """A target beyond every value, where each Laplace CDF is its exponential tail: the top-k
    threshold has ``log p_i = log k + x_i / alpha - logsumexp(x / alpha)``, the quantile is
    ``alpha (log(2 q n) - logsumexp(-x / alpha))``. For a tiny ``k`` or ``q`` the ratio the
    solver takes the log of is subnormal, which keeps few bits."""
    x, alpha = np.array([0.3, -1.2, 2.0, 0.7]), 0.5
    expected = np.log(tiny) + x / alpha - np.logaddexp.reduce(x / alpha)
    np.testing.assert_allclose(so.log_soft_topk(x, tiny, alpha), expected, rtol=1e-14)
    quantile = alpha * (np.log(2 * tiny * x.size) - np.logaddexp.reduce(-x / alpha))
    np.testing.assert_allclose(so.soft_quantile(x, tiny, alpha), quantile, rtol=1e-14)


def test_tied_values_get_bitwise_identical_ranks():
    x = np.array([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
    for alpha in np.linspace(0.05, 3.0, 60):
        r = so.soft_rank(x, alpha)
        assert r[0] == r[1] == r[3] and r[4] == r[5]


def test_gradients_stay_finite_when_alpha_is_below_the_float_spacing():
    x = 1e16 + np.arange(10.0)  # spacing 2, alpha 1e-3: targets round onto points
    for fn, args in [(so.soft_quantile, (0.3,)), (so.soft_sort, ()), (so.soft_topk, (3.0,))]:
        out, pullback = so.vjp(fn, x, *args, 1e-3)
        grads = pullback(np.ones_like(out))
        x_bar, alpha_bar = grads[0], grads[-1]  # (d/dk, d/dq are truly beyond float64 here)
        assert np.all(np.isfinite(x_bar)) and np.isfinite(alpha_bar), fn.__name__


def test_subnormal_alpha_is_rejected():
    with pytest.raises(ValueError, match="alpha must be at least"):
        so.soft_rank([1.0, 1.0, 2.0], 1e-310)


@pytest.mark.parametrize("name", ["topk", "rank", "sort", "quantile"])
def test_parallel_batches_equal_rows_computed_alone(rng, name):
    """64 x 600 runs the kernels in parallel (the bridges turn that off when imported: turn it
    on here); each row must equal its serial computation, and so must a serial batch."""
    from softorder import core

    x = rng.normal(size=(64, 600))
    x[5, 7] = np.nan
    previous = core.set_parallel(True)
    try:
        batch = OPS[name](x)
        core.set_parallel(False)
        serial = OPS[name](x)
    finally:
        core.set_parallel(previous)
    np.testing.assert_array_equal(batch, serial)
    for i in [0, 5, 31, 63]:
        alone = OPS[name](x[i : i + 1])[0]
        np.testing.assert_array_equal(batch[i], alone)


def test_log_topk_k_gradient_cancels_instead_of_inf_minus_inf():
    x = np.array([0.0, 2000.0, 4000.0])
    _, pullback = so.vjp(so.log_soft_topk, x, 1.0, 1.0)
    assert pullback(np.array([1.0, -1.0, 0.0]))[1] == 0.0
    np.testing.assert_allclose(pullback(np.array([1.0, -1.0, 1.0]))[1], 0.5)
    assert pullback(np.array([1.0, 1.0, 0.0]))[1] == np.inf  # truly beyond float64


def test_gradients_use_exact_offsets_next_to_huge_values(rng):
    """Shifting x by 1e16 (exactly representable here) must not change the gradients."""
    base = rng.permutation(2.0 * np.arange(10))
    for fn, args in [(so.soft_sort, ()), (so.soft_quantile, (0.35,)), (so.soft_permutation, ())]:
        out, pullback = so.vjp(fn, base + 1e16, *args, 3.0)
        ref_out, ref_pullback = so.vjp(fn, base, *args, 3.0)
        u = rng.normal(size=np.shape(out))
        np.testing.assert_allclose(pullback(u)[0], ref_pullback(u)[0], rtol=1e-9, atol=1e-12)
    logits = base[None] + 1e16
    _, pullback = so.vjp(so.topk_cross_entropy, logits, [3], [0.5, 0.5], 3.0)
    _, ref = so.vjp(so.topk_cross_entropy, base[None], [3], [0.5, 0.5], 3.0)
    np.testing.assert_allclose(pullback(1.0)[0], ref(1.0)[0], rtol=1e-9, atol=1e-12)


def test_an_infinite_split_loss_has_zero_gradient():
    logits = np.array([[5.0, -np.inf, -np.inf, 1.0]])
    loss, pullback = so.vjp(so.topk_cross_entropy, logits, [1], [1.0], 1.0, split_top1=True)
    assert loss == np.inf
    np.testing.assert_array_equal(pullback(1.0)[0], 0.0)


# --- arguments that used to be accepted silently (issue 12) ---------------------------------


def call_api(api, name, x, *args, **kwargs):
    """``name`` called through the NumPy API, the PyTorch bridge or the JAX bridge, with
    ``x`` and every array argument converted to the bridge's arrays.
    """
    if api == "numpy":
        return getattr(so, name)(x, *args, **kwargs)
    if api == "torch":
        torch = pytest.importorskip("torch")
        import softorder.bridges.torch as sot

        kwargs = {("dim" if key == "axis" else key): v for key, v in kwargs.items()}
        args = tuple(torch.as_tensor(a) if isinstance(a, np.ndarray) else a for a in args)
        return getattr(sot, name)(torch.as_tensor(x), *args, **kwargs)
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import softorder.bridges.jax as soj

    args = tuple(jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
    return getattr(soj, name)(jnp.asarray(x), *args, **kwargs)


LABELS = np.array([0, 1, 3])
RANKS = np.array([[1, 2, 3, 4], [4, 3, 2, 1], [2, 2, 3, 1]])  # row 2 repeats rank 2


@pytest.mark.parametrize("api", ["numpy", "torch", "jax"])
@pytest.mark.parametrize(
    ("name", "args", "kwargs", "error", "match"),
    [
        ("soft_topk", (2, 0.5), {"largest": "False"}, TypeError, "largest must be a bool"),
        ("log_soft_topk", (2, 0.5), {"largest": 0}, TypeError, "largest must be a bool"),
        ("soft_rank", (0.5,), {"descending": "no"}, TypeError, "descending must be a bool"),
        ("soft_sort", (0.5,), {"descending": 1}, TypeError, "descending must be a bool"),
        ("soft_permutation", (0.5,), {"descending": None}, TypeError, "descending must be"),
        (
            "topk_cross_entropy",
            (LABELS, [0.5, 0.5], 0.5),
            {"split_top1": "True"},
            TypeError,
            "split_top1 must be a bool",
        ),
        (
            "permutation_cross_entropy",
            (RANKS[:2], 0.5),
            {"descending": "True"},
            TypeError,
            "descending must be a bool",
        ),
        ("soft_topk", (True, 0.5), {}, TypeError, "k must be a real number .*not a bool"),
        ("soft_quantile", (True, 0.5), {}, TypeError, "q must be a real number .*not a bool"),
        ("soft_rank", (True,), {}, TypeError, "alpha must be a positive real"),
        ("topk_cross_entropy", (LABELS, [True], 0.5), {}, TypeError, "p_k must hold"),
        (
            "permutation_cross_entropy",
            (RANKS, 0.5),
            {},
            ValueError,
            r"target_ranks must be a permutation of 1\.\.4 .*row \(2,\) repeats rank 2",
        ),
        (
            "topk_cross_entropy",
            (LABELS, [0.5, 0.49995], 0.5),
            {},
            ValueError,
            r"p_k .*summing to 1 within 1e-06.*sum of 0\.9999",
        ),
        (
            "topk_cross_entropy",
            (LABELS, [0.5, 0.6], 0.5),
            {},
            ValueError,
            r"p_k .*sum of 1\.1",
        ),
        (
            "topk_cross_entropy",
            (LABELS, [1.2, -0.2], 0.5),
            {},
            ValueError,
            r"p_k .*non-negative.*got an entry -0\.2",
        ),
    ],
)
def test_arguments_once_accepted_silently_are_refused(api, name, args, kwargs, error, match):
    """The same rule, and the same message, in the NumPy API and both bridges."""
    x = np.random.default_rng(1).normal(size=(3, 4))
    with pytest.raises(error, match=match):
        call_api(api, name, x, *args, **kwargs)


def test_numpy_bools_are_flags(rng):
    x = rng.normal(size=(3, 5))
    for value in (np.True_, np.False_):
        np.testing.assert_array_equal(
            so.soft_topk(x, 2, 0.5, largest=value), so.soft_topk(x, 2, 0.5, largest=bool(value))
        )
        np.testing.assert_array_equal(
            so.soft_sort(x, 0.5, descending=value), so.soft_sort(x, 0.5, descending=bool(value))
        )


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda m: so.soft_rank(m, 0.5), "x"),
        (lambda m: so.soft_topk(np.ones(4), m[0, :1], 0.5), "k"),
        (lambda m: so.soft_quantile(np.ones(4), m[0, :1] / 4, 0.5), "q"),
        (lambda m: so.soft_rank(np.ones((2, 4)), m[:, :1]), "alpha"),
        (lambda m: so.soft_rank(np.ones(4), m[0, :1].reshape(())), "alpha"),  # 0-d, unmasked
        (lambda m: so.topk_cross_entropy(np.ones((2, 4)), [0, 1], m[0, :1] / m[0, 0], 1.0), "p_k"),
        (
            lambda m: so.topk_cross_entropy(np.ones((2, 4)), m[:, 0].astype(int) - 1, [1.0]),
            "labels",
        ),
        (
            lambda m: so.permutation_cross_entropy(np.ones((2, 4)), m.astype(int), 1.0),
            "target_ranks",
        ),
    ],
)
def test_masked_arrays_are_refused(call, name):
    """A mask would be silently dropped (np.asarray ignores it): refused, naming the argument.
    The bridges refuse them too (PyTorch takes tensors and plain numbers only).
    """
    masked = np.ma.masked_array([[1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 4.0, 3.0]], mask=False)
    masked.mask[0, 1] = True
    with pytest.raises(TypeError, match=rf"^{name} is a numpy\.ma\.MaskedArray"):
        call(masked)


def test_masked_arrays_are_refused_by_the_bridges():
    torch = pytest.importorskip("torch")
    import softorder.bridges.torch as sot

    ones = torch.ones(2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="alpha must be a real number"):
        sot.soft_rank(ones, np.ma.masked_array([0.5, 0.5], mask=[0, 1]))
    with pytest.raises(TypeError, match="k must be a real number"):
        sot.soft_topk(ones, np.ma.masked_array([1.0, 2.0], mask=[0, 1]), 0.5)

    pytest.importorskip("jax")
    import softorder.bridges.jax as soj

    masked = np.ma.masked_array([[1.0, 2.0, 3.0, 4.0]], mask=[[0, 1, 0, 0]])
    with pytest.raises(TypeError, match="x is a numpy.ma.MaskedArray"):
        soj.soft_rank(masked, 0.5)
    with pytest.raises(TypeError, match="alpha is a numpy.ma.MaskedArray"):
        soj.soft_rank(np.ones((1, 4)), np.ma.masked_array([0.5], mask=[True]))
    with pytest.raises(TypeError, match="k is a numpy.ma.MaskedArray"):
        soj.soft_topk(np.ones((1, 4)), np.ma.masked_array([2.0], mask=[False]), 0.5)


def test_p_k_within_the_tolerance_is_used_as_given(rng):
    """|sum(p_k) - 1| <= 1e-6 is accepted and not renormalised: the loss is the formula's
    with the given weights.
    """
    logits = rng.normal(size=(3, 6))
    labels = np.array([0, 2, 5])
    p_k = np.array([0.3, 0.7 - 9e-7])
    loss = so.topk_cross_entropy(logits, labels, p_k, 0.4, reduction="none")
    expected = [
        naive.topk_cross_entropy_row(r, y, p_k, 0.4) for r, y in zip(logits, labels, strict=True)
    ]
    np.testing.assert_allclose(loss, expected, rtol=1e-12)
    # float32 probabilities from a softmax (rounding far below the tolerance) are accepted...
    z = rng.normal(size=50).astype(np.float32)
    softmax = np.exp(z) / np.exp(z).sum(dtype=np.float32)
    so.topk_cross_entropy(rng.normal(size=(2, 60)), [0, 1], softmax, 0.5)
    # ...and float16 ones within a few of float16's own rounding steps (sum 1.00012 here)
    so.topk_cross_entropy(logits, labels, np.array([0.1, 0.2, 0.7], np.float16), 0.5)


def test_p_k_widened_from_a_narrow_float_keeps_that_floats_tolerance():
    """A float16 or bfloat16 p_k reaches the check widened to float32 through the bridges (and
    a loss module's ``.half()``): every entry held exactly by the narrow float gives it that
    float's tolerance; other values keep 1e-6.
    """
    logits, labels = np.zeros((2, 6)), [0, 1]
    thirds16 = np.full(3, 1 / 3, np.float16).astype(np.float32)  # sum 0.99976
    so.topk_cross_entropy(logits, labels, thirds16, 0.5)
    bf16 = np.array([0.2, 0.3, 0.5], np.float32).view(np.uint32) & 0xFFFF0000
    so.topk_cross_entropy(logits, labels, bf16.view(np.float32).astype(np.float64), 0.5)
    with pytest.raises(ValueError, match="summing to 1 within 1e-06"):
        so.topk_cross_entropy(logits, labels, np.full(3, 0.3333), 0.5)  # sum 0.9999


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_a_pullback_keeps_the_labels_and_ranks_of_its_call(dtype):
    """The caller's integer arrays may change after ``vjp`` returns (a reused buffer): the
    pullback gives the gradients of the call that was made."""
    x = np.array([[0.3, -1.2, 2.0, 0.7]])
    labels, ranks = np.array([1], dtype), np.array([[2, 1, 4, 3]], dtype)
    pullbacks = [
        so.vjp(so.topk_cross_entropy, x, labels, [0.5, 0.5], 0.5)[1],
        so.vjp(so.permutation_cross_entropy, x, ranks, 0.5)[1],
    ]
    before = [pullback(1.0)[0] for pullback in pullbacks]
    labels[0], ranks[0] = 2, [1, 2, 3, 4]
    for pullback, gradient in zip(pullbacks, before, strict=True):
        np.testing.assert_array_equal(pullback(1.0)[0], gradient)


def test_duplicate_target_ranks_name_the_row_in_a_batch():
    ranks = np.tile(np.arange(1, 5), (2, 3, 1))
    ranks[1, 2] = [1, 2, 4, 4]
    with pytest.raises(ValueError, match=r"row \(1, 2\) repeats rank 4"):
        so.permutation_cross_entropy(np.zeros((2, 3, 4)), ranks, 0.5)
    so.permutation_cross_entropy(np.zeros((2, 3, 4)), np.tile(np.arange(1, 5), (2, 3, 1)), 0.5)


# --- alpha in NumPy's keepdims shape --------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("name", ["topk", "log_topk", "rank", "sort", "quantile", "permutation"])
def test_alpha_in_the_keepdims_shape(rng, name, axis):
    """``alpha = x.std(axis, keepdims=True)`` is one alpha per row: values equal those of the
    batch-shaped alpha; its gradient (and its tangent) has the keepdims shape and matches
    finite differences.
    """
    fn, args = OP_ARGS[name]
    before = args[:-1]  # k or q
    x = rng.normal(size=(3, 4, 5))
    alpha = 0.3 + x.std(axis=axis, keepdims=True)
    assert alpha.ndim == 3 and alpha.shape[axis] == 1
    out = fn(x, *before, alpha, axis=axis)
    np.testing.assert_array_equal(out, fn(x, *before, np.squeeze(alpha, axis), axis=axis))

    out, pullback = so.vjp(fn, x, *before, alpha, axis=axis)
    cotangent = rng.normal(size=out.shape)
    alpha_bar = pullback(cotangent)[-1]
    assert alpha_bar.shape == alpha.shape
    direction = rng.normal(size=alpha.shape)

    def f(a):
        return float(np.sum(fn(x, *before, a, axis=axis) * cotangent))

    expected = naive.central_difference(f, alpha, direction)
    np.testing.assert_allclose(np.sum(alpha_bar * direction), expected, rtol=1e-6, atol=1e-9)
    tangents = (None,) * (1 + len(before)) + (direction,)
    _, out_dot = so.jvp(fn, (x, *before, alpha), tangents, axis=axis)
    np.testing.assert_allclose(np.sum(out_dot * cotangent), expected, rtol=1e-6, atol=1e-9)


def test_keepdims_alpha_broadcasts_and_sums_its_gradient(rng):
    """A keepdims alpha of length 1 along a batch axis too is shared by those rows: its
    gradient is the sum over them (as for a broadcast batch-shaped alpha).
    """
    x = rng.normal(size=(3, 4, 5))
    shared = np.array([[[0.4]], [[0.7]], [[1.1]]])  # (3, 1, 1): one alpha per x[i]
    out, pullback = so.vjp(so.soft_sort, x, shared)
    np.testing.assert_array_equal(out, so.soft_sort(x, shared[:, :, 0]))
    cotangent = rng.normal(size=out.shape)
    (_, alpha_bar) = pullback(cotangent)
    (_, reference) = so.vjp(so.soft_sort, x, shared[:, :, 0])[1](cotangent)
    assert alpha_bar.shape == (3, 1, 1)
    np.testing.assert_allclose(alpha_bar[:, :, 0], reference, rtol=1e-12)


def test_keepdims_alpha_in_the_losses(rng):
    logits = rng.normal(size=(5, 6))
    alpha = 0.2 + logits.std(axis=-1, keepdims=True)
    labels = np.arange(5)
    ranks = np.argsort(np.argsort(rng.normal(size=(5, 6)), axis=-1), axis=-1) + 1
    for fn, args in [
        (so.topk_cross_entropy, (labels, [0.25, 0.75])),
        (so.permutation_cross_entropy, (ranks,)),
    ]:
        out, pullback = so.vjp(fn, logits, *args, alpha, reduction="sum")
        assert out == fn(logits, *args, alpha[:, 0], reduction="sum")
        alpha_bar = pullback(np.ones(()))[-1]
        assert alpha_bar.shape == (5, 1)
        direction = rng.normal(size=(5, 1))
        expected = naive.central_difference(
            lambda a, fn=fn, args=args: float(fn(logits, *args, a, reduction="sum")),
            alpha,
            direction,
        )
        np.testing.assert_allclose(np.sum(alpha_bar * direction), expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("alpha_shape", "axis"),
    [((5, 4), -1), ((1, 4), -1), ((5, 2), 0), ((5, 1, 1), -1), ((2, 1), -1)],
)
def test_alpha_that_is_neither_batch_nor_keepdims_shaped_is_refused(alpha_shape, axis):
    with pytest.raises(ValueError, match="does not broadcast to the batch shape .* keepdims"):
        so.soft_rank(np.ones((5, 4)), np.full(alpha_shape, 0.5), axis=axis)


def test_keepdims_alpha_through_torch(rng):
    """``sot.soft_rank(x, x.std(dim=-1, keepdim=True))``: the gradient reaches x through alpha
    too, and gradcheck (finite differences, forward mode as well) passes for a keepdims alpha.
    """
    torch = pytest.importorskip("torch")
    import softorder.bridges.torch as sot

    x = torch.tensor(rng.normal(size=(5, 4)), requires_grad=True)
    sot.soft_rank(x, x.std(dim=-1, keepdim=True)).square().sum().backward()
    x_grad = x.grad.clone()
    x.grad = None
    sot.soft_rank(x, x.std(dim=-1)).square().sum().backward()
    torch.testing.assert_close(x_grad, x.grad, rtol=1e-12, atol=1e-12)

    alpha = torch.tensor(rng.uniform(0.3, 1.0, size=(5, 1)), requires_grad=True)
    for fn in (
        lambda x, a: sot.soft_rank(x, a),
        lambda x, a: sot.soft_topk(x, 1.5, a),
        lambda x, a: sot.soft_sort(x.T, a.T, dim=0),
    ):
        assert torch.autograd.gradcheck(fn, (x.detach().requires_grad_(), alpha))
        assert torch.autograd.gradcheck(
            fn, (x.detach().requires_grad_(), alpha), check_forward_ad=True, check_backward_ad=False
        )


@pytest.mark.parametrize("alpha", [0.01, 0.3, 1.0, 10.0])
def test_soft_sort_ends_are_the_soft_minimum_and_maximum(rng, alpha):
    """What docs/choosing-alpha.rst promises: the first soft-sorted value is the soft minimum
    ``-alpha log sum exp(-x / alpha)`` (the last the soft maximum), so the ends leave the
    data's range by between 0 and ``alpha log n``.
    """
    from scipy.special import logsumexp

    x = rng.normal(size=(50, 7))
    x[0] = 0.5  # n tied values: the ends move by alpha log n exactly
    s = so.soft_sort(x, alpha)
    np.testing.assert_allclose(s[:, 0], -alpha * logsumexp(-x / alpha, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(s[:, -1], alpha * logsumexp(x / alpha, axis=-1), rtol=1e-12)
    below = x.min(axis=-1) - s[:, 0]
    assert np.all(below >= 0) and np.all(below <= alpha * np.log(7) * (1 + 1e-12))
    np.testing.assert_allclose(below[0], alpha * np.log(7), rtol=1e-12)
