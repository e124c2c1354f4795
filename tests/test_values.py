"""Every operation of the NumPy API against tests/naive.py, in float64 and float32."""

import numpy as np
import pytest
from scipy.stats import rankdata

import softorder as so
from tests import naive

ALPHAS = [0.03, 0.5, 4.0]


def per_row(fn, x, *args):
    return np.stack([fn(row, *args) for row in x])


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("largest", [True, False])
def test_soft_topk(rng, alpha, largest):
    x = rng.normal(size=(5, 11))
    for k in [1, 3, 2.5, 10]:
        got = so.soft_topk(x, k, alpha, largest=largest)
        expected = per_row(naive.soft_topk, x, k, alpha, largest)
        np.testing.assert_allclose(got, expected, atol=1e-11)


def test_log_soft_topk_is_log_of_soft_topk(rng):
    x = rng.normal(size=(4, 9)) * 3
    got = so.log_soft_topk(x, 3, 0.2)
    np.testing.assert_allclose(np.exp(got), per_row(naive.soft_topk, x, 3, 0.2, True), atol=1e-12)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_soft_rank(rng, alpha):
    x = rng.normal(size=(5, 12))
    np.testing.assert_allclose(
        so.soft_rank(x, alpha), per_row(naive.soft_rank, x, alpha), rtol=1e-12
    )
    n = x.shape[1]
    np.testing.assert_allclose(
        so.soft_rank(x, alpha, descending=True),
        n + 1 - per_row(naive.soft_rank, x, alpha),
        rtol=1e-12,
    )


@pytest.mark.parametrize("alpha", ALPHAS)
def test_soft_sort(rng, alpha):
    x = rng.normal(size=(4, 10))
    expected = per_row(naive.soft_sort, x, alpha)
    np.testing.assert_allclose(so.soft_sort(x, alpha), expected, atol=1e-10)
    np.testing.assert_allclose(
        so.soft_sort(x, alpha, descending=True), expected[:, ::-1], atol=1e-10
    )


@pytest.mark.parametrize("alpha", ALPHAS)
def test_soft_quantile(rng, alpha):
    x = rng.normal(size=(4, 10))
    q = np.array([0.05, 0.5, 0.9])
    got = so.soft_quantile(x, q[None, :], alpha)
    np.testing.assert_allclose(got, per_row(naive.soft_quantile, x, q, alpha), atol=1e-10)
    one = so.soft_quantile(x, 0.3, alpha)
    assert one.shape == (4,)
    np.testing.assert_allclose(one, per_row(naive.soft_quantile, x, [0.3], alpha)[:, 0], atol=1e-10)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_soft_permutation(rng, alpha):
    x = rng.normal(size=(3, 7))
    got = so.soft_permutation(x, alpha)
    np.testing.assert_allclose(got, per_row(naive.soft_permutation, x, alpha), atol=1e-11)
    desc = so.soft_permutation(x, alpha, descending=True)
    np.testing.assert_allclose(desc, got[:, ::-1, :], atol=1e-11)


@pytest.mark.parametrize("split", [False, True])
def test_topk_cross_entropy(rng, split):
    logits = rng.normal(size=(6, 10)) * 2
    labels = rng.integers(0, 10, size=6)
    p_k = np.array([0.3, 0.0, 0.2, 0.0, 0.5])
    got = so.topk_cross_entropy(logits, labels, p_k, 0.7, reduction="none", split_top1=split)
    ref = naive.topk_cross_entropy_split_row if split else naive.topk_cross_entropy_row
    expected = [ref(logits[i], labels[i], p_k, 0.7) for i in range(6)]
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    assert np.isclose(
        so.topk_cross_entropy(logits, labels, p_k, 0.7, split_top1=split), np.mean(expected)
    )
    assert np.isclose(
        so.topk_cross_entropy(logits, labels, p_k, 0.7, reduction="sum", split_top1=split),
        np.sum(expected),
    )


def test_permutation_cross_entropy(rng):
    x = rng.normal(size=(4, 8))
    target = np.stack([rng.permutation(8) + 1 for _ in range(4)])
    got = so.permutation_cross_entropy(x, target, 0.4, reduction="none")
    expected = [naive.permutation_cross_entropy_row(x[i], target[i], 0.4) for i in range(4)]
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    desc = so.permutation_cross_entropy(x, target, 0.4, reduction="none", descending=True)
    expected_desc = [naive.permutation_cross_entropy_row(-x[i], target[i], 0.4) for i in range(4)]
    np.testing.assert_allclose(desc, expected_desc, rtol=1e-10)


def test_naive_permutation_keeps_tiny_entries():
    """The reference's P[k, i] above both boundaries is a difference of upper tails: as a
    difference of CDFs near 1 it lost the digits of the tiny entries of a wrong ranking
    (the descending loss below was 1e-6 off, enough to move its finite differences by units).
    """
    x = np.array([-1.18394066, -1.12347315, -0.78212786, -0.72350781])
    x = np.concatenate([x, [0.04894283, 1.82187797, -0.81942585, -0.65247026]])
    target = np.array([4, 1, 7, 3, 2, 5, 6, 8])
    alpha = 0.10529026948410591
    # mpmath, 250 digits, bisection for the boundaries: ascending, descending
    for sign, expected in ((1.0, 66.850000560525806), (-1.0, 62.193232147142324)):
        got = naive.permutation_cross_entropy_row(sign * x, target, alpha)
        np.testing.assert_allclose(got, expected, rtol=2e-13)
        lib = so.permutation_cross_entropy(x, target, alpha, descending=sign < 0)
        np.testing.assert_allclose(lib, expected, rtol=2e-13)


def test_hard_limits(rng):
    x = rng.normal(size=(3, 9))
    alpha = 1e-6
    np.testing.assert_allclose(so.soft_rank(x, alpha), rankdata(x, axis=1), atol=1e-9)
    np.testing.assert_allclose(so.soft_sort(x, alpha), np.sort(x, axis=1), atol=1e-5)
    hard_top3 = np.zeros_like(x)
    np.put_along_axis(hard_top3, np.argsort(-x, axis=1)[:, :3], 1.0, axis=1)
    np.testing.assert_allclose(so.soft_topk(x, 3, alpha), hard_top3, atol=1e-9)
    P = so.soft_permutation(x, alpha)
    hard = np.zeros_like(P)
    for i, order in enumerate(np.argsort(x, axis=1)):
        hard[i, np.arange(9), order] = 1.0
    np.testing.assert_allclose(P, hard, atol=1e-9)
    q = np.array([0.1, 0.25, 0.5, 0.8])
    np.testing.assert_allclose(
        so.soft_quantile(x, q[None, :], alpha),
        np.quantile(x, q, axis=1, method="averaged_inverted_cdf").T,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda x: so.soft_topk(x, 3, 0.3),
        lambda x: so.log_soft_topk(x, 3, 0.3),
        lambda x: so.soft_rank(x, 0.3),
        lambda x: so.soft_sort(x, 0.3),
        lambda x: so.soft_quantile(x, 0.4, 0.3),
        lambda x: so.soft_permutation(x, 0.3),
    ],
)
def test_float32_agrees_with_float64_to_float32_precision(rng, call):
    x32 = rng.normal(size=(4, 50)).astype(np.float32)
    got = call(x32)
    assert got.dtype == np.float32
    ref = call(x32.astype(np.float64))
    np.testing.assert_allclose(
        got, ref.astype(np.float32), rtol=2e-7, atol=2e-7 * np.abs(ref).max()
    )


def test_integer_input_gives_float64():
    got = so.soft_rank(np.array([3, 1, 2]), 0.01)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [3, 1, 2])


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (so.soft_topk, (2.5, 0.3)),
        (so.log_soft_topk, (2.5, 0.3)),
        (so.soft_rank, (0.3,)),
        (so.soft_sort, (0.3,)),
        (so.soft_quantile, (0.4, 0.3)),
        (so.soft_permutation, (0.3,)),
    ],
)
def test_float32_gradients_agree_with_float64(rng, fn, args):
    x32 = rng.normal(size=(3, 20)).astype(np.float32)
    out32, pullback32 = so.vjp(fn, x32, *args)
    out64, pullback64 = so.vjp(fn, x32.astype(np.float64), *args)
    u = rng.normal(size=out64.shape)
    for g32, g64 in zip(pullback32(u.astype(np.float32)), pullback64(u), strict=True):
        assert np.asarray(g32).dtype == np.float32
        np.testing.assert_allclose(
            g32, np.asarray(g64).astype(np.float32), rtol=1e-6, atol=1e-6 * np.abs(g64).max()
        )


def test_float16_is_computed_in_float64_and_returned_in_float16(rng):
    x16 = rng.normal(size=(2, 30)).astype(np.float16)
    ranks = so.soft_rank(x16, 0.2)
    assert ranks.dtype == np.float16
    np.testing.assert_array_equal(
        ranks, so.soft_rank(x16.astype(np.float64), 0.2).astype(np.float16)
    )
    _, pullback = so.vjp(so.soft_topk, x16, 3.0, 0.2)
    x_bar, k_bar, alpha_bar = pullback(np.ones((2, 30), dtype=np.float16))
    assert x_bar.dtype == k_bar.dtype == alpha_bar.dtype == np.float16


@pytest.mark.parametrize(
    "fn, args",
    [
        (so.soft_rank, ()),
        (so.soft_sort, ()),
        (so.soft_topk, (2.5,)),
        (so.soft_quantile, (0.4,)),
        (so.soft_permutation, ()),
    ],
)
def test_alpha_per_row_equals_each_row_alone(fn, args, rng):
    x = rng.normal(size=(4, 9))
    alphas = np.array([1e-3, 0.2, 1.0, 30.0])
    together = fn(x, *args, alphas)
    for r in range(4):
        np.testing.assert_array_equal(together[r], fn(x[r], *args, alphas[r]))
    # alpha follows the batch axes wherever the operation's axis is
    moved = fn(x.T, *args, alphas, axis=0)
    same_layout = fn in (so.soft_quantile, so.soft_permutation)
    np.testing.assert_array_equal(moved, together if same_layout else together.T)
