"""Non-tensor arguments of the PyTorch bridge: non-finite Python floats reach the validation
that names the argument (the call spec encodes every float exactly), and ``dim`` takes any
integer type that ``operator.index`` accepts."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import softorder as so  # noqa: E402
import softorder.bridges.torch as sot  # noqa: E402
from softorder._engine.call import CallSpec  # noqa: E402

X = torch.tensor([[0.5, -1.0, 3.0, 2.0, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)
LABELS = torch.tensor([0, 3])
RANKS = torch.tensor([[3, 1, 5, 4, 2], [1, 2, 3, 4, 5]])
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad", [NAN, INF, -INF, np.float64("nan"), np.float32("inf")], ids=repr)
@pytest.mark.parametrize(
    "call",
    [
        lambda a: sot.soft_rank(X, a),
        lambda a: sot.soft_sort(X, a),
        lambda a: sot.soft_permutation(X, a),
        lambda a: sot.soft_topk(X, 2, a),
        lambda a: sot.log_soft_topk(X, 2, a),
        lambda a: sot.soft_quantile(X, 0.5, a),
        lambda a: sot.topk_cross_entropy(X, LABELS, [0.5, 0.5], a),
        lambda a: sot.permutation_cross_entropy(X, RANKS, a),
        lambda a: sot.TopKCrossEntropyLoss([0.5, 0.5], alpha=a)(X, LABELS),
        lambda a: sot.PermutationCrossEntropyLoss(alpha=a)(X, RANKS),
    ],
    ids=[
        "rank",
        "sort",
        "permutation",
        "topk",
        "log_topk",
        "quantile",
        "topk_ce",
        "perm_ce",
        "TopKCrossEntropyLoss",
        "PermutationCrossEntropyLoss",
    ],
)
def test_non_finite_alpha_is_named(call, bad):
    with pytest.raises(ValueError, match="alpha must be positive and finite"):
        call(bad)


@pytest.mark.parametrize("bad", [NAN, INF, -INF, np.float64("nan")], ids=repr)
def test_non_finite_k_q_and_p_k_are_named(bad):
    with pytest.raises(ValueError, match="k must lie strictly between 0 and n=5"):
        sot.soft_topk(X, bad, 0.5)
    with pytest.raises(ValueError, match="k must lie strictly between 0 and n=5"):
        sot.log_soft_topk(X, [1.0, bad], 0.5)
    with pytest.raises(ValueError, match="q must lie strictly between 0 and 1"):
        sot.soft_quantile(X, bad, 0.5)
    with pytest.raises(ValueError, match="p_k must be a probability distribution"):
        sot.topk_cross_entropy(X, LABELS, [0.5, bad], 0.5)
    with pytest.raises(ValueError, match="p_k must be a probability distribution"):
        sot.TopKCrossEntropyLoss([bad, 0.5])(X, LABELS)


@pytest.mark.parametrize(
    "value", [NAN, INF, -INF, -0.0, 0.0, 5e-324, 1.7976931348623157e308, 0.1 + 0.2, 1 / 3]
)
def test_call_spec_round_trips_every_float_exactly(value):
    spec = CallSpec.decode(
        sot._encode("soft_topk", ("x",), (("k", value), ("alpha", [value, 1.0])))
    )
    names, statics = spec.names, dict(spec.statics)
    assert names == ("x",)
    for got in (statics["k"], statics["alpha"][0]):
        assert type(got) is float
        if math.isnan(value):
            assert math.isnan(got)
        else:
            assert got.hex() == value.hex()  # bit for bit, the sign of zero included


def test_finite_numpy_scalars_give_the_numpy_api_values():
    got = sot.soft_topk(X, np.float64(2.5), np.float32(0.5))
    np.testing.assert_array_equal(got.numpy(), so.soft_topk(X.numpy(), 2.5, np.float32(0.5)))


@pytest.mark.parametrize(
    "dim", [np.int64(1), np.int32(-1), np.uint8(1), np.int16(0), torch.tensor(1)], ids=repr
)
def test_dim_takes_any_integer_index(dim):
    index = int(dim)
    ranks = sot.soft_rank(X, 0.5, dim=dim)
    np.testing.assert_array_equal(ranks.numpy(), so.soft_rank(X.numpy(), 0.5, axis=index))
    x = X.clone().requires_grad_()
    sot.soft_topk(x, 1.5, 0.5, dim=dim).square().sum().backward()
    expected = X.clone().requires_grad_()
    sot.soft_topk(expected, 1.5, 0.5, dim=index).square().sum().backward()
    torch.testing.assert_close(x.grad, expected.grad, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [True, False, np.bool_(True), 1.0, np.float64(1.0), "1", None])
def test_dim_refuses_bool_and_non_integers(dim):
    with pytest.raises(TypeError, match="dim must be an integer"):
        sot.soft_rank(X, 0.5, dim=dim)


def test_dim_index_out_of_range_is_an_index_error():
    with pytest.raises(IndexError, match="Dimension out of range"):
        sot.soft_rank(X, 0.5, dim=np.int64(2))


@pytest.mark.parametrize("flag", [np.False_, np.True_])
def test_numpy_bool_flags_act_as_bools(flag):
    expected = sot.soft_topk(X, 2, 0.5, largest=bool(flag))
    torch.testing.assert_close(sot.soft_topk(X, 2, 0.5, largest=flag), expected)
    expected = sot.soft_rank(X, 0.5, descending=bool(flag))
    torch.testing.assert_close(sot.soft_rank(X, 0.5, descending=flag), expected)
    logits, labels = X.float(), LABELS
    expected = sot.topk_cross_entropy(logits, labels, [0.5, 0.5], 1.0, split_top1=bool(flag))
    got = sot.topk_cross_entropy(logits, labels, [0.5, 0.5], 1.0, split_top1=flag)
    torch.testing.assert_close(got, expected)


def test_numpy_bool_k_is_still_refused():
    with pytest.raises(TypeError, match="k"):
        sot.soft_topk(X, np.True_, 0.5)


def test_numpy_scalars_under_torch_compile():
    def ranks(x, alpha):
        return sot.soft_rank(x, alpha)

    def topk(x, k):
        return sot.soft_topk(x, k, 0.5)

    compiled_ranks = torch.compile(ranks, backend="eager", fullgraph=True)
    compiled_topk = torch.compile(topk, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled_ranks(X, np.float64(0.5)), ranks(X, 0.5))
    torch.testing.assert_close(compiled_topk(X, np.int64(2)), topk(X, 2))


@pytest.mark.parametrize("fullgraph", [True, False])
def test_numpy_settings_under_torch_compile_are_refused_naming_softorder(fullgraph):
    def along(x, dim):
        return sot.soft_rank(x, 0.5, dim=dim)

    compiled = torch.compile(along, backend="eager", fullgraph=fullgraph)
    # dynamo wraps the TypeError (InternalTorchDynamoError); its text leads with softorder's,
    # on torch 2.6 as on 2.13 (a plain raise in traced code lost it on 2.6: "Observed exception")
    with pytest.raises(Exception, match="^TypeError: softorder under torch.compile: dim must be"):
        compiled(X, np.int64(1))


@pytest.mark.parametrize(
    ("dim", "error", "text"),
    [
        (
            2,
            IndexError,
            r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)",
        ),
        (-3, IndexError, r"Dimension out of range \(.*, but got -3\)"),
        (1.5, TypeError, "dim must be an integer; got 1.5"),
        (None, TypeError, "dim must be an integer; got None"),
    ],
)
def test_a_bad_dim_under_torch_compile_gets_the_eager_error(dim, error, text):
    # (raised in traced code, dynamo reported an "Observed exception" without the text;
    # reset: a dim that changed between compilations would be a symbol, which gets dynamo's)
    torch.compiler.reset()
    with pytest.raises(error, match=text):
        sot.soft_rank(X, 0.5, dim=dim)
    compiled = torch.compile(
        lambda x: sot.soft_rank(x, 0.5, dim=dim), backend="eager", fullgraph=True
    )
    # (dynamo may wrap the error, InternalTorchDynamoError "TypeError: ..."; either way the
    # eager text comes first, not dynamo's "Observed exception")
    with pytest.raises(Exception, match=rf"^({error.__name__}: )?{text}"):
        compiled(X)


def test_forward_mode_under_torch_compile_is_refused_naming_softorder():
    """Compiled code reaches softorder through custom operators with a reverse-mode formula
    only; PyTorch would give their results zero tangents, so forward mode is refused."""
    tangent = torch.ones_like(X)

    def jvp(x, t):
        return torch.func.jvp(lambda y: sot.soft_sort(y, 0.5), (x,), (t,))[1]

    def dual(x, t):
        with torch.autograd.forward_ad.dual_level():
            out = sot.soft_rank(torch.autograd.forward_ad.make_dual(x, t), 0.5)
            return torch.autograd.forward_ad.unpack_dual(out).tangent

    message = "softorder under torch.compile: forward-mode derivatives"
    for fn in (jvp, dual):
        with pytest.raises(Exception, match=message):
            torch.compile(fn, backend="eager")(X, tangent)
    with pytest.raises(Exception, match=message):
        torch.compile(jvp, backend="eager", fullgraph=True)(X, tangent)
    # eager forward mode is supported, and agrees with a central difference
    eager = jvp(X, tangent)
    h = 1e-6
    central = (sot.soft_sort(X + h * tangent, 0.5) - sot.soft_sort(X - h * tangent, 0.5)) / (2 * h)
    torch.testing.assert_close(eager, central, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("fn", "values"),
    [
        (lambda x, k: sot.soft_topk(x, k, 0.5), ([1.0, 2.0], [2.0, 2.5], (1, 4))),
        (lambda x, k: sot.soft_topk(x, k, 0.5), ([[1.0, 2.0]], [[3.0, 1.5]])),
        (lambda x, q: sot.soft_quantile(x, q, 0.5), ([0.1, 0.9], [0.5, 0.5])),
        (lambda x, a: sot.soft_rank(x, a), ([0.5, 1.0], (2.0, 0.3))),
        (lambda x, d: sot.soft_rank(x, 0.5, dim=d), (0, 1, -1)),
        (lambda x, y: sot.topk_cross_entropy(x, y, [0.5, 0.5], 0.5), ([0, 1], [4, 3])),
        (lambda x, y: sot.topk_cross_entropy(x[0], y, [0.5, 0.5], 0.5), (2, 4)),
        (lambda x, p: sot.topk_cross_entropy(x, [0, 1], p, 0.5), ([0.5, 0.5], [0.2, 0.3, 0.5])),
        (
            lambda x, r: sot.permutation_cross_entropy(x, r, 0.5),
            ([[1, 2, 3, 4, 5]] * 2, [[5, 4, 3, 2, 1], [2, 1, 3, 5, 4]]),
        ),
    ],
)
def test_torch_compile_with_numbers_in_lists_and_dims_that_change_between_calls(fn, values):
    """Dynamo turns Python numbers that change between calls (also inside lists, and a dim)
    into symbols; they raised "assume_constant_result argument conversion failed" on the second
    call, and an int label of one row "labels must be an integer array" on the first.
    """
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    for value in values:
        torch.testing.assert_close(compiled(X, value), fn(X, value), rtol=0, atol=0)


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev"])
def test_torch_func_transforms_under_torch_compile_are_refused_naming_softorder(transform):
    """The compiled path's custom operators take no torch.func transform: PyTorch raised
    "RuntimeError when making fake tensor call ... Batching rule not implemented for
    softorder::forward" (or "must override the setup_context staticmethod"), with or without
    fullgraph; now softorder's NotImplementedError, and the same transform eager still works.
    """
    f = {
        "vmap": torch.func.vmap(lambda x: sot.soft_rank(x, 0.5)),
        "grad": torch.func.grad(lambda x: sot.soft_rank(x, 0.5).square().sum()),
        "jacrev": torch.func.jacrev(lambda x: sot.soft_topk(x, 2, 0.5)),
    }[transform]
    message = "^NotImplementedError: softorder under torch.compile: torch.func transforms"
    for fullgraph in (False, True):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(f, backend="eager", fullgraph=fullgraph)(X)
    assert f(X).shape[0] == X.shape[0]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_narrow_float_is_computed_in_float32(dtype):
    # the engine's dtype policy (compute_dtype): float8 too, not only float16 and bfloat16
    x = X.to(dtype)
    out = sot.soft_rank(x, 0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, sot.soft_rank(x.float(), 0.5).to(dtype), rtol=0, atol=0)
    alpha = torch.tensor(0.5).to(dtype)
    torch.testing.assert_close(sot.soft_rank(X, alpha), sot.soft_rank(X, 0.5), rtol=0, atol=0)


def test_a_bool_k_is_refused_under_torch_compile_as_in_eager_mode():
    compiled = torch.compile(lambda x: sot.soft_topk(x, True, 0.5), backend="eager")
    with pytest.raises(TypeError, match="k must be a real number or array, not a bool"):
        sot.soft_topk(X, True, 0.5)
    with pytest.raises(Exception, match="k must be a real number or array, not a bool"):
        compiled(X)


def test_bad_settings_are_refused_before_the_call_by_the_engine():
    # checks.split_arguments: the same messages as the rules', for every route
    with pytest.raises(TypeError, match="largest must be a bool"):
        sot.soft_topk(X, 2, 0.5, largest="yes")
    with pytest.raises(ValueError, match="reduction must be one of"):
        sot.permutation_cross_entropy(X, RANKS, 0.5, reduction="avg")
    with pytest.raises(TypeError, match="alpha must be a real number, a sequence of them or a"):
        sot.soft_rank(X, np.ones(2))


def test_an_empty_k_gives_an_empty_result_and_zero_gradients():
    x = X.clone().requires_grad_()
    k = torch.zeros(1, 0, dtype=torch.float64, requires_grad=True)
    out = sot.soft_topk(x, k, 0.5)
    assert out.shape == (2, 0, 5)
    out.sum().backward()
    assert not x.grad.any() and k.grad.shape == (1, 0)


P_K = torch.tensor([0.5, 0.5], dtype=torch.float64)


def _loss(logits, p_k):
    return sot.topk_cross_entropy(logits, LABELS, p_k, 0.5)


def test_a_derivative_in_p_k_is_refused_naming_softorder():
    """The loss has no derivative in p_k: asking for one raises in every mode, where PyTorch
    would leave the gradient out (None) or take the tangent as zero."""
    message = "^softorder: topk_cross_entropy has no derivative in p_k"
    p_k = P_K.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match=message):
        _loss(X, p_k).backward()
    with pytest.raises(NotImplementedError, match=message):
        torch.func.grad(lambda p: _loss(X, p))(P_K)
    with pytest.raises(NotImplementedError, match=message):
        torch.func.jvp(lambda p: _loss(X, p), (P_K,), (torch.ones(2, dtype=torch.float64),))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(P_K, torch.ones(2, dtype=torch.float64))
        with pytest.raises(NotImplementedError, match=message):
            _loss(X, dual)
    compiled = torch.compile(_loss, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="^NotImplementedError: " + message[1:]):
        compiled(X.clone().requires_grad_(), p_k)


def test_derivatives_in_logits_go_on_with_a_constant_p_k():
    logits = X.clone().requires_grad_()
    _loss(logits, P_K).backward()
    expected = torch.from_numpy(
        so.vjp(so.topk_cross_entropy, X.numpy(), LABELS.numpy(), P_K.numpy(), 0.5)[1](1.0)[0]
    )
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=0)
    torch.testing.assert_close(torch.func.grad(lambda x: _loss(x, P_K))(X), expected)
    tangent = torch.ones_like(X)
    _, jvp = torch.func.jvp(lambda x: _loss(x, P_K), (X,), (tangent,))
    torch.testing.assert_close(jvp, (expected * tangent).sum())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_narrow_p_k_is_accepted_as_the_numpy_api_accepts_it(dtype):
    """Narrow tensors are computed in float32; p_k keeps its own dtype's tolerance."""
    thirds = torch.full((3,), 1 / 3, dtype=dtype)
    expected = so.topk_cross_entropy(X.numpy(), LABELS.numpy(), thirds.double().numpy(), 0.5)
    torch.testing.assert_close(
        sot.topk_cross_entropy(X, LABELS, thirds, 0.5).item(), float(expected)
    )
    loss = sot.TopKCrossEntropyLoss([0.2, 0.3, 0.5], alpha=0.5).to(dtype)
    assert loss(X.to(dtype), LABELS).dtype == dtype


@pytest.mark.parametrize("p_k", [[0.5, 0.5], (0.5, 0.5), P_K, P_K.float()])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_losses_common_case_takes_labels_ranks_and_p_k_as_data(p_k, dtype, monkeypatch):
    """Integer labels and ranks, and a p_k list or buffer, reach the rules as NumPy data (no
    split of the arguments, one autograd input): the values and gradients of the NumPy API,
    bit for bit, and the caller's tensors changed after the forward pass change nothing."""
    monkeypatch.setattr(sot.checks, "split_arguments", None)  # (the general path's first step)
    x = X.to(dtype)
    labels, ranks = LABELS.clone(), RANKS.clone()
    logits = x.clone().requires_grad_()
    loss = sot.topk_cross_entropy(logits, labels, p_k, 0.5)
    scores = x.clone().requires_grad_()
    perm = sot.permutation_cross_entropy(scores, ranks, 0.5, reduction="sum")
    labels[:] = 1  # (in place, between the forward and backward passes)
    ranks[:] = ranks.flip(-1)
    (loss + perm).backward()
    p = np.asarray(p_k if isinstance(p_k, list | tuple) else p_k.numpy())
    value, pullback = so.vjp(so.topk_cross_entropy, x.numpy(), LABELS.numpy(), p, 0.5)
    assert loss.item() == value and loss.dtype == dtype
    assert np.array_equal(logits.grad.numpy(), pullback(np.ones((), x.numpy().dtype))[0])
    value, pullback = so.vjp(
        so.permutation_cross_entropy, x.numpy(), RANKS.numpy(), 0.5, reduction="sum"
    )
    assert perm.item() == value
    assert np.array_equal(scores.grad.numpy(), pullback(np.ones((), x.numpy().dtype))[0])


def test_torch_fx_symbolic_trace_is_refused_naming_softorder_and_a_way_out():
    class Scores(torch.nn.Module):
        def forward(self, x):
            return sot.soft_rank(x, 0.5) * 2

    with pytest.raises(TypeError, match=r"softorder: torch.fx.symbolic_trace .* soft_rank"):
        torch.fx.symbolic_trace(Scores())


def test_the_way_out_for_torch_fx_a_wrapped_operation_is_a_leaf_of_the_graph():
    from tests import fx_leaf

    graph = torch.fx.symbolic_trace(fx_leaf.Scores())
    x = X.clone().requires_grad_(True)
    out = graph(x)
    torch.testing.assert_close(out, sot.soft_rank(X, 0.5) * 2)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
