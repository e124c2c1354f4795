"""soft_rank of a float32 input keeps its sorted values in float32 (issue 13: 4 bytes per
element less from the forward pass to the last VJP) and computes exactly what the float64
computation of the same values does: every result is the float64 one rounded once."""

import numpy as np
import pytest

import softorder
from softorder._engine.autodiff import bind, rule_of


def _inputs(rng):
    x = rng.normal(size=(3, 40)).astype(np.float32)
    x[0, 5] = x[0, 6] = x[0, 7]  # a tie
    x[1, 0], x[1, 9] = np.inf, -np.inf
    x[2, :] *= np.float32(1e-3)  # gaps far below alpha
    return x


def test_the_rule_keeps_float32_sorted_values(rng):
    x = _inputs(rng)
    rule = rule_of(softorder.soft_rank)
    ctx = rule.prepare(**bind(softorder.soft_rank.signature, (x, 0.5), {}))
    assert ctx.rows.xs.dtype == np.float32
    np.testing.assert_array_equal(ctx.rows.xs, np.sort(x, axis=-1))
    ctx64 = rule.prepare(**bind(softorder.soft_rank.signature, (x.astype(np.float64), 0.5), {}))
    assert ctx64.rows.xs.dtype == np.float64


@pytest.mark.parametrize("descending", [False, True])
def test_float32_results_are_the_float64_ones_rounded(rng, descending):
    x = _inputs(rng)
    x64 = x.astype(np.float64)
    v = rng.normal(size=x.shape).astype(np.float32)
    alpha = np.array([0.5, 0.01, 3.0])
    out, pullback = softorder.vjp(softorder.soft_rank, x, alpha, descending=descending)
    out64, pullback64 = softorder.vjp(softorder.soft_rank, x64, alpha, descending=descending)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, out64.astype(np.float32))
    # a float32 cotangent (the narrow VJP) and a float64 one (the general VJP)
    for cotangent in (v, v.astype(np.float64)):
        x_bar, alpha_bar = pullback(cotangent)
        x_bar64, alpha_bar64 = pullback64(v.astype(np.float64))
        assert x_bar.dtype == np.float32
        np.testing.assert_array_equal(x_bar, x_bar64.astype(np.float32))
        np.testing.assert_array_equal(alpha_bar, alpha_bar64.astype(np.float32))
    _, tangent = softorder.jvp(
        softorder.soft_rank, (x, alpha), (v, alpha * 0.1), descending=descending
    )
    _, tangent64 = softorder.jvp(
        softorder.soft_rank,
        (x64, alpha),
        (v.astype(np.float64), alpha * 0.1),
        descending=descending,
    )
    np.testing.assert_array_equal(tangent, tangent64.astype(np.float32))


def test_nan_rows(rng):
    x = _inputs(rng)
    x[1, 3] = np.nan
    out, pullback = softorder.vjp(softorder.soft_rank, x, 0.5)
    x_bar, _ = pullback(np.ones_like(x))
    assert np.isnan(out[1]).all() and np.isnan(x_bar[1]).all()
    assert not np.isnan(out[[0, 2]]).any() and not np.isnan(x_bar[[0, 2]]).any()
