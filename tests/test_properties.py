"""Hypothesis properties that hold for every input and every alpha."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.stats import rankdata

import softorder as so
from tests import naive

values = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)
rows = st.integers(1, 30).flatmap(lambda n: arrays(np.float64, (n,), elements=values))
alphas = st.floats(1e-3, 1e3)


@given(x=rows, alpha=alphas, frac=st.floats(0.01, 0.99))
def test_topk_sums_to_k_and_lies_in_unit_interval(x, alpha, frac):
    k = frac * x.size
    p = so.soft_topk(x, k, alpha)
    assert np.all((p >= 0) & (p <= 1))
    np.testing.assert_allclose(p.sum(), k, rtol=1e-9, atol=1e-9)


@given(x=rows, alpha=alphas)
def test_permutation_is_doubly_stochastic(x, alpha):
    P = so.soft_permutation(x, alpha)
    assert np.all(P >= 0)
    np.testing.assert_allclose(P.sum(0), 1.0, atol=1e-9)
    np.testing.assert_allclose(P.sum(1), 1.0, atol=1e-9)


@given(x=rows, alpha=alphas, seed=st.integers(0, 2**32 - 1))
def test_rank_sort_topk_are_permutation_equivariant(x, alpha, seed):
    perm = np.random.default_rng(seed).permutation(x.size)
    np.testing.assert_allclose(
        so.soft_rank(x[perm], alpha), so.soft_rank(x, alpha)[perm], rtol=1e-12
    )
    np.testing.assert_allclose(
        so.soft_sort(x[perm], alpha),
        so.soft_sort(x, alpha),
        rtol=1e-12,
        atol=1e-12 * np.abs(x).max(initial=1),
    )
    k = max(x.size / 2, 0.5)
    np.testing.assert_allclose(
        so.soft_topk(x[perm], k, alpha), so.soft_topk(x, k, alpha)[perm], atol=1e-12
    )


@given(x=rows, alpha=alphas, shift=st.floats(-1e3, 1e3), scale=st.floats(1e-2, 1e2))
def test_shift_and_scale_equivariance(x, alpha, shift, scale):
    y = x * scale + shift
    tol = 1e-9 * (np.abs(x).max(initial=1) * scale + abs(shift) + alpha * scale)
    np.testing.assert_allclose(
        so.soft_rank(y, alpha * scale), so.soft_rank(x, alpha), rtol=1e-8, atol=1e-8
    )
    np.testing.assert_allclose(
        so.soft_sort(y, alpha * scale), so.soft_sort(x, alpha) * scale + shift, atol=tol
    )
    k = max(x.size / 3, 0.5)
    np.testing.assert_allclose(
        so.soft_topk(y, k, alpha * scale), so.soft_topk(x, k, alpha), atol=1e-8
    )


@given(x=rows, alpha=alphas)
def test_soft_sort_is_monotone_and_ranks_are_consistent(x, alpha):
    s = so.soft_sort(x, alpha)
    assert np.all(np.diff(s) >= -1e-9 * (1 + np.abs(s[1:])))
    r = so.soft_rank(x, alpha)
    np.testing.assert_allclose(r.sum(), x.size * (x.size + 1) / 2, rtol=1e-12)
    assert np.all((r > 0.5 - 1e-12) & (r < x.size + 0.5 + 1e-12))


@given(x=rows, alpha=alphas)
def test_sorting_the_soft_ranks_recovers_the_sort_targets(x, alpha):
    # S(s_k) = k - 1/2: the soft rank of the k-th soft-sorted value is k.
    s = so.soft_sort(x, alpha)
    np.testing.assert_allclose(
        naive.lapsum(x, s, alpha) + 0.5, np.arange(1, x.size + 1), atol=1e-7 * x.size
    )


distinct = st.integers(2, 25).flatmap(
    lambda n: arrays(np.int64, (n,), elements=st.integers(-(10**6), 10**6), unique=True)
)


@given(ints=distinct, unit=st.floats(1e-3, 1e3))
def test_hard_limit_as_alpha_goes_to_zero(ints, unit):
    x = ints * unit  # distinct values at least `unit` apart
    alpha = np.diff(np.sort(x)).min() / 100

    np.testing.assert_allclose(so.soft_rank(x, alpha), rankdata(x), atol=1e-12)
    np.testing.assert_allclose(so.soft_sort(x, alpha), np.sort(x), atol=alpha * 2)
    k = x.size // 2 or 1
    hard = np.zeros(x.size)
    hard[np.argsort(-x)[:k]] = 1
    np.testing.assert_allclose(so.soft_topk(x, k, alpha), hard, atol=1e-12)


rows32 = st.integers(1, 30).flatmap(
    lambda n: arrays(np.float32, (n,), elements=st.floats(-1e3, 1e3, width=32))
)


@given(x=rows32, alpha=st.floats(1e-2, 1e2), frac=st.floats(0.01, 0.99))
def test_float32_properties_hold_to_float32_precision(x, alpha, frac):
    k = frac * x.size
    p = so.soft_topk(x, k, alpha)
    assert p.dtype == np.float32
    np.testing.assert_allclose(p.astype(np.float64).sum(), k, rtol=1e-6 * x.size)
    P = so.soft_permutation(x, alpha)
    assert P.dtype == np.float32
    np.testing.assert_allclose(P.sum(0), 1.0, atol=1e-6 * x.size)
    np.testing.assert_allclose(P.sum(1), 1.0, atol=1e-6 * x.size)
    ranks = so.soft_rank(x, alpha)
    np.testing.assert_allclose(ranks, so.soft_rank(x.astype(np.float64), alpha).astype(np.float32))
    s = so.soft_sort(x, alpha)
    assert np.all(np.diff(s) >= 0)
