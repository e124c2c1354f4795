"""Edge cases found by an audit of the public surface (NumPy API, vjp/jvp, both bridges),
each checked against an independent reference (tests/naive.py, finite differences)."""

import numpy as np
import pytest

import softorder as so

# Rows 1500 alpha apart: d log p / d k is about e^1500 there, beyond float64 (+-inf per row).
_FAR = np.array(
    [[0.0, 1500.0, 3000.0, 4500.0], [0.0, 1.0, 2.0, 3.0], [0.0, 1500.0, 3000.0, 4500.0]]
)
# Cotangent pulling the two far rows' k gradients to +inf and -inf.
_OPPOSED = np.zeros_like(_FAR)
_OPPOSED[0, 0], _OPPOSED[2, 0] = 1.0, -1.0


def test_shared_k_gradient_of_opposite_infinities_is_nan_without_a_warning():
    """No finite answer exists: the sum of +inf and -inf rows is NaN, with no RuntimeWarning
    (pytest turns warnings into errors); rows that agree in sign give that infinity."""
    _, pullback = so.vjp(so.log_soft_topk, _FAR, 2.0, 1.0)
    x_bar, k_bar, alpha_bar = pullback(_OPPOSED)
    assert np.isnan(k_bar) and np.isfinite(x_bar).all() and np.isfinite(alpha_bar)
    per_row = so.vjp(so.log_soft_topk, _FAR, np.full(3, 2.0), 1.0)[1](_OPPOSED)[1]
    assert np.isposinf(per_row[0]) and np.isneginf(per_row[2])
    assert np.isposinf(pullback(np.abs(_OPPOSED))[1])


def test_shared_k_gradient_of_opposite_infinities_through_torch():
    torch = pytest.importorskip("torch")
    import softorder.bridges.torch as sot

    x = torch.tensor(_FAR, requires_grad=True)
    k = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    (sot.log_soft_topk(x, k, 1.0) * torch.tensor(_OPPOSED)).sum().backward()
    assert torch.isnan(k.grad) and torch.isfinite(x.grad).all()


def test_shared_k_gradient_of_opposite_infinities_through_jax():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import softorder.bridges.jax as soj

    def loss(k):
        return jnp.sum(soj.log_soft_topk(jnp.asarray(_FAR, jnp.float32), k, 1.0) * _OPPOSED)

    assert np.isnan(float(jax.grad(loss)(2.0)))
