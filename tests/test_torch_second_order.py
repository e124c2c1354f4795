"""Second derivatives through the PyTorch bridge are refused with softorder's own error on
every path (never a silently wrong value, never PyTorch's generic "does not require grad"),
while first derivatives taken with ``create_graph=True`` stay exact."""

import pytest

torch = pytest.importorskip("torch")

from torch.func import grad, hessian, jacfwd, jacrev, jvp  # noqa: E402

import softorder.bridges.torch as sot  # noqa: E402

REFUSED = "softorder: second derivatives .* are not supported"
X = torch.tensor([[0.0, 3.0, 1.0, 4.0]], dtype=torch.float64)
LABELS = torch.tensor([2])
RANKS = torch.tensor([[1, 3, 2, 4]])
WEIGHTS = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=torch.float64)

# one scalar function of x (shape (1, 4)) per operation, each nonlinear in x
OPERATIONS = {
    "soft_topk": lambda x: (sot.soft_topk(x, 2, 0.7) * WEIGHTS).square().sum(),
    "log_soft_topk": lambda x: (sot.log_soft_topk(x, 2, 0.7) * WEIGHTS).sum(),
    "soft_rank": lambda x: sot.soft_rank(x, 0.7).square().sum(),
    "soft_sort": lambda x: (sot.soft_sort(x, 0.7) * WEIGHTS).square().sum(),
    "soft_quantile": lambda x: sot.soft_quantile(x, 0.3, 0.7).square().sum(),
    "soft_permutation": lambda x: (sot.soft_permutation(x, 0.7) @ WEIGHTS).square().sum(),
    "topk_cross_entropy": lambda x: sot.topk_cross_entropy(x, LABELS, [0.5, 0.5], 0.7),
    "permutation_cross_entropy": lambda x: sot.permutation_cross_entropy(x, RANKS, 0.7),
}


@pytest.fixture(params=list(OPERATIONS), ids=list(OPERATIONS))
def f(request):
    return OPERATIONS[request.param]


def _x():
    return X.clone().requires_grad_()


def test_the_issue_reproduction_is_refused():
    x = _x()
    loss = sot.soft_rank(x, 0.7).square().sum() + x.square().sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(NotImplementedError, match=REFUSED):
        g.square().sum().backward()


def test_create_graph_then_backward_is_refused(f):
    x = _x()
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    with pytest.raises(NotImplementedError, match=REFUSED):
        g.square().sum().backward()


def test_create_graph_mixed_with_torch_operations_is_refused(f):
    x = _x()
    loss = f(torch.sin(x) * 2.0) * x.sum() + x.exp().sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(NotImplementedError, match=REFUSED):
        torch.autograd.grad(g.sum(), x)


def test_create_graph_in_alpha_is_refused():
    x, alpha = _x(), torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(sot.soft_sort(x, alpha).square().sum(), alpha, create_graph=True)
    with pytest.raises(NotImplementedError, match=REFUSED):
        g.backward()


def test_create_graph_first_derivatives_are_unchanged(f):
    x1, x2 = _x(), _x()
    (g_graph,) = torch.autograd.grad(f(x1), x1, create_graph=True)
    (g_plain,) = torch.autograd.grad(f(x2), x2)
    torch.testing.assert_close(g_graph, g_plain, rtol=0, atol=0)
    # the gradient with a graph can still be used as a value (e.g. in a penalty's forward),
    # and updated in place
    assert torch.isfinite(g_graph.detach()).all()
    g_graph.mul_(2.0)
    torch.testing.assert_close(g_graph, 2.0 * g_plain, rtol=0, atol=0)


def test_gradgradcheck_is_refused(f):
    with pytest.raises(NotImplementedError, match=REFUSED):
        torch.autograd.gradgradcheck(f, (_x(),))


def test_gradgradcheck_forward_over_reverse_is_refused(f):
    with pytest.raises(NotImplementedError, match=REFUSED):
        torch.autograd.gradgradcheck(
            f,
            (_x(),),
            check_fwd_over_rev=True,
            check_rev_over_rev=False,
            check_undefined_grad=False,
        )


def test_func_grad_of_grad_is_refused(f):
    x = X[0].clone()
    with pytest.raises(NotImplementedError, match=REFUSED):
        grad(lambda u: grad(lambda v: f(v[None]))(u).square().sum())(x)


def test_func_grad_of_grad_issue_reproduction():
    x = X[0].clone()
    with pytest.raises(NotImplementedError, match=REFUSED):
        grad(lambda u: grad(lambda v: sot.soft_rank(v, 0.7).square().sum())(u).sum())(x)


def test_forward_over_reverse_is_refused(f):
    x, t = X[0].clone(), torch.ones(4, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=REFUSED):
        jvp(grad(lambda v: f(v[None])), (x,), (t,))


def test_reverse_over_forward_is_refused(f):
    x, t = X[0].clone(), WEIGHTS.clone()
    with pytest.raises(NotImplementedError, match=REFUSED):
        grad(lambda u: jvp(lambda v: f(v[None]), (u,), (t,))[1])(x)


def test_eager_forward_ad_then_backward_is_refused():
    import torch.autograd.forward_ad as fwAD

    x = _x()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        tangent = fwAD.unpack_dual((sot.soft_sort(dual, 0.7) * WEIGHTS).sum()).tangent
    with pytest.raises(NotImplementedError, match=REFUSED):
        tangent.backward()


@pytest.mark.parametrize(
    "transform", [hessian, lambda g: jacfwd(jacrev(g))], ids=["hessian", "jacfwd_jacrev"]
)
def test_hessian_is_refused(f, transform):
    with pytest.raises(NotImplementedError, match=REFUSED):
        transform(lambda v: f(v[None]))(X[0].clone())


def test_compiled_double_backward_is_refused():
    compiled = torch.compile(
        lambda u: sot.soft_rank(u, 0.7).square().sum(), fullgraph=True, backend="aot_eager"
    )
    x = _x()
    (g,) = torch.autograd.grad(compiled(x), x, create_graph=True)
    # first order through the compiled graph with create_graph=True is exact ...
    x2 = _x()
    (g2,) = torch.autograd.grad(OPERATIONS["soft_rank"](x2), x2)
    torch.testing.assert_close(g.detach(), g2)
    # ... and differentiating it again is refused (by PyTorch's compiled autograd here)
    with pytest.raises(RuntimeError, match="double backward"):
        g.square().sum().backward()


@pytest.mark.parametrize(
    "second",
    [
        lambda: jacrev(jacfwd(OPERATIONS["soft_rank"]))(X.clone()),
        lambda: jacfwd(jacfwd(OPERATIONS["soft_sort"]))(X.clone()),
        lambda: hessian(lambda a: sot.soft_sort(X, a).square().sum())(torch.tensor(0.7)),
        lambda: hessian(lambda k: sot.soft_topk(X, k, 0.5).square().sum())(torch.tensor(2.0)),
        lambda: grad(lambda a: grad(lambda u: sot.soft_rank(u, a).square().sum())(X).sum())(
            torch.tensor(0.7, dtype=torch.float64)
        ),
        lambda: torch.func.vmap(grad(lambda u: grad(OPERATIONS["soft_rank"])(u).sum()))(
            X.repeat(3, 1, 1)
        ),
    ],
    ids=["jacrev_jacfwd", "jacfwd_jacfwd", "hessian_alpha", "hessian_k", "x_alpha", "vmap"],
)
def test_other_second_order_transforms_are_refused(second):
    with pytest.raises(NotImplementedError, match=REFUSED):
        second()


def test_autograd_functional_double_backward_apis_are_refused():
    # torch.autograd.functional.jvp computes a first derivative by differentiating a gradient
    # (the double-backward trick); the refusal points to the forward-mode APIs, which work
    x, t = X[0].clone(), WEIGHTS.clone()
    with pytest.raises(NotImplementedError, match="use torch.func.jvp or torch.autograd.forward"):
        torch.autograd.functional.jvp(lambda u: sot.soft_rank(u, 0.7), x, t)
    with pytest.raises(NotImplementedError, match=REFUSED):
        torch.autograd.functional.hvp(OPERATIONS["soft_rank"], x, t)
    _, expected = jvp(lambda u: sot.soft_rank(u, 0.7), (x,), (t,))
    jac = torch.autograd.functional.jacobian(lambda u: sot.soft_rank(u, 0.7), x)
    torch.testing.assert_close(jac @ t, expected)
