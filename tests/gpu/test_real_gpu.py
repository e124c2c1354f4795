"""The PyTorch bridge on a real GPU: skipped (with the reason) where there is none.

Each operation on CUDA tensors must equal the CPU result, keep the device and dtype, run on
the caller's current stream, and compile with ``torch.compile``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)

import softorder.bridges.torch as sot  # noqa: E402

X = torch.tensor(
    [[0.3, -1.2, 2.0, 0.7, 0.7], [1.0, 5.0, -3.0, 0.0, 2.5], [0.1, float("nan"), 0.2, 0.3, 0.4]]
)
CASES = {
    "soft_topk": lambda x: sot.soft_topk(x, 2, 0.5),
    "log_soft_topk": lambda x: sot.log_soft_topk(x, torch.tensor([[1.0, 3.0]]), 0.5),
    "soft_rank": lambda x: sot.soft_rank(x, 0.5),
    "soft_sort": lambda x: sot.soft_sort(x, 0.5, descending=True),
    "soft_quantile": lambda x: sot.soft_quantile(x, 0.3, 0.5),
    "soft_permutation": lambda x: sot.soft_permutation(x, 0.5),
    "topk_cross_entropy": lambda x: sot.topk_cross_entropy(
        x, torch.tensor([0, 1, 2], device=x.device), [0.5, 0.5], 0.5, reduction="sum"
    ),
    "permutation_cross_entropy": lambda x: sot.permutation_cross_entropy(
        x, torch.arange(1, 6, device=x.device).expand(3, 5), 0.5, reduction="sum"
    ),
}


def _value_and_grad(fn, x):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    weights = torch.linspace(-1.0, 2.0, out.numel(), device=x.device).reshape(out.shape)
    (grad,) = torch.autograd.grad((out * weights.to(out.dtype)).nansum(), x)
    return out.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_equals_cpu(name, dtype):
    x = X.to(dtype)
    expected, expected_grad = _value_and_grad(CASES[name], x)
    out, grad = _value_and_grad(CASES[name], x.cuda())
    assert out.device.type == "cuda" and out.dtype == dtype
    assert grad.device.type == "cuda" and grad.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(out.cpu(), expected, equal_nan=True, **tol)
    torch.testing.assert_close(grad.cpu(), expected_grad, equal_nan=True, **tol)


def test_runs_on_the_current_stream():
    x = torch.randn(64, 1000, device="cuda")
    expected = sot.soft_rank(x, 0.1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = x * 1.0  # ordered on `stream`: the kernels must follow it, not the default stream
        out = sot.soft_rank(y, 0.1)
    stream.synchronize()
    torch.testing.assert_close(out, expected)


def test_large_rows_span_many_blocks():
    x = torch.randn(2, 300_000, device="cuda", dtype=torch.float64)
    out, grad = _value_and_grad(lambda x: sot.soft_topk(x, 1000.0, 0.01), x)
    expected, expected_grad = _value_and_grad(lambda x: sot.soft_topk(x, 1000.0, 0.01), x.cpu())
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(grad.cpu(), expected_grad)


def test_torch_compile_on_cuda():
    def f(x):
        return sot.soft_rank(x, 0.5).pow(2).sum()

    x = torch.randn(8, 100, device="cuda", requires_grad=True)
    expected = torch.autograd.grad(f(x), x)[0]
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(x), x)[0]
    torch.testing.assert_close(got, expected)


def test_numpy_api_on_numba_device_arrays():
    """Plain device arrays (``__cuda_array_interface__``) go through the same rules."""
    import numpy as np
    from numba import cuda

    import softorder

    x = np.random.default_rng(0).normal(size=(5, 7))
    d = cuda.to_device(x)
    cases = [(d, x), (cuda.to_device(np.asfortranarray(x)), x), (d[:, ::-1], x[:, ::-1])]
    for device_array, host in cases:
        out = softorder.soft_rank(device_array, 0.5)
        np.testing.assert_allclose(out.copy_to_host(), softorder.soft_rank(host, 0.5), rtol=1e-12)
    _, pullback = softorder.vjp(softorder.soft_topk, d, 2.0, 0.5)
    _, expected_pullback = softorder.vjp(softorder.soft_topk, x, 2.0, 0.5)
    got = pullback(cuda.to_device(np.ones_like(x)))
    for value, want in zip(got, expected_pullback(np.ones_like(x)), strict=True):
        value = value.copy_to_host() if hasattr(value, "copy_to_host") else value
        np.testing.assert_allclose(value, want, rtol=1e-10, atol=1e-12)
