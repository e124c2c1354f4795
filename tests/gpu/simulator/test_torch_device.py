"""The PyTorch bridge's device path (rules on tensors, torch.sort, GPU kernels), end to end.

Without a GPU, CPU tensors are routed through the device path: the same code a CUDA tensor
takes (:mod:`softorder.bridges._torch_device`), with the kernels in numba's simulator. Values
and gradients must equal the CPU path's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import softorder.bridges.torch as sot
from softorder._engine import backend as _backend
from softorder.bridges import _torch_device


@contextlib.contextmanager
def device_path(monkeypatch):
    """Route CPU tensors through the device backend; count the GPU kernel calls."""
    lookup = _torch_device.device_type_lookup("cpu")
    calls = []
    original = _torch_device._Kernels.__getattr__

    def counting(self, name):
        calls.append(name)
        return original(self, name)

    _backend.register(lookup)
    with monkeypatch.context() as patch:
        patch.setattr(sot, "_ON_DEVICE", {"cuda", "cpu"})
        patch.setattr(_torch_device._Kernels, "__getattr__", counting)
        try:
            yield calls
        finally:
            _backend.unregister(lookup)


def value_and_grads(fn, *tensors):
    """``fn(*tensors)`` and the gradients of a fixed weighting of it, for each tensor."""
    tensors = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    out = fn(*tensors)
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    wanted = [t for t in tensors if t.requires_grad]
    grads = torch.autograd.grad((out * weights).sum(), wanted)
    return out.detach(), grads


def assert_same_on_device(monkeypatch, fn, *tensors, kernels: set):
    expected, expected_grads = value_and_grads(fn, *tensors)
    with device_path(monkeypatch) as calls:
        out, grads = value_and_grads(fn, *tensors)
    assert kernels <= set(calls), calls
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7, equal_nan=True)
    for g, e in zip(grads, expected_grads, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7, equal_nan=True)


X = torch.tensor(
    [[0.3, -1.2, 2.0, 0.7, 0.7], [1.0, 5.0, -3.0, 0.0, 2.5], [0.1, float("nan"), 0.2, 0.3, 0.4]],
    dtype=torch.float64,
)


def test_soft_rank_float32_per_row_alpha(monkeypatch):
    alpha = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float32, requires_grad=True)
    assert_same_on_device(
        monkeypatch,
        lambda x, a: sot.soft_rank(x, a),
        X.float().requires_grad_(),
        alpha,
        kernels={"rank_forward", "rank_vjp"},
    )


def test_soft_topk_several_k_with_gradient_in_k(monkeypatch):
    k = torch.tensor([[1.0, 2.5]], dtype=torch.float64, requires_grad=True)
    assert_same_on_device(
        monkeypatch,
        lambda x, k: sot.soft_topk(x, k, 0.5),
        X.clone().requires_grad_(),
        k,
        kernels={"topk_forward", "topk_vjp"},
    )


def test_log_soft_topk_smallest(monkeypatch):
    assert_same_on_device(
        monkeypatch,
        lambda x: sot.log_soft_topk(x, 2, 0.3, largest=False),
        X.clone().requires_grad_(),
        kernels={"topk_forward", "topk_vjp"},
    )


def test_topk_cross_entropy_split(monkeypatch):
    labels = torch.tensor([0, 4, 2])
    alpha = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    assert_same_on_device(
        monkeypatch,
        lambda x, a: sot.topk_cross_entropy(x, labels, [0.5, 0.3, 0.2], a, split_top1=True),
        X.clone().requires_grad_(),
        alpha,
        kernels={"topk_loss_forward", "topk_loss_vjp"},
    )


def test_soft_sort_descending_along_dim0(monkeypatch):
    assert_same_on_device(
        monkeypatch,
        lambda x: sot.soft_sort(x, 0.3, dim=0, descending=True),
        X.T.contiguous().requires_grad_(),
        kernels={"inverse_kernel", "inverse_vjp"},
    )


def test_soft_quantile_several_q(monkeypatch):
    q = torch.tensor([[0.25, 0.5, 0.9]], dtype=torch.float64, requires_grad=True)
    assert_same_on_device(
        monkeypatch,
        lambda x, q: sot.soft_quantile(x[:2], q, 0.4),
        X.clone().requires_grad_(),
        q,
        kernels={"inverse_kernel", "inverse_vjp"},
    )


def test_soft_permutation(monkeypatch):
    assert_same_on_device(
        monkeypatch,
        lambda x: sot.soft_permutation(x[:2, :4], 0.5),
        X.clone().requires_grad_(),
        kernels={"permutation_forward", "permutation_vjp"},
    )


def test_permutation_cross_entropy(monkeypatch):
    ranks = torch.tensor([[2, 1, 4, 3], [1, 2, 3, 4]])
    assert_same_on_device(
        monkeypatch,
        lambda x: sot.permutation_cross_entropy(x[:2, :4], ranks, 0.5),
        X.clone().requires_grad_(),
        kernels={"permutation_loss_forward", "permutation_loss_vjp"},
    )


def test_forward_mode_on_device(monkeypatch):
    x = X[:2].clone()
    tangent = torch.linspace(-1.0, 1.0, x.numel(), dtype=x.dtype).reshape(x.shape)
    expected = torch.func.jvp(lambda x: sot.soft_rank(x, 0.5), (x,), (tangent,))
    with device_path(monkeypatch) as calls:
        out = torch.func.jvp(lambda x: sot.soft_rank(x, 0.5), (x,), (tangent,))
    assert "rank_jvp" in calls
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_bad_input_is_refused_before_any_kernel(monkeypatch):
    with device_path(monkeypatch) as calls:
        with pytest.raises(ValueError, match="alpha"):
            sot.soft_rank(X, -1.0)
    assert calls == []


def test_torch_compile_fullgraph_on_device(monkeypatch):
    def f(x):
        return (sot.soft_rank(x, 0.5) * torch.arange(5.0, dtype=x.dtype)).sum()

    x = X[:2].clone().requires_grad_()
    expected = torch.autograd.grad(f(x), x)[0]
    torch._dynamo.reset()
    with device_path(monkeypatch) as calls:
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        got = torch.autograd.grad(compiled(x), x)[0]
    assert {"rank_forward", "rank_vjp"} <= set(calls)
    torch.testing.assert_close(got, expected)


def test_operators_outputs_are_contiguous_as_their_fakes_say(monkeypatch):
    # along dim 0 the device result is a moved view: torch.compile with inductor asserted its
    # strides against the fake's ("expected size 3==3, stride 1==5")
    from softorder.bridges.torch import _encode, _forward_op

    spec = _encode("soft_rank", ("x", "alpha"), (("axis", 0), ("descending", False)))
    x, alpha = X[:2].clone(), torch.tensor(0.5, dtype=torch.float64)
    with device_path(monkeypatch) as calls:
        out, *residuals = _forward_op(spec, [x, alpha])
        backward = (spec, [x, alpha], residuals, torch.ones_like(out))
        for op, args in [
            (torch.ops.softorder.forward.default, (spec, [x, alpha])),
            (torch.ops.softorder.backward.default, backward),
        ]:
            result = torch.library.opcheck(op, args, test_utils=("test_faketensor",))
            assert result == {"test_faketensor": "SUCCESS"}, op
    assert "rank_forward" in calls
