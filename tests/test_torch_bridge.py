"""The PyTorch bridge: gradients (reverse and forward mode) by gradcheck, values against the
NumPy API, dtypes, torch.compile, torch.func, errors, and a small training run on real data."""

import inspect
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import softorder as so  # noqa: E402
import softorder.bridges.torch as sot  # noqa: E402

GEN = torch.Generator().manual_seed(3)


def _randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=GEN, dtype=dtype)


def _f64(value, requires_grad=True):
    return torch.tensor(value, dtype=torch.float64, requires_grad=requires_grad)


X = _randn(3, 6)
LOGITS = _randn(4, 7) * 1.5
LABELS = torch.tensor([0, 3, 6, 2])
RANKS = torch.stack([torch.randperm(6, generator=GEN) + 1 for _ in range(3)])

# (id, function of the differentiable tensors, their values)
GRADCHECK_CASES = [
    ("topk", lambda x, k, a: sot.soft_topk(x, k, a), (X, _f64(2.5), _f64(0.6))),
    (
        "topk_many_k_dim0_smallest",
        lambda x, k, a: sot.soft_topk(x, k, a, dim=0, largest=False),
        (X, _f64([[1.0, 2.0]] * 6), _f64(0.4)),
    ),
    ("log_topk", lambda x, k, a: sot.log_soft_topk(x, k, a), (X, _f64([1.5, 2.0, 4.0]), _f64(0.5))),
    ("rank", lambda x, a: sot.soft_rank(x, a), (X, _f64(0.5))),
    ("rank_desc_dim0", lambda x, a: sot.soft_rank(x, a, dim=0, descending=True), (X, _f64(0.5))),
    ("rank_alpha_per_row", lambda x, a: sot.soft_rank(x, a), (X, _f64([0.3, 0.5, 1.0]))),
    ("sort", lambda x, a: sot.soft_sort(x, a), (X, _f64(0.3))),
    ("sort_desc", lambda x, a: sot.soft_sort(x, a, descending=True), (X, _f64(0.3))),
    ("quantile", lambda x, q, a: sot.soft_quantile(x, q, a), (X, _f64(0.3), _f64(0.5))),
    (
        "quantile_many",
        lambda x, q, a: sot.soft_quantile(x, q, a),
        (X, _f64([[0.2, 0.7]]), _f64(0.5)),
    ),
    ("permutation", lambda x, a: sot.soft_permutation(x, a), (X, _f64(0.4))),
    (
        "topk_ce",
        lambda z, a: sot.topk_cross_entropy(z, LABELS, [0.2, 0.3, 0.5], a),
        (LOGITS, _f64(0.5)),
    ),
    (
        "topk_ce_split_none",
        lambda z, a: sot.topk_cross_entropy(
            z, LABELS, torch.tensor([0.4, 0.6]), a, reduction="none", split_top1=True
        ),
        (LOGITS, _f64(0.7)),
    ),
    ("perm_ce", lambda x, a: sot.permutation_cross_entropy(x, RANKS, a), (X, _f64(0.5))),
    (
        "perm_ce_desc_sum",
        lambda x, a: sot.permutation_cross_entropy(x, RANKS, a, reduction="sum", descending=True),
        (X, _f64(0.5)),
    ),
]


@pytest.mark.parametrize(
    "fn, inputs", [c[1:] for c in GRADCHECK_CASES], ids=[c[0] for c in GRADCHECK_CASES]
)
def test_gradcheck_reverse_and_forward_mode(fn, inputs):
    inputs = tuple(t.detach().clone().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, atol=1e-6, rtol=1e-5)


# (torch function, NumPy function, extra positional args, torch kwargs, numpy kwargs)
VALUE_CASES = [
    (sot.soft_topk, so.soft_topk, (3.0, 0.4), {"dim": 1}, {"axis": 1}),
    (sot.log_soft_topk, so.log_soft_topk, (2.0, 0.4), {"largest": False}, {"largest": False}),
    (sot.soft_rank, so.soft_rank, (0.3,), {"dim": 0}, {"axis": 0}),
    (
        sot.soft_sort,
        so.soft_sort,
        (0.3,),
        {"dim": 2, "descending": True},
        {"axis": 2, "descending": True},
    ),
    (sot.soft_quantile, so.soft_quantile, (0.25, 0.3), {"dim": -2}, {"axis": -2}),
    (sot.soft_permutation, so.soft_permutation, (0.3,), {"dim": 1}, {"axis": 1}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "tfn, nfn, args, tkw, nkw", VALUE_CASES, ids=lambda c: getattr(c, "__name__", "")
)
def test_values_equal_the_numpy_api(tfn, nfn, args, tkw, nkw, dtype):
    x = _randn(2, 5, 4, dtype=dtype)
    got = tfn(x, *args, **tkw)
    expected = nfn(x.numpy(), *args, **nkw)
    assert got.dtype == dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got.numpy(), expected)


def test_losses_equal_the_numpy_api():
    got = sot.topk_cross_entropy(LOGITS, LABELS, [0.5, 0.5], 0.3, reduction="none")
    expected = so.topk_cross_entropy(
        LOGITS.numpy(), LABELS.numpy(), [0.5, 0.5], 0.3, reduction="none"
    )
    np.testing.assert_array_equal(got.numpy(), expected)
    got = sot.permutation_cross_entropy(X, RANKS, 0.3, descending=True)
    expected = so.permutation_cross_entropy(X.numpy(), RANKS.numpy(), 0.3, descending=True)
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    x = _randn(4, 9, dtype=torch.float32).to(dtype).requires_grad_()
    alpha = torch.tensor(0.5, dtype=dtype, requires_grad=True)
    p = sot.soft_topk(x, 3, alpha)
    assert p.dtype == dtype
    expected = sot.soft_topk(x.detach().float(), 3, 0.5)
    torch.testing.assert_close(p.float(), expected.to(dtype).float())
    (p * torch.arange(9.0)).sum().backward()
    assert x.grad.dtype == dtype and alpha.grad.dtype == dtype
    assert torch.isfinite(x.grad.float()).all() and alpha.grad != 0


def test_gradients_reach_alpha_and_k_only_when_they_require_grad():
    x = X.clone().requires_grad_()
    k = _f64(2.0, requires_grad=False)
    alpha = _f64(0.5)
    sot.soft_topk(x, k, alpha)[:, 0].sum().backward()
    assert x.grad is not None and alpha.grad is not None and k.grad is None
    assert float(alpha.grad) != 0.0


def test_numpy_pullback_equals_torch_backward():
    x = X.clone().requires_grad_()
    alpha = _f64(0.4)
    v = _randn(3, 6)
    (sot.soft_sort(x, alpha) * v).sum().backward()
    _, pullback = so.vjp(so.soft_sort, X.numpy(), 0.4)
    x_bar, alpha_bar = pullback(v.numpy())
    np.testing.assert_allclose(x.grad.numpy(), x_bar, rtol=1e-13)
    np.testing.assert_allclose(alpha.grad.numpy(), alpha_bar, rtol=1e-13)


def test_inputs_are_never_modified_and_non_contiguous_input_works():
    base = _randn(6, 4)
    x = base.t()  # non-contiguous view
    before = base.clone()
    r = sot.soft_rank(x, 0.5)
    np.testing.assert_array_equal(r.numpy(), so.soft_rank(x.contiguous().numpy(), 0.5))
    torch.testing.assert_close(base, before, rtol=0, atol=0)


def _in_dual_level(dual: bool, fn):
    if not dual:
        return fn()
    with torch.autograd.forward_ad.dual_level():
        return fn()


def test_plain_and_forward_mode_calls_take_their_functions_with_equal_values():
    """A plain eager call takes an older-form Function (with the input alone or with another
    tensor argument), a call inside a dual level the one with a jvp;
    values and gradients are bitwise equal, and an in-place change of the input between
    forward and backward is refused.
    """
    results = []
    for dual in (False, True):
        x = X.clone().requires_grad_()
        out = _in_dual_level(dual, lambda x=x: sot.soft_topk(x, 2.5, 0.6, dim=0))
        expected = sot._Operation if dual else sot._PlainOperation
        assert type(out.grad_fn).__name__ == expected.__name__ + "Backward"
        (grad,) = torch.autograd.grad(out, x, X)
        results.append((out.detach(), grad))
        z = X.clone().requires_grad_().clone()
        ranks = _in_dual_level(dual, lambda z=z: sot.soft_rank(z, 0.5))
        with torch.no_grad():
            z.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            ranks.sum().backward()
    x, alpha = X.clone().requires_grad_(), _f64(0.6)  # two tensors: the general backward
    out = sot.soft_topk(x, 2.5, alpha, dim=0)
    assert type(out.grad_fn).__name__ == "_PlainOperationBackward"
    results.append((out.detach(), torch.autograd.grad(out, x, X)[0]))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_every_rule_takes_its_input_first():
    """The lean path (_values, _PlainOperation.backward) passes the input to each rule's
    prepare by position and reads its gradient at _INPUT_POSITIONS among the VJP's results.
    """
    for name, rule in sot._RULES.items():
        first = next(iter(inspect.signature(rule.prepare).parameters))
        assert first == rule.input_name == sot._INPUT_NAMES[name], name
        assert rule.differentiable[sot._INPUT_POSITIONS[name]] == rule.input_name, name


def test_calls_with_nothing_to_differentiate_give_the_same_values_without_a_graph():
    x = X.clone().requires_grad_()
    with_graph = sot.soft_topk(x, 2.5, 0.6, dim=0)
    with torch.no_grad():
        no_grad = sot.soft_topk(x, 2.5, 0.6, dim=0)
    constant = sot.soft_topk(X, 2.5, 0.6, dim=0)
    for out in (no_grad, constant):
        assert out.grad_fn is None and not out.requires_grad
        torch.testing.assert_close(out, with_graph.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(7,), (1, 7), (8, 7), (2, 3, 7)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name, extra", [("soft_rank", ()), ("soft_sort", ()), ("soft_topk", (2,))])
def test_plain_backward_forms_no_alpha_gradient_and_keeps_the_input_gradients_bits(
    name, extra, shape, dtype
):
    """An alpha given as a number: the plain backward asks the rule for no alpha gradient and
    gives the NumPy pullback's input gradient to the bit."""
    x = _randn(*shape, dtype=dtype)
    v = _randn(*shape, dtype=dtype)
    xg = x.clone().requires_grad_()
    out = getattr(sot, name)(xg, *extra, 0.5)
    assert type(out.grad_fn).__name__ == "_PlainOperationBackward"
    context = out.grad_fn.call.ctx
    assert context.alpha_wanted
    (grad,) = torch.autograd.grad(out, xg, v)
    assert not context.alpha_wanted
    _, pullback = so.vjp(getattr(so, name), x.numpy(), *extra, 0.5)
    expected = pullback(v.numpy())[0]
    assert grad.dtype == dtype and grad.numpy().tobytes() == np.asarray(expected).tobytes()


def test_backward_can_run_twice_with_retain_graph():
    x = X.clone().requires_grad_()
    out = sot.soft_rank(x, 0.5).sum(dim=0)[2]
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    torch.testing.assert_close(x.grad, 2 * first)


def test_torch_compile_fullgraph_matches_eager():
    def model(x, alpha):
        ranks = sot.soft_rank(x, alpha)
        top = sot.soft_topk(x, 2, alpha)
        loss = sot.topk_cross_entropy(x, torch.tensor([0, 1, 2]), [0.5, 0.5], alpha)
        return (ranks * top).sum() + loss

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x1, x2 = X.clone().requires_grad_(), X.clone().requires_grad_()
    a1, a2 = _f64(0.5), _f64(0.5)
    eager = model(x1, a1)
    comp = compiled(x2, a2)
    eager.backward()
    comp.backward()
    torch.testing.assert_close(comp, eager)
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(a2.grad, a1.grad)


def test_torch_compile_with_inductor_runs():
    compiled = torch.compile(lambda x: sot.soft_rank(x, 0.3).square().sum(), fullgraph=True)
    x = X.clone().requires_grad_()
    value = compiled(x)
    value.backward()
    torch.testing.assert_close(value, sot.soft_rank(X, 0.3).square().sum())
    assert x.grad.abs().sum() > 0


def _operator_calls(x, dim=-1):
    """The three custom operators' calls for soft_rank of ``x`` (with a per-row alpha)."""
    import json

    from softorder.bridges.torch import _encode, _forward_op

    spec = _encode("soft_rank", ("x", "alpha"), (("axis", dim), ("descending", False)))
    rows = x.shape[0] if dim == -1 else x.shape[1]
    alpha = torch.full((rows,), 0.5, dtype=x.dtype)
    out, *residuals = _forward_op(spec, [x, alpha])
    ops = torch.ops.softorder
    tangent = torch.ones_like(out)
    return [
        (ops.forward.default, (spec, [x, alpha])),
        (ops.backward.default, (spec, [x, alpha], residuals, tangent)),
        (ops.pushforward.default, (spec, [x, alpha], residuals, json.dumps(["x"]), [x], alpha)),
    ]


@pytest.mark.parametrize("transposed", [False, True])
def test_custom_operators_fakes_match_the_real_outputs(transposed):
    # what torch.compile traces with: a fake's shape and strides must be the real output's
    # (the backward's fake had a transposed input's strides, the pushforward's alpha's shape)
    x = _randn(5, 3).T if transposed else _randn(3, 5)
    for op, args in _operator_calls(x) + _operator_calls(x, dim=0):
        result = torch.library.opcheck(op, args, test_utils=("test_faketensor",))
        assert result == {"test_faketensor": "SUCCESS"}, op


def test_torch_compile_with_inductor_on_a_transposed_input():
    # inductor asserts the backward operator's strides against its fake's (this raised
    # "expected size 6==6, stride 3==1" for any operation on x.T)
    def f(x, alpha):
        return (sot.soft_sort(x.T, alpha, dim=0) * torch.arange(3.0, dtype=x.dtype)).sum()

    x1, x2 = X.clone().requires_grad_(), X.clone().requires_grad_()
    a1, a2 = _f64([0.5, 1.0, 2.0]), _f64([0.5, 1.0, 2.0])
    torch._dynamo.reset()
    comp, eager = torch.compile(f, fullgraph=True)(x2, a2), f(x1, a1)
    comp.backward()
    eager.backward()
    torch.testing.assert_close(comp, eager)
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(a2.grad, a1.grad)


def test_torch_compile_with_dynamic_shapes_and_changing_numbers():
    def model(x, k, q):
        return (sot.soft_topk(x, k, 0.3) * sot.soft_rank(x, 0.2)).sum() + sot.soft_quantile(
            x, q, 0.5
        ).sum()

    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for n, k, q in [(10, 3, 0.3), (17, 5.5, 0.6)]:
        x1 = _randn(4, n).requires_grad_()
        x2 = x1.detach().clone().requires_grad_()
        eager, comp = model(x1, k, q), compiled(x2, k, q)
        eager.backward()
        comp.backward()
        torch.testing.assert_close(comp, eager)
        torch.testing.assert_close(x2.grad, x1.grad)


#: torch.jit.trace is deprecated (since PyTorch 2.10) but still traces
_TRACE_DEPRECATED = pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")


@_TRACE_DEPRECATED
@pytest.mark.parametrize(
    "fn, inputs", [c[1:] for c in GRADCHECK_CASES], ids=[c[0] for c in GRADCHECK_CASES]
)
def test_torch_jit_trace_records_the_operation_not_its_result(fn, inputs):
    # a trace of the NumPy kernels recorded their result as a constant: the traced function
    # gave the first input's values for every later input, and no gradient
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        traced = torch.jit.trace(fn, tuple(t.detach().clone().requires_grad_() for t in inputs))
    package = str(pathlib.Path(so.__file__).parent)
    baked = [w for w in caught if w.category is torch.jit.TracerWarning and package in w.filename]
    assert not baked  # (no value of softorder's taken into the trace as a constant)
    later = [(t.detach() * 1.25 + 0.1).requires_grad_() for t in inputs]
    again = [t.detach().clone().requires_grad_() for t in later]
    got, expected = traced(*later), fn(*again)
    assert torch.equal(got, expected)
    weights = torch.linspace(-1.0, 2.0, got.numel(), dtype=got.dtype).reshape(got.shape)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    for mine, eager in zip(later, again, strict=True):
        assert torch.equal(mine.grad, eager.grad)


@_TRACE_DEPRECATED
def test_torch_jit_trace_takes_labels_and_ranks_as_inputs():
    def losses(z, labels, x, ranks):
        top = sot.topk_cross_entropy(z, labels, [0.5, 0.5], 0.5, reduction="none")
        return top, sot.permutation_cross_entropy(x, ranks, 0.5, reduction="none")

    traced = torch.jit.trace(losses, (LOGITS, LABELS, X, RANKS))
    others = (LOGITS, torch.tensor([6, 0, 1, 5]), X, RANKS.flip(-1))
    for got, expected in zip(traced(*others), losses(*others), strict=True):
        assert torch.equal(got, expected)


@_TRACE_DEPRECATED
def test_forward_mode_through_a_traced_or_exported_graph_is_refused():
    # the custom operator has no forward-mode formula: torch.func.jvp of a traced or exported
    # function gave zero tangents, and forward_ad none; eager forward mode still works
    import warnings

    import torch.autograd.forward_ad as fwAD

    def f(t):
        return sot.soft_rank(t, 0.5)

    traced = torch.jit.trace(f, (X,))
    module = type("M", (torch.nn.Module,), {"forward": lambda self, t: f(t)})()
    with warnings.catch_warnings():  # (PyTorch 2.6's export warns of its lifted constants)
        warnings.simplefilter("ignore", UserWarning)
        exported = torch.export.export(module, (X,)).module()
    tangent = _randn(*X.shape)
    message = "softorder: forward-mode derivatives"
    for graph in (traced, exported):
        with pytest.raises((NotImplementedError, RuntimeError), match=message):
            torch.func.jvp(graph, (X,), (tangent,))
        with fwAD.dual_level(), pytest.raises((NotImplementedError, RuntimeError), match=message):
            graph(fwAD.make_dual(X, tangent))
        assert torch.equal(graph(X), f(X))
    assert torch.func.jvp(f, (X,), (tangent,))[1].abs().sum() > 0


def test_torch_func_transforms():
    from torch.func import grad, jacrev, jvp, vjp

    def f(x, a):
        return (sot.soft_sort(x, a) * torch.arange(6.0, dtype=x.dtype)).sum()

    g = grad(f)(X, _f64(0.5, False))
    x = X.clone().requires_grad_()
    f(x, 0.5).backward()
    torch.testing.assert_close(g, x.grad)

    tangent = _randn(3, 6)
    _, out_dot = jvp(lambda x: sot.soft_rank(x, 0.5), (X,), (tangent,))
    out, pullback = vjp(lambda x: sot.soft_rank(x, 0.5), X)
    cot = _randn(3, 6)
    (x_bar,) = pullback(cot)
    # forward and reverse mode agree: <cot, J t> = <J^T cot, t>
    torch.testing.assert_close((cot * out_dot).sum(), (x_bar * tangent).sum())
    # derivatives under vmap (jacrev = vmap of vjp): tests/test_torch_vmap_derivatives.py
    jac = jacrev(lambda x: sot.soft_rank(x, 0.5))(X[0])
    torch.testing.assert_close(
        jac @ tangent[0], jvp(lambda x: sot.soft_rank(x, 0.5), (X[0],), (tangent[0],))[1]
    )


X3 = _randn(5, 3, 7)


@pytest.mark.parametrize(
    "vmapped, batched",
    [
        # (function vmapped over dim 0 of X3 (and of the extra arguments), the batched call)
        ((lambda t: sot.soft_rank(t, 0.3)), lambda: sot.soft_rank(X3, 0.3)),
        (
            (lambda t: sot.soft_topk(t, 2, 0.3, dim=0)),
            lambda: sot.soft_topk(X3, 2, 0.3, dim=1),
        ),
        (
            (lambda t: sot.soft_quantile(t, torch.tensor([[0.2, 0.5]]), 0.3)),
            lambda: sot.soft_quantile(X3, torch.tensor([[[0.2, 0.5]]]), 0.3),
        ),
        (
            (lambda t: sot.soft_permutation(t, 0.3, dim=0)),
            lambda: sot.soft_permutation(X3, 0.3, dim=1),
        ),
    ],
)
def test_vmap_is_one_batched_call(vmapped, batched):
    torch.testing.assert_close(torch.func.vmap(vmapped)(X3), batched(), rtol=0, atol=0)


def test_vmap_over_alpha_k_labels_and_nested():
    from torch.func import grad, vmap

    alphas = torch.linspace(0.1, 0.5, 5, dtype=torch.float64)
    ks = torch.linspace(1.0, 5.0, 5, dtype=torch.float64)
    labels = torch.randint(0, 7, (5, 3), generator=GEN)
    one_by_one = torch.stack([sot.soft_topk(X3[i], ks[i], alphas[i]) for i in range(5)])
    torch.testing.assert_close(
        vmap(lambda t, k, a: sot.soft_topk(t, k, a))(X3, ks, alphas), one_by_one
    )
    losses = vmap(lambda z, y: sot.topk_cross_entropy(z, y, [0.5, 0.5], 0.5))(X3, labels)
    expected = torch.stack(
        [sot.topk_cross_entropy(X3[i], labels[i], [0.5, 0.5], 0.5) for i in range(5)]
    )
    torch.testing.assert_close(losses, expected)
    nested = vmap(vmap(lambda t: sot.soft_rank(t, 0.3)))(X3)
    torch.testing.assert_close(nested, sot.soft_rank(X3, 0.3))
    # grad of a vmapped function
    g = grad(lambda t: vmap(lambda u: sot.soft_rank(u, 0.3))(t).square().sum())(X3)
    x = X3.clone().requires_grad_()
    sot.soft_rank(x, 0.3).square().sum().backward()
    torch.testing.assert_close(g, x.grad)


def test_forward_ad_dual_tensors_in_alpha():
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        alpha = fwAD.make_dual(_f64(0.5, False), _f64(1.0, False))
        p = sot.soft_topk(X, 2.0, alpha)
        tangent = fwAD.unpack_dual(p).tangent
    _, expected = so.jvp(so.soft_topk, (X.numpy(), 2.0, 0.5), (None, None, 1.0))
    np.testing.assert_allclose(tangent.numpy(), expected, rtol=1e-12, atol=1e-15)


def test_second_derivatives_are_refused_clearly():
    x = X.clone().requires_grad_()
    (g,) = torch.autograd.grad(sot.soft_rank(x, 0.5).square().sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="softorder: second derivatives"):
        g.sum().backward()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: sot.soft_rank(X, 0.5, dim=2), IndexError, "Dimension out of range"),
        (lambda: sot.soft_rank(X, 0.5, dim=1.0), TypeError, "dim must be an integer"),
        (lambda: sot.soft_rank(torch.ones(3, 0), 0.5), ValueError, "empty"),
        (lambda: sot.soft_rank(torch.tensor(1.0), 0.5), ValueError, "at least one dimension"),
        (lambda: sot.soft_rank(torch.arange(4), 0.5), TypeError, "floating point"),
        (lambda: sot.soft_rank(X.numpy(), 0.5), TypeError, "torch.Tensor"),
        (lambda: sot.soft_rank(X, -1.0), ValueError, "alpha must be positive"),
        (lambda: sot.soft_rank(X, torch.tensor(0.0)), ValueError, "alpha must be positive"),
        (lambda: sot.soft_topk(X, 6, 0.5), ValueError, "k must lie strictly between 0 and n=6"),
        (lambda: sot.soft_quantile(X, torch.tensor(1.5), 0.5), ValueError, "q must lie"),
        (lambda: sot.topk_cross_entropy(LOGITS, LABELS.float(), [1.0], 0.5), TypeError, "labels"),
        (lambda: sot.topk_cross_entropy(LOGITS, LABELS, [0.5, 0.6], 0.5), ValueError, "p_k"),
        (lambda: sot.permutation_cross_entropy(X, RANKS[:2], 0.5), ValueError, "target_ranks"),
        (lambda: sot.soft_rank(X.to("meta"), 0.5), NotImplementedError, "no kernels for meta"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_device_without_kernels_is_refused_not_copied():
    # CUDA tensors run the GPU kernels (tests/gpu); other devices have none
    with pytest.raises(NotImplementedError, match="no kernels for mps"):
        sot._backend_for(torch.device("mps"))


def test_nan_row_stays_in_its_row():
    x = X.clone()
    x[1, 2] = float("nan")
    x.requires_grad_()
    r = sot.soft_rank(x, 0.5)
    (r * torch.arange(6.0, dtype=x.dtype)).sum().backward()
    assert torch.isnan(r[1]).all() and torch.isfinite(r[[0, 2]]).all()
    assert torch.isnan(x.grad[1]).all() and torch.isfinite(x.grad[[0, 2]]).all()


def test_modules_train_a_linear_model_on_digits():
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    images = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target)
    train, test = slice(0, 1400), slice(1400, None)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    alpha = torch.nn.Parameter(torch.tensor(1.0))
    loss_fn = sot.TopKCrossEntropyLoss([0.0, 0.0, 0.0, 0.0, 1.0], alpha=alpha)
    assert any(p is alpha for p in loss_fn.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)

    def top5_accuracy():
        with torch.no_grad():
            top5 = model(images[test]).topk(5, dim=1).indices
        return (top5 == labels[test, None]).any(dim=1).float().mean().item()

    with torch.no_grad():
        start = loss_fn(model(images[train]), labels[train]).item()
    for _ in range(60):
        optimizer.zero_grad()
        loss = loss_fn(model(images[train]), labels[train])
        loss.backward()
        optimizer.step()
    assert alpha.grad is not None and float(alpha.grad) != 0.0
    assert loss.item() < 0.5 * start
    assert top5_accuracy() > 0.9  # chance is 0.5


def test_permutation_loss_module_learns_to_order():
    torch.manual_seed(1)
    features = torch.randn(64, 5, 3)
    truth = features @ torch.tensor([1.0, -2.0, 0.5])
    target = torch.argsort(torch.argsort(truth, dim=1), dim=1) + 1
    weights = torch.zeros(3, requires_grad=True)
    loss_fn = sot.PermutationCrossEntropyLoss(alpha=0.1)
    optimizer = torch.optim.SGD([weights], lr=0.5)
    first = None
    for _ in range(40):
        optimizer.zero_grad()
        loss = loss_fn(features @ weights, target)
        first = loss.item() if first is None else first
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.3 * first
    predicted = torch.argsort(torch.argsort(features @ weights, dim=1), dim=1) + 1
    assert (predicted == target).float().mean() > 0.9


@pytest.mark.parametrize("method", ["neuralsort", "softsort", "odd_even_network"])
def test_topk_loss_module_compares_methods_behind_one_interface(method):
    from softorder import baselines

    logits = LOGITS.clone().requires_grad_()
    loss_fn = sot.TopKCrossEntropyLoss([0.5, 0.5], method=method, temperature=0.7)
    loss = loss_fn(logits, LABELS)
    expected = baselines.topk_cross_entropy(
        LOGITS,
        LABELS,
        torch.tensor([0.5, 0.5], dtype=torch.float64),
        method=method,
        temperature=0.7,
    )
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="method must be 'lapsum' or one of"):
        sot.TopKCrossEntropyLoss([1.0], method="bubblesort")
