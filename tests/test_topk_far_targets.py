"""Top-k gradients when every point is more than ``ONE_EXP_SHIFT`` alphas from the target.

The top-k VJP computes ``exp(-|z|)`` as ``exp(shift - |z|) * exp(-shift)`` (one exp per
element) unless ``exp(-shift)`` would not be a normal float; there it falls back to two exps.
The log memberships of a cluster far below the target keep finite, non-trivial gradients,
so this is where a wrong fallback would show.
"""

import numpy as np
import pytest

import softorder as so
from softorder.core.topk import ONE_EXP_SHIFT
from tests.naive import central_difference

# Two clusters 1500 alphas apart; with k = 3 the target sits between them, about 750 alphas
# from every point (above ONE_EXP_SHIFT), and 600 alphas with the closer clusters.
FAR = np.array([0.0, 0.4, 1.1, 1500.0, 1500.3, 1501.2])
NEAR = np.array([0.0, 0.4, 1.1, 1200.0, 1200.3, 1201.2])
assert (FAR[3] - FAR[2]) / 2 > ONE_EXP_SHIFT > (NEAR[3] - NEAR[2]) / 2


@pytest.mark.parametrize("x", [FAR, NEAR], ids=["beyond", "below"])
@pytest.mark.parametrize("fn", [so.log_soft_topk, so.soft_topk])
def test_vjp_matches_finite_differences_far_from_the_target(fn, x):
    rng = np.random.default_rng(0)
    u = rng.standard_normal(x.size)
    d = rng.standard_normal(x.size)
    _, pullback = so.vjp(fn, x, 3.0, 1.0)
    x_bar, k_bar, alpha_bar = pullback(u)
    expected = u @ central_difference(lambda v: fn(v, 3.0, 1.0), x, d, eps=1e-5)
    assert np.isfinite(x_bar).all()
    np.testing.assert_allclose(x_bar @ d, expected, rtol=1e-6, atol=1e-9)
    expected_alpha = u @ central_difference(lambda a: fn(x, 3.0, float(a)), 1.0, 1.0, eps=1e-6)
    np.testing.assert_allclose(alpha_bar, expected_alpha, rtol=1e-5, atol=1e-9)
    # d t / d k = 2 alpha exp(shift) / G is about e^600 here, beyond finite differences: the
    # forward-mode kernel (a separate code path) must agree with the VJP instead.
    # Beyond e^709 both report inf (the README's rule for derivatives beyond float64).
    _, p_dot = so.jvp(fn, (x, 3.0, 1.0), (None, 1.0, None))
    k_bars = [pullback(row)[1] for row in np.eye(x.size)]
    np.testing.assert_allclose(k_bars, p_dot, rtol=1e-9)


def test_log_memberships_far_below_the_target_have_finite_gradients():
    # Far below the target t, log p_i = (x_i - t) / alpha - log 2, and S(t) = k balances the
    # two clusters' tails: dt/dx_i = exp(x_i) / (2 sum_lower exp(x_j)) (alpha = 1). So
    # d log p_0 / d x_0 = 1 - dt/dx_0, which the VJP must not lose to underflow.
    _, pullback = so.vjp(so.log_soft_topk, FAR, 3.0, 1.0)
    x_bar, _, _ = pullback(np.eye(FAR.size)[0])
    lower = np.exp(FAR[:3])
    assert x_bar[0] == pytest.approx(1.0 - 0.5 * lower[0] / lower.sum(), rel=1e-9)
