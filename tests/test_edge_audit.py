"""Edge cases found by an audit of the public surface (NumPy API, vjp/jvp, both bridges),
each checked against an independent reference (tests/naive.py, finite differences)."""

import warnings

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


def test_sparse_and_nested_tensors_are_refused_naming_softorder():
    """PyTorch's own errors (from ``numpy()``) spoke of numpy or of an internal error."""
    torch = pytest.importorskip("torch")
    import softorder.bridges.torch as sot

    x = torch.randn(3, 5)
    with pytest.raises(TypeError, match=r"softorder takes dense.*x has layout torch.sparse_coo"):
        sot.soft_rank(x.to_sparse(), 0.5)
    with pytest.raises(TypeError, match=r"softorder takes dense.*_mkldnn"):
        sot.soft_topk(x.to_mkldnn(), 2, 0.5)
    with pytest.raises(TypeError, match=r"softorder takes dense.*alpha has layout"):
        sot.soft_sort(x, torch.full((3,), 0.5).to_sparse())
    with pytest.raises(TypeError, match=r"softorder takes dense.*logits has layout"):
        sot.topk_cross_entropy(x.to_sparse(), torch.tensor([0, 1, 2]), [1.0])
    rows = [torch.randn(3), torch.randn(4)]
    for layout in (torch.strided, torch.jagged):
        with warnings.catch_warnings():  # the strided layout's "prototype stage" warning
            warnings.simplefilter("ignore", UserWarning)
            nested = torch.nested.nested_tensor(rows, layout=layout)
        with pytest.raises(TypeError, match=r"softorder does not take nested tensors \(x\)"):
            sot.soft_topk(nested, 1, 0.5)


def test_split_top1_loss_of_a_row_of_all_minus_inf_logits_is_not_nan():
    """Every logit equal (all -inf, like all +inf) is a row of ties: the loss is
    shift-invariant, so both rows cost what a row of equal finite logits costs; the unsplit
    loss already does so."""
    p_k = [0.5, 0.5]
    losses = {}
    for name, value in (("finite", 0.0), ("plus", np.inf), ("minus", -np.inf)):
        logits = np.full((1, 4), value)
        for split in (False, True):
            losses[name, split] = so.topk_cross_entropy(
                logits, np.array([0]), p_k, 0.5, split_top1=split
            )
    assert losses["minus", False] == losses["plus", False] == losses["finite", False]
    assert losses["plus", True] == pytest.approx(losses["finite", True])
    assert losses["minus", True] == pytest.approx(losses["finite", True])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: so.soft_topk(x, 0, 0.5), "k must lie strictly between 0 and n=5; got 0"),
        (lambda x: so.log_soft_topk(x, 7.0, 0.5), "k must lie strictly between 0 and n=5; got 7"),
        (lambda x: so.soft_topk(x, [[1.0, 5.0]], 0.5), "got 5.0"),
        (lambda x: so.soft_quantile(x, 1.0, 0.5), "q must lie strictly between 0 and 1; got 1"),
        (
            lambda x: so.topk_cross_entropy(x, np.zeros(0, int), [0.5, 0.6]),
            "p_k must be a probability distribution",
        ),
    ],
)
def test_an_empty_batch_does_not_hide_a_bad_argument(call, match):
    """k, q and p_k were checked after broadcasting to the batch: with no rows, nothing."""
    with pytest.raises(ValueError, match=match):
        call(np.zeros((0, 5)))


def test_an_empty_batch_of_per_row_p_k():
    """One p_k per row with no rows: a loss of 0 (sum) and empty gradients, not NumPy's
    "zero-size array to reduction operation minimum"."""
    x, labels, p_k = np.zeros((0, 5)), np.zeros(0, int), np.zeros((0, 2))
    loss, pullback = so.vjp(so.topk_cross_entropy, x, labels, p_k, 0.5, reduction="sum")
    x_bar, alpha_bar = pullback(np.array(1.0))
    assert loss == 0.0 and x_bar.shape == (0, 5) and alpha_bar == 0.0


def test_an_empty_batch_does_not_hide_a_bad_k_in_the_bridges():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    import softorder.bridges.jax as soj
    import softorder.bridges.torch as sot

    with pytest.raises(ValueError, match="k must lie strictly between 0 and n=5; got 9"):
        sot.soft_topk(torch.zeros(0, 5), 9.0, 0.5)
    with pytest.raises(ValueError, match="q must lie strictly between 0 and 1; got 2"):
        soj.soft_quantile(jax.numpy.zeros((0, 5)), 2.0, 0.5)


def test_jvp_takes_primals_and_tangents_as_tuples_only():
    """An array was unpacked row by row: soft_topk(x[0], k=x[1]) ran silently."""
    x = np.array([[3.0, 1.0, 2.0], [1.0, 2.0, 0.5]])
    with pytest.raises(TypeError, match=r"primals must be a tuple \(or list\) of soft_topk's"):
        so.jvp(so.soft_topk, x, np.ones_like(x))
    with pytest.raises(TypeError, match=r"tangents must be a tuple .*; got NoneType"):
        so.jvp(so.soft_rank, (x, 0.5), None)
    out, out_dot = so.jvp(so.soft_rank, [x, 0.5], [np.ones_like(x)])  # lists as JAX takes them
    assert out.shape == out_dot.shape == x.shape


def test_an_input_wider_than_float64_is_refused():
    """np.longdouble was rounded to float64 (values apart by less than its spacing became
    ties) and returned as longdouble, a precision it did not have."""
    x = np.array([1.0, 0.5, 2.0], dtype=np.longdouble)
    if x.dtype.itemsize <= 8:  # longdouble is float64 on this platform: nothing is lost
        np.testing.assert_array_equal(so.soft_rank(x, 0.5), so.soft_rank(x.astype(float), 0.5))
        return
    with pytest.raises(TypeError, match=r"softorder computes in float64 .* x of dtype"):
        so.soft_rank(x, 0.5)
    with pytest.raises(TypeError, match=r"does not take logits of dtype"):
        so.topk_cross_entropy(x[None], np.array([0]), [1.0])


def test_a_tensor_requiring_grad_given_to_the_numpy_api_names_the_bridge():
    """PyTorch's own error advised x.detach(), which would silently cut the gradient."""
    torch = pytest.importorskip("torch")

    x = torch.randn(3, 5, requires_grad=True)
    with pytest.raises(TypeError, match=r"x is a torch.Tensor that requires grad.*bridges.torch"):
        so.soft_topk(x, 2, 0.5)
    with pytest.raises(TypeError, match=r"logits is a torch.Tensor that requires grad"):
        so.vjp(so.topk_cross_entropy, x, np.array([0, 1, 2]), [1.0])
    np.testing.assert_array_equal(
        so.soft_rank(x.detach(), 0.5), so.soft_rank(x.detach().numpy(), 0.5)
    )


def test_a_jax_tracer_given_to_the_numpy_api_names_the_bridge():
    jax = pytest.importorskip("jax")

    with pytest.raises(TypeError, match=r"x is a JAX tracer.*softorder.bridges.jax"):
        jax.grad(lambda x: so.soft_rank(x, 0.5).sum())(jax.numpy.ones(3))
    with pytest.raises(TypeError, match=r"x is a JAX tracer"):
        jax.jit(lambda x: so.soft_sort(x, 0.5))(jax.numpy.ones(3))
    with pytest.raises(TypeError, match="x must be real"):  # other errors pass unchanged
        so.soft_rank(np.ones(3, complex), 0.5)


def test_a_quantile_between_minus_and_plus_infinity_is_nan():
    """q * n equal to the number of -inf entries, with +inf next: x = [-M, M] gives 0, [-M, 2M]
    gives M/2, so no limit exists; np.quantile (the documented hard limit) gives NaN, and
    soft_quantile(-x, 1 - q) = -soft_quantile(x, q) rules out any infinity."""
    for row in ([-np.inf, np.inf], [np.inf, -np.inf, -np.inf, np.inf]):
        x = np.array(row)
        assert np.isnan(so.soft_quantile(x, 0.5, 1.0))
        assert np.isnan(so.soft_quantile(-x, 0.5, 1.0))
    # off the plateau, and with a finite entry in the gap, the limits stay
    assert so.soft_quantile(np.array([-np.inf, np.inf]), 0.25, 1.0) == -np.inf
    assert so.soft_quantile(np.array([-np.inf, np.inf]), 0.75, 1.0) == np.inf
    assert np.isfinite(so.soft_quantile(np.array([-np.inf, 0.0, np.inf]), 0.5, 1.0))
    assert so.soft_quantile(np.array([0.0, np.inf]), 0.5, 1.0) == np.inf
    # the other rows of a batch are untouched, values and gradients
    x = np.array([[-np.inf, np.inf, -np.inf, np.inf], [0.3, -1.0, 2.0, 0.5]])
    q = np.array([[0.5, 0.25]])
    out, pullback = so.vjp(so.soft_quantile, x, q, 1.0)
    out_alone, pullback_alone = so.vjp(so.soft_quantile, x[1:], q, 1.0)
    assert np.isnan(out[0, 0]) and out[0, 1] == -np.inf
    assert np.array_equal(out[1], out_alone[0])
    x_bar = pullback(np.ones((2, 2)))[0]
    assert np.array_equal(x_bar[1], pullback_alone(np.ones((1, 2)))[0][0])


def test_split_top1_loss_gradient_of_a_row_of_all_minus_inf_logits_is_finite():
    """The same rows' gradients: an infinite logit cannot move, so every entry is 0 (as for a
    row of +inf logits), and the finite row beside them gets what it gets alone."""
    logits = np.array([[-np.inf] * 4, [np.inf] * 4, [0.3, -1.0, 2.0, 0.5]])
    labels = np.array([0, 1, 2])
    for split in (False, True):
        settings = {"reduction": "none", "split_top1": split}
        loss, pullback = so.vjp(so.topk_cross_entropy, logits, labels, [0.5, 0.5], 0.5, **settings)
        grad = pullback(np.ones(3))[0]
        assert np.isfinite(loss).all()
        assert np.array_equal(grad[:2], np.zeros((2, 4)))
        _, alone = so.vjp(
            so.topk_cross_entropy, logits[2:], labels[2:], [0.5, 0.5], 0.5, **settings
        )
        assert np.array_equal(grad[2], alone(np.ones(1))[0][0])
