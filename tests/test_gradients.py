"""VJP and JVP of every operation against central finite differences (float64), with respect
to the input, alpha and k / q, and the two modes against each other."""

import numpy as np
import pytest

import softorder as so
from tests.naive import central_difference

RNG = np.random.default_rng(7)
X = RNG.normal(size=(3, 7))
LOGITS = RNG.normal(size=(5, 8)) * 1.5
LABELS = np.array([0, 3, 7, 2, 5])
ALPHAS = np.array([0.3, 0.6, 1.1])  # one alpha per row of X
TARGET_RANKS = np.stack([RNG.permutation(7) + 1 for _ in range(3)])

# (name, fn, primals, kwargs, differentiable positions)
CASES = [
    ("topk", so.soft_topk, (X, 2.0, 0.6), {}, (0, 1, 2)),
    ("topk_smallest_frac", so.soft_topk, (X, 3.4, 0.3), {"largest": False}, (0, 1, 2)),
    ("topk_per_row", so.soft_topk, (X, np.array([1.0, 2.5, 5.0]), 0.6), {}, (0, 1, 2)),
    ("topk_many", so.soft_topk, (X, np.array([[1.0, 4.0]]), 0.6), {}, (0, 1, 2)),
    ("topk_axis0", so.soft_topk, (X, 1.5, 0.6), {"axis": 0}, (0, 1, 2)),
    ("log_topk", so.log_soft_topk, (X, 2.0, 0.4), {}, (0, 1, 2)),
    (
        "log_topk_many",
        so.log_soft_topk,
        (X, np.array([[1.0, 5.5]]), 0.4),
        {"largest": False},
        (0, 1, 2),
    ),
    ("rank", so.soft_rank, (X, 0.5), {}, (0, 1)),
    ("rank_alpha_per_row", so.soft_rank, (X, np.array([0.3, 0.5, 0.9])), {}, (0, 1)),
    ("topk_alpha_per_row", so.soft_topk, (X, np.array([[1.0, 4.0]]), ALPHAS), {}, (0, 1, 2)),
    ("sort_alpha_shape_1", so.soft_sort, (X, np.array([0.4])), {}, (0, 1)),
    ("quantile_alpha_per_row", so.soft_quantile, (X, 0.3, ALPHAS), {}, (0, 1, 2)),
    ("permutation_alpha_per_row", so.soft_permutation, (X, ALPHAS), {}, (0, 1)),
    ("rank_desc_axis0", so.soft_rank, (X, 0.5), {"axis": 0, "descending": True}, (0, 1)),
    ("sort", so.soft_sort, (X, 0.5), {}, (0, 1)),
    ("sort_desc", so.soft_sort, (X, 0.2), {"descending": True}, (0, 1)),
    ("quantile", so.soft_quantile, (X, 0.3, 0.5), {}, (0, 1, 2)),
    ("quantile_many", so.soft_quantile, (X, np.array([[0.1, 0.5, 0.93]]), 0.5), {}, (0, 1, 2)),
    ("permutation", so.soft_permutation, (X, 0.5), {}, (0, 1)),
    ("permutation_desc", so.soft_permutation, (X, 0.3), {"descending": True}, (0, 1)),
    ("topk_ce", so.topk_cross_entropy, (LOGITS, LABELS, [0.2, 0.3, 0.0, 0.5], 0.5), {}, (0, 3)),
    (
        "topk_ce_split",
        so.topk_cross_entropy,
        (LOGITS, LABELS, [0.4, 0.3, 0.3], 0.5),
        {"split_top1": True, "reduction": "sum"},
        (0, 3),
    ),
    (
        "topk_ce_none",
        so.topk_cross_entropy,
        (LOGITS, LABELS, [0.0, 1.0], 0.8),
        {"reduction": "none"},
        (0, 3),
    ),
    ("perm_ce", so.permutation_cross_entropy, (X, TARGET_RANKS, 0.5), {}, (0, 2)),
    ("perm_ce_alpha_per_row", so.permutation_cross_entropy, (X, TARGET_RANKS, ALPHAS), {}, (0, 2)),
    (
        "topk_ce_alpha_per_row",
        so.topk_cross_entropy,
        (LOGITS, LABELS, [0.5, 0.5], np.linspace(0.3, 1.0, 5)),
        {"split_top1": True},
        (0, 3),
    ),
    (
        "perm_ce_desc",
        so.permutation_cross_entropy,
        (X, TARGET_RANKS, 0.5),
        {"descending": True, "reduction": "none"},
        (0, 2),
    ),
]
IDS = [c[0] for c in CASES]


def _direction(value, rng):
    value = np.asarray(value, dtype=np.float64)
    if value.ndim == 0:
        return np.float64(rng.uniform(0.5, 1.0))
    return rng.normal(size=value.shape)


def _moved(primals, position):
    """A function of one argument's value that returns all arguments with it replaced."""

    def f(value):
        args = list(primals)
        args[position] = value
        return args

    return f


@pytest.mark.parametrize(("name", "fn", "primals", "kwargs", "diff"), CASES, ids=IDS)
def test_vjp_matches_finite_differences(name, fn, primals, kwargs, diff):
    rng = np.random.default_rng(1)
    out, pullback = so.vjp(fn, *primals, **kwargs)
    u = rng.normal(size=np.shape(out))
    grads = pullback(u)
    assert len(grads) == len(diff)
    for grad, position in zip(grads, diff, strict=False):
        value = np.asarray(primals[position], dtype=np.float64)
        assert np.shape(grad) == value.shape
        d = _direction(value, rng)
        args = _moved(primals, position)
        fd = central_difference(lambda v, a=args: np.sum(u * fn(*a(v), **kwargs)), value, d)
        np.testing.assert_allclose(
            np.sum(grad * d), fd, rtol=1e-6, atol=1e-7, err_msg=f"{name}: argument {position}"
        )


JVP_CASES = CASES


@pytest.mark.parametrize(
    ("name", "fn", "primals", "kwargs", "diff"), JVP_CASES, ids=[c[0] for c in JVP_CASES]
)
def test_jvp_matches_finite_differences(name, fn, primals, kwargs, diff):
    rng = np.random.default_rng(2)
    for position in diff:
        value = np.asarray(primals[position], dtype=np.float64)
        d = _direction(value, rng)
        tangents = [None] * len(primals)
        tangents[position] = d
        out, out_dot = so.jvp(fn, primals, tuple(tangents), **kwargs)
        np.testing.assert_allclose(out, fn(*primals, **kwargs))
        args = _moved(primals, position)
        fd = central_difference(lambda v, a=args: fn(*a(v), **kwargs), value, d)
        np.testing.assert_allclose(
            out_dot, fd, rtol=1e-6, atol=1e-7, err_msg=f"{name}: argument {position}"
        )


@pytest.mark.parametrize(
    ("name", "fn", "primals", "kwargs", "diff"), JVP_CASES, ids=[c[0] for c in JVP_CASES]
)
def test_jvp_and_vjp_are_transposes(name, fn, primals, kwargs, diff):
    rng = np.random.default_rng(3)
    out, pullback = so.vjp(fn, *primals, **kwargs)
    u = rng.normal(size=np.shape(out))
    grads = pullback(u)
    tangents = [None] * len(primals)
    total = 0.0
    for grad, position in zip(grads, diff, strict=False):
        d = _direction(primals[position], rng)
        tangents[position] = d
        total += np.sum(grad * d)
    _, out_dot = so.jvp(fn, primals, tuple(tangents), **kwargs)
    np.testing.assert_allclose(np.sum(u * out_dot), total, rtol=1e-10, atol=1e-12)


def test_jvp_rejects_tangents_of_non_differentiable_arguments():
    with pytest.raises(ValueError, match="labels"):
        so.jvp(so.topk_cross_entropy, (LOGITS, LABELS, [1.0], 0.5), (None, LABELS))


def test_pullback_checks_the_cotangent_shape():
    _, pullback = so.vjp(so.soft_rank, X, 0.5)
    with pytest.raises(ValueError, match=r"shape \(3, 7\)"):
        pullback(np.ones(7))


def test_vjp_rejects_non_operations():
    with pytest.raises(TypeError, match="not a softorder operation"):
        so.vjp(np.sort, X)


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1e3, 1e6])
def test_gradients_scale_with_x_and_alpha(scale):
    """alpha is in the units of x: rank and top-k are invariant under (x, alpha) -> (c x, c alpha),
    so their x-gradients scale by 1/c; sort is equivariant, so its x-gradient is unchanged."""
    for fn, extra, power in [
        (so.soft_rank, (), -1),
        (so.soft_topk, (2.0,), -1),
        (so.soft_sort, (), 0),
        (so.soft_quantile, (0.3,), 0),
    ]:
        out, pullback = so.vjp(fn, X * scale, *extra, 0.5 * scale)
        grads = pullback(np.ones_like(out))
        ref_out, ref_pullback = so.vjp(fn, X, *extra, 0.5)
        ref = ref_pullback(np.ones_like(ref_out))
        assert np.all(np.isfinite(grads[0]))
        np.testing.assert_allclose(
            grads[0], ref[0] * scale**power, rtol=1e-8, atol=1e-12 * scale**power
        )
