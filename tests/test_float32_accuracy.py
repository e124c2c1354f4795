"""Accuracy kept by the memory-saving paths (issue 13).

* float32 inputs: values and gradients within 2 ulp of the float64 computation on the same
  values, rounded to float32 (today they are that computation rounded: 0 ulp).
* The kernels' light paths against their general ones, bitwise: the VJP of a few inverse
  targets (tables only at their points, :func:`softorder.core.sort.few_tables`) against the
  VJP of many, the targets solved from ``A`` and ``B`` alone against soft sort's ladder.
* Soft rank's ``alpha`` gradient, whose VJP sums ``<v, Ad>`` and ``<v, Bd>`` apart
  (compensated), against an extended-precision sum.
"""

from __future__ import annotations

import numpy as np
import pytest

import softorder
from softorder import core

ROWS, N = 3, 200


def _ordered(a: np.ndarray) -> np.ndarray:
    """float32 bit patterns as integers in the order of the values (-0.0 next to 0.0)."""
    bits = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulp_distance(a, b) -> np.ndarray:
    """Units in the last place of float32 between ``a`` and ``b`` (0 where both are NaN);
    float64 values beyond float32's range round to +-inf, as softorder's results do.
    """
    with np.errstate(over="ignore"):
        a = np.asarray(a, np.float32)
        b = np.asarray(b, np.float32)
    both_nan = np.isnan(a) & np.isnan(b)
    one_nan = np.isnan(a) ^ np.isnan(b)
    dist = np.abs(_ordered(a) - _ordered(b))
    return np.where(both_nan, 0, np.where(one_nan, np.iinfo(np.int64).max, dist))


def _inputs(kind: str, rng) -> np.ndarray:
    x = rng.standard_normal((ROWS, N)).astype(np.float32)
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "infinities":
        x[:, ::17] = np.inf
        x[:, 5::23] = -np.inf
    elif kind == "spread":
        x = x * np.float32(1e3)
    return x


def _arguments(name: str, x: np.ndarray, rng) -> tuple:
    rows, n = x.shape
    if name in ("soft_topk", "log_soft_topk"):
        return (7,)
    if name == "soft_quantile":
        return (np.array([[0.1, 0.5, 0.9]]),)
    if name == "topk_cross_entropy":
        return (rng.integers(0, n, rows), np.array([0.5, 0.3, 0.2]))
    if name == "permutation_cross_entropy":
        return (np.argsort(np.argsort(rng.standard_normal((rows, n)), axis=1), axis=1) + 1,)
    return ()


OPERATIONS = (
    "soft_rank",
    "soft_sort",
    "soft_topk",
    "log_soft_topk",
    "soft_quantile",
    "topk_cross_entropy",
    "permutation_cross_entropy",
)


@pytest.mark.parametrize("kind", ["normal", "ties", "infinities", "spread"])
@pytest.mark.parametrize("name", OPERATIONS)
def test_float32_within_2_ulp_of_float64_rounded(name, kind):
    rng = np.random.default_rng(abs(hash((name, kind))) % 2**32)
    fn = getattr(softorder, name)
    x32 = _inputs(kind, rng)
    x64 = x32.astype(np.float64)
    args = _arguments(name, x32, rng)
    out32, pullback32 = softorder.vjp(fn, x32, *args, alpha=0.3)
    out64, pullback64 = softorder.vjp(fn, x64, *args, alpha=0.3)
    assert np.asarray(out32).dtype == np.float32
    assert ulp_distance(out32, out64).max() <= 2
    cot32 = np.asarray(rng.standard_normal(np.shape(out32)), np.float32)
    grads32 = pullback32(cot32)
    grads64 = pullback64(cot32.astype(np.float64))
    for g32, g64 in zip(grads32, grads64, strict=True):
        assert np.asarray(g32).dtype == np.float32
        assert ulp_distance(g32, g64).max() <= 2


def _sorted_rows(x):
    order = np.argsort(x, axis=1)
    return np.take_along_axis(x, order, 1), order


@pytest.mark.parametrize("kind", ["normal", "ties", "infinities", "spread", "nan"])
def test_few_target_vjp_equals_many_target_path_bitwise(kind):
    """The first m targets with the caller's cotangent, then enough targets with a zero
    cotangent (they add nothing) to take the path of many targets: the same bits.
    """
    rng = np.random.default_rng(["normal", "ties", "infinities", "spread", "nan"].index(kind))
    n, m = 400, 5
    x = _inputs("normal" if kind == "nan" else kind, rng)[:, :n].astype(np.float64)
    x = np.concatenate([x, x], axis=1)[:, :n]  # pairs of equal values
    if kind == "nan":
        x[1, 3] = np.nan
    xs, order = _sorted_rows(x)
    rows = xs.shape[0]
    alpha = np.array([0.05, 0.4, 2.0])
    w = rng.uniform(0.0, n, (rows, m))
    w[:, 0] = 17.0  # an integer target
    pad = np.tile(np.linspace(0.5, n - 0.5, n), (rows, 1))
    results = []
    for targets in (w, np.concatenate([w, pad], axis=1)):
        k = targets.shape[1]
        worder = np.argsort(targets, axis=1)
        out = np.empty((rows, k))
        anchor = np.empty((rows, k), np.int64)
        offset = np.empty((rows, k))
        core.inverse_kernel(
            xs, alpha, targets, worder, out, anchor, offset, core.workspace(rows, 4, n)
        )
        u = np.zeros((rows, k))
        u[:, :m] = np.linspace(-1.0, 2.0, m)
        x_bar = np.empty((rows, n))
        w_bar = np.empty((rows, k))
        alpha_bar = np.empty(rows)
        (core.few_inverse_vjp if core.sort.few_targets(k, n) else core.inverse_vjp)(
            xs,
            order,
            alpha,
            anchor,
            offset,
            np.empty((rows, 0), np.int64),
            u,
            x_bar,
            w_bar,
            alpha_bar,
            core.workspace(rows, core.sort.VJP_WORK, n),
            core.workspace(rows, 0, k),
        )
        results.append((out[:, :m], x_bar, w_bar[:, :m], alpha_bar))
    assert (m * core.sort.FEW_TARGETS <= n) and (m + n) * core.sort.FEW_TARGETS > n
    for light, general in zip(*results, strict=True):
        np.testing.assert_array_equal(light, general)


@pytest.mark.parametrize("kind", ["normal", "ties", "infinities", "spread"])
def test_targets_from_a_and_b_equal_the_sort_ladder_bitwise(kind):
    """The inverse at the targets k - 1/2, solved from A and B alone by a search
    (:func:`~softorder.core.lapsum.solve_targets_ab`), gives soft sort's values, solved by
    the ladder from the tables, bit for bit.
    """
    rng = np.random.default_rng(7)
    xs, _ = _sorted_rows(_inputs(kind, rng).astype(np.float64))
    rows, n = xs.shape
    w = np.tile(np.arange(n) + 0.5, (rows, 1))
    for a in (0.01, 0.3, 5.0):
        alpha = np.full(rows, a)
        results = []
        for solve in ("search", "ladder"):
            out = np.empty((rows, n))
            anchor = np.empty((rows, n), np.int64)
            offset = np.empty((rows, n))
            work = core.workspace(rows, 4, n)
            if solve == "search":
                worder = np.tile(np.arange(n), (rows, 1))
                core.inverse_kernel(xs, alpha, w, worder, out, anchor, offset, work)
            else:
                core.lapsum.sort_kernel(xs, alpha, out, anchor, offset, work)
            results.append((out, anchor, offset))
        for searched, ladder in zip(*results, strict=True):
            np.testing.assert_array_equal(searched, ladder)


def test_rank_alpha_gradient_matches_extended_precision():
    rng = np.random.default_rng(11)
    for trial in range(6):
        n = 400
        x = rng.standard_normal(n) * (10.0 if trial % 2 else 1.0)
        if trial % 3 == 0:
            x = np.round(x * 4) / 4
        alpha = 0.3
        v = rng.standard_normal(n)
        _, pullback = softorder.vjp(softorder.soft_rank, x, alpha=alpha)
        _, alpha_bar = pullback(v)
        L = np.longdouble
        z = (x[:, None].astype(L) - x[None, :].astype(L)) / L(alpha)
        d_rank = -(0.5 * np.exp(-np.abs(z)) * z).sum(axis=1) / L(alpha)
        reference = float((v.astype(L) * d_rank).sum())
        scale = float((np.abs(v) * np.abs(d_rank)).sum())
        assert abs(float(alpha_bar) - reference) <= 1e-15 * scale
