"""The NumPy API on plain device arrays (:mod:`softorder._engine.backends.numba_cuda`), in numba's
simulator: every operation, its VJP and a JVP on ``cuda.to_device(x)`` must equal the NumPy
API on ``x``, return device arrays of the input's dtype and leave the input alone; and the
device merge sort must order rows as ``np.argsort(kind="stable")``.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import softorder
from softorder._engine import backend as _backend
from softorder._engine.backends import numba_cuda as backend
from softorder.core.cuda import sort_rows

INF, NAN = np.inf, np.nan
TOL = {"rtol": 1e-9, "atol": 1e-11}

X = np.array([[0.3, -1.2, 2.0, 0.7, 0.7], [1.0, 5.0, -3.0, 0.0, 2.5], [0.1, -0.4, 0.2, INF, 0.4]])
ALPHA = np.array([0.5, 1.0, 2.0])  # one per row


def to_host(a) -> np.ndarray:
    """A result as a host array, after checking it is a device array."""
    assert isinstance(a, backend.DeviceArray), type(a)
    return a.copy_to_host()


def weights(shape, dtype=np.float64) -> np.ndarray:
    """A fixed cotangent of ``shape``."""
    return np.linspace(-1.0, 2.0, max(int(np.prod(shape)), 1)).reshape(shape).astype(dtype)


def assert_same(device, host, dtype=None, **tol):
    got = to_host(device)
    expected = np.asarray(host)
    assert got.shape == expected.shape
    assert got.dtype == (expected.dtype if dtype is None else dtype)
    np.testing.assert_allclose(got, expected, equal_nan=True, **(tol or TOL))


def check_vjp(fn, x, *args, device_cotangent=True, tol=None, **kwargs):
    """``softorder.vjp`` of ``fn`` on the device copy of ``x`` equals it on ``x``: the value
    and every gradient; ``x`` on the device is not modified.
    """
    out, pullback = softorder.vjp(fn, x, *args, **kwargs)
    cotangent = weights(np.shape(out), np.asarray(out).dtype)
    expected = pullback(cotangent)
    dx = cuda.to_device(x)
    d_out, d_pullback = softorder.vjp(fn, dx, *args, **kwargs)
    assert_same(d_out, out, **(tol or {}))
    grads = d_pullback(cuda.to_device(cotangent) if device_cotangent else cotangent)
    assert len(grads) == len(expected)
    for g, e in zip(grads, expected, strict=True):
        assert_same(g, e, **(tol or {}))
    np.testing.assert_array_equal(dx.copy_to_host(), x)  # the input is not modified
    return d_out


# --- the merge sort --------------------------------------------------------------------------


def sort_sample(n: int) -> np.ndarray:
    """Rows of length ``n`` with ties, NaN, +-inf and signed zeros."""
    rng = np.random.default_rng(n)
    x = rng.integers(-3, 4, size=(4, n)).astype(np.float64)  # many ties
    x[1] = rng.normal(size=n)
    x[2, ::3] = NAN
    x[2, 1::4] = INF
    x[3, ::2] = -INF
    x[3, 1::5] = -0.0
    return x


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_merge_sort_equals_stable_argsort(n):
    x = sort_sample(n)
    xs = cuda.device_array(x.shape)
    order = cuda.device_array(x.shape, dtype=np.int64)
    d_x = cuda.to_device(x)
    sort_rows.sort_rows(d_x, xs, order)
    expected = np.argsort(x, axis=1, kind="stable")
    np.testing.assert_array_equal(order.copy_to_host(), expected)
    np.testing.assert_array_equal(xs.copy_to_host(), np.take_along_axis(x, expected, 1))
    np.testing.assert_array_equal(d_x.copy_to_host(), x)


def test_backend_sort_rows_and_gather():
    x = sort_sample(7)
    xs, order = backend.DEVICE.sort_rows(cuda.to_device(x))
    expected = np.argsort(x, axis=1, kind="stable")
    np.testing.assert_array_equal(order.copy_to_host(), expected)
    again, same = backend.DEVICE.sort_rows(cuda.to_device(x), expected.astype(np.int32))
    assert same.dtype == np.int64
    np.testing.assert_array_equal(again.copy_to_host(), xs.copy_to_host())


# --- every operation, values and gradients ---------------------------------------------------


def test_lookup_claims_device_arrays_only():
    assert _backend.backend_of(cuda.to_device(X)) is backend.DEVICE
    assert _backend.backend_of(X) is _backend.NUMPY
    assert backend.lookup([1.0, 2.0]) is None


@pytest.mark.parametrize("largest", [True, False])
def test_soft_topk_several_k_per_row_alpha(largest):
    k = np.array([[1.0, 2.5, 4.0]])
    check_vjp(softorder.soft_topk, X, k, ALPHA, largest=largest)


@pytest.mark.parametrize("fn", [softorder.soft_topk, softorder.log_soft_topk])
def test_an_empty_k_gives_an_empty_result_and_zero_gradients(fn):
    k = np.zeros((X.shape[0], 0))
    out, pullback = softorder.vjp(fn, cuda.to_device(X), k, ALPHA)
    assert to_host(out).shape == (X.shape[0], 0, X.shape[1])
    x_bar, k_bar, alpha_bar = pullback(cuda.to_device(np.zeros(out.shape)))
    assert_same(x_bar, np.zeros(X.shape))
    assert np.shape(k_bar) == k.shape
    assert_same(alpha_bar, np.zeros(X.shape[0]))


def test_soft_topk_scalar_k_host_cotangent():
    check_vjp(softorder.soft_topk, X, 2, 0.5, device_cotangent=False)


def test_log_soft_topk_k_per_row():
    check_vjp(softorder.log_soft_topk, X, np.array([1.0, 3.0, 2.5]), ALPHA)


@pytest.mark.parametrize("descending", [False, True])
def test_soft_rank(descending):
    check_vjp(softorder.soft_rank, X, ALPHA, descending=descending)


def test_soft_sort_descending():
    check_vjp(softorder.soft_sort, X, ALPHA, descending=True)


@pytest.mark.parametrize("q", [0.3, np.array([[0.2, 0.5, 0.9]])])
def test_soft_quantile(q):
    check_vjp(softorder.soft_quantile, X, q, ALPHA)


def test_soft_permutation():
    check_vjp(softorder.soft_permutation, np.ascontiguousarray(X[:2, :4]), 0.5, descending=True)


@pytest.mark.parametrize(("split", "reduction"), [(False, "mean"), (True, "sum"), (False, "none")])
def test_topk_cross_entropy(split, reduction):
    labels = np.array([0, 1, 3])
    out = check_vjp(
        softorder.topk_cross_entropy,
        X,
        labels,
        [0.5, 0.3, 0.2],
        ALPHA,
        reduction=reduction,
        split_top1=split,
    )
    assert out.shape == ((3,) if reduction == "none" else ())


def test_permutation_cross_entropy():
    target = np.array([[2, 1, 5, 3, 4], [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
    out = check_vjp(
        softorder.permutation_cross_entropy, X, target, ALPHA, reduction="mean", descending=True
    )
    assert out.shape == ()


# --- layouts, dtypes, NaN ------------------------------------------------------------------


def test_middle_axis_of_a_3d_input():
    x = np.random.default_rng(1).normal(size=(2, 4, 3))
    check_vjp(softorder.soft_rank, x, np.array([[0.5, 1.0, 2.0]]), axis=1)
    check_vjp(softorder.soft_topk, x, np.array([[[1.0, 2.5]]]), 0.7, axis=1)


def test_float32_stays_float32():
    x = X.astype(np.float32)
    out = check_vjp(softorder.soft_topk, x, 2.0, ALPHA, tol={"rtol": 1e-6, "atol": 1e-7})
    assert out.dtype == np.float32


def test_integer_input_gives_float64():
    x = np.array([[3, 1, 2, 2], [0, 5, -1, 4]])
    assert check_vjp(softorder.soft_rank, x, 0.5).dtype == np.float64


def test_strided_inputs():
    """F-ordered device arrays and a reversed view (negative strides)."""
    d = cuda.to_device(X)
    assert_same(softorder.soft_rank(d[:, ::-1], 0.5), softorder.soft_rank(X[:, ::-1], 0.5))
    d_t = cuda.to_device(np.asfortranarray(X.T))
    assert_same(softorder.soft_sort(d_t, 0.5, axis=0), softorder.soft_sort(X.T, 0.5, axis=0))
    # F order along the last axis: numba's DeviceNDArray.reshape would read memory order
    x3 = np.asfortranarray(np.random.default_rng(2).normal(size=(2, 2, 3)))
    assert_same(softorder.soft_rank(cuda.to_device(x3), 0.5), softorder.soft_rank(x3, 0.5))


def test_nan_row():
    x = X.copy()
    x[1, 2] = NAN
    check_vjp(softorder.soft_rank, x, ALPHA)
    check_vjp(softorder.soft_topk, x, 2.0, ALPHA)


def test_complex_input_raises_naming_it():
    with pytest.raises(TypeError, match="x must be real"):
        softorder.soft_rank(cuda.to_device(X.astype(np.complex128)), 0.5)


# --- forward mode and saved residuals --------------------------------------------------------


def test_jvp_soft_topk():
    k = np.array([[1.0, 2.5]])
    primals = (X, k, ALPHA)
    tangents = (weights(X.shape), np.array([[0.3, -0.2]]), np.array([0.1, -0.5, 1.0]))
    out, out_dot = softorder.jvp(softorder.soft_topk, primals, tangents)
    device = (cuda.to_device(X), k, ALPHA)
    d_tangents = (cuda.to_device(tangents[0]), *tangents[1:])
    d_out, d_out_dot = softorder.jvp(softorder.soft_topk, device, d_tangents)
    assert_same(d_out, out)
    assert_same(d_out_dot, out_dot)


@pytest.mark.parametrize("fn", [softorder.soft_rank, softorder.soft_quantile])
def test_jvp_negated_or_with_targets(fn):
    args = (0.4,) if fn is softorder.soft_quantile else ()
    kwargs = {} if fn is softorder.soft_quantile else {"descending": True}
    tangents = (weights(X.shape), *((0.2,) if args else ()), np.array([0.3, -0.1, 0.2]))
    out, out_dot = softorder.jvp(fn, (X, *args, ALPHA), tangents, **kwargs)
    d_out, d_out_dot = softorder.jvp(
        fn,
        (cuda.to_device(X), *args, ALPHA),
        (cuda.to_device(tangents[0]), *tangents[1:]),
        **kwargs,
    )
    assert_same(d_out, out)
    assert_same(d_out_dot, out_dot)


def test_jvp_of_a_loss():
    target = np.array([[2, 1, 5, 3, 4], [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
    fn = softorder.permutation_cross_entropy
    tangents = (weights(X.shape), None, np.array([0.1, -0.5, 1.0]))
    out, out_dot = softorder.jvp(fn, (X, target, ALPHA), tangents, reduction="sum")
    d_out, d_out_dot = softorder.jvp(
        fn,
        (cuda.to_device(X), target, ALPHA),
        (cuda.to_device(tangents[0]), *tangents[1:]),
        reduction="sum",
    )
    assert_same(d_out, out)
    assert_same(d_out_dot, out_dot)


def test_residuals_restore_without_sorting_again():
    rule = softorder.soft_topk.rule
    arguments = {"x": cuda.to_device(X), "k": 2.0, "alpha": ALPHA, "axis": -1, "largest": True}
    ctx = rule.prepare(**arguments)
    assert_same(rule.forward(ctx), softorder.soft_topk(X, 2.0, ALPHA))
    # on the host: Rule.restore reads arr.shape[-1], which the simulator's device arrays refuse
    # (numba's DeviceNDArray.shape is a tuple)
    saved = {name: a.copy_to_host() for name, a in rule.residuals(ctx).items()}
    again = rule.restore(arguments, saved)
    cotangent = cuda.to_device(weights(X.shape))
    for g, e in zip(rule.vjp(again, cotangent), rule.vjp(ctx, cotangent), strict=True):
        assert_same(g, e.copy_to_host())


# --- launch configuration --------------------------------------------------------------------


def test_one_element_tiles_are_refused():
    """``configure(threads=1, items=1)`` made every scan recurse on its tiles' totals (as long
    as the row) until RecursionError; it raises now, and leaves the setting alone.
    """
    from softorder.core import cuda as gpu

    with pytest.raises(ValueError, match="at least 2"):
        gpu.configure(threads=1, items=1)
    assert gpu.configure() == {"threads": 4, "items": 2}  # the fixture's, unchanged
    previous = gpu.configure(threads=1, items=2)  # two elements per block: fine
    try:
        assert_same(softorder.soft_rank(cuda.to_device(X), 0.5), softorder.soft_rank(X, 0.5))
    finally:
        gpu.configure(**previous)
