"""The JAX bridge's FFI route (softorder.bridges._jax_ffi) against its callbacks and the NumPy API.

On the CPU, ``soft_rank``, ``soft_topk``, ``log_soft_topk``, ``soft_sort`` and
``soft_quantile`` with a concrete ``alpha`` (and ``k``, or a few ``q``) run as XLA FFI calls
into numba C functions; everything else takes the callbacks (``buffer_callback``, the CPU
kernels on XLA's buffers in place).
Both routes call the same kernels on the same float64 rows, so their values and gradients
must agree bit for bit (and with the NumPy API), under ``jit``, ``grad`` and ``vmap``.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import softorder  # noqa: E402
import softorder.bridges.jax as soj  # noqa: E402
from softorder.bridges import _jax_ffi  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the FFI route is CPU only")

CALLBACK = "xla_buffer_python_cpu_callback"  # buffer_callback, the CPU's callbacks
PURE_CALLBACK = "xla_ffi_python_cpu_callback"  # pure_callback (_IN_PLACE = False)

#: (bridge function, NumPy function, extra positional arguments, keyword arguments)
CASES = {
    "rank": (soj.soft_rank, softorder.soft_rank, (), {}),
    "rank descending": (soj.soft_rank, softorder.soft_rank, (), {"descending": True}),
    "topk": (soj.soft_topk, softorder.soft_topk, (3,), {}),
    "topk smallest": (soj.soft_topk, softorder.soft_topk, (2.5,), {"largest": False}),
    "log topk": (soj.log_soft_topk, softorder.log_soft_topk, (4,), {}),
    "sort": (soj.soft_sort, softorder.soft_sort, (), {}),
    "sort descending": (soj.soft_sort, softorder.soft_sort, (), {"descending": True}),
}


@pytest.fixture
def callbacks(monkeypatch):
    """Run a function through both routes: ``run(f) -> (FFI result, callback result)``."""

    def run(f):
        monkeypatch.setattr(soj, "_FFI_CALLS", "auto")
        ffi = jax.tree.map(np.asarray, f())
        monkeypatch.setattr(soj, "_FFI_CALLS", False)
        callback = jax.tree.map(np.asarray, f())
        monkeypatch.setattr(soj, "_FFI_CALLS", "auto")
        return ffi, callback

    return run


def data(rng, shape, dtype=np.float32):
    """Distinct values (no ties: then the routes agree bit for bit) and one NaN row."""
    x = rng.permutation(np.prod(shape)).reshape(shape) * 0.37 - 5.0
    x = (x + rng.uniform(-0.1, 0.1, shape)).astype(dtype)
    x.reshape(-1, shape[-1])[1, 2] = np.nan
    return x


def equal(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)


def flushed(a):
    """``a`` with subnormal numbers flushed to (signed) zero, as XLA's CPU threads compute, in
    both routes' kernels (FTZ and DAZ on); the NumPy API keeps them.
    """
    a = np.asarray(a)
    return np.where(np.abs(a) < np.finfo(a.dtype).tiny, np.copysign(0, a).astype(a.dtype), a)


def near_flushed(got, expected):
    """``expected`` (:func:`flushed`) where ``got`` differs from it within 1e-300: float64
    values computed from intermediates XLA's threads flush to zero (the handlers' and the
    callbacks' alike) and the NumPy API does not.
    """
    expected = flushed(expected)
    close = np.abs(np.asarray(got, np.float64) - expected) <= 1e-300
    return np.where(close, got, expected).astype(expected.dtype)


def lowered(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


def test_routing_is_decided_at_trace_time(monkeypatch):
    x = jnp.ones((2, 5))
    text = lowered(jax.grad(lambda x: soj.soft_rank(x, 0.5).sum()), x)
    assert text.count("@softorder_rank(") == 2 and CALLBACK not in text  # forward, backward
    assert "@softorder_topk(" in lowered(lambda x: soj.soft_topk(x, [1, 2], 0.5), x)
    text = lowered(jax.grad(lambda x: soj.soft_sort(x, 0.5, descending=True).sum()), x)
    assert text.count("@softorder_sort(") == 2 and CALLBACK not in text
    # a traced alpha of contiguous runs of rows: the FFI route (test_traced_alpha_*)
    assert CALLBACK not in lowered(lambda x, a: soj.soft_rank(x, a), x, 0.5)
    assert CALLBACK not in lowered(lambda x, a: soj.soft_sort(x, a), x, jnp.ones((2, 1)))
    # traced k, an alpha along an inner batch axis (broadcast along an outer one), several k
    # per row, other operations: the callbacks
    assert CALLBACK in lowered(lambda x, k: soj.soft_topk(x, k), x, 2.0)
    x3 = jnp.ones((2, 3, 5))
    assert CALLBACK in lowered(lambda x, a: soj.soft_rank(x, a), x3, jnp.ones(3))
    assert CALLBACK in lowered(lambda x: soj.soft_topk(x, [[1.0, 2.0]], 0.5), x)
    assert CALLBACK in lowered(lambda x: soj.soft_quantile(x, 0.5, 0.5), x)
    monkeypatch.setattr(soj, "_FFI_CALLS", False)
    assert CALLBACK in lowered(lambda x: soj.soft_rank(x, 0.5), x)
    monkeypatch.setattr(soj, "_IN_PLACE", False)
    text = lowered(lambda x: soj.soft_quantile(x, 0.5, 0.5), x)
    assert PURE_CALLBACK in text and CALLBACK not in text


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [9, 50])  # the handlers' insertion sort and radix sort
def test_routes_and_numpy_api_agree_bitwise(case, dtype, n, rng, callbacks):
    bridge, numpy_op, extra, kwargs = CASES[case]
    x = data(rng, (4, n), dtype)
    w = rng.standard_normal((4, n)).astype(dtype)
    alpha = np.array([0.5, 0.25, 1.0, 2.0], dtype)[:, None]  # per row, keepdims; exact

    with jax.enable_x64(dtype == np.float64):

        def step():
            def loss(x):
                return jnp.sum(bridge(x, *extra, alpha, **kwargs) * w)

            value = jax.jit(lambda x: bridge(x, *extra, alpha, **kwargs))(x)
            return value, jax.jit(jax.grad(loss))(x)

        ffi, callback = callbacks(step)
    equal(ffi[0], callback[0])
    equal(ffi[1], callback[1])
    expected, pullback = softorder.vjp(numpy_op, x, *extra, alpha, **kwargs)
    equal(ffi[0], flushed(expected))
    equal(ffi[1], flushed(pullback(w)[0]))
    assert np.isnan(ffi[0][1]).all() and np.isnan(ffi[1][1]).all()  # the NaN row
    assert np.isfinite(ffi[0][[0, 2, 3]]).all() and np.isfinite(ffi[1][[0, 2, 3]]).all()


@pytest.mark.parametrize("case", ["rank", "topk smallest", "sort descending"])
def test_vmap_axis_and_narrow_dtypes(case, rng, callbacks):
    bridge, _, extra, kwargs = CASES[case]
    x = data(rng, (3, 4, 7))

    def vmapped():
        row = jax.vmap(lambda r: bridge(r, *extra, 0.5, **kwargs))
        g = jax.vmap(jax.grad(lambda r: jnp.sum(bridge(r, *extra, 0.5, **kwargs) ** 2)))
        axis0 = jax.jit(lambda x: bridge(x, *extra, 0.5, axis=0, **kwargs))
        half = bridge(jnp.asarray(x, jnp.float16), *extra, 0.5, **kwargs)
        per_row = jax.vmap(lambda r: bridge(r, *extra, np.array([0.5, 1.0, 2.0, 0.25]), **kwargs))
        return row(x), jax.jit(g)(x), axis0(x), half, jax.jit(per_row)(x)

    ffi, callback = callbacks(vmapped)
    for a, b in zip(ffi, callback, strict=True):
        equal(a, b)
    assert ffi[3].dtype == np.float16
    equal(
        ffi[2], np.moveaxis(np.asarray(bridge(np.moveaxis(x, 0, -1), *extra, 0.5, **kwargs)), -1, 0)
    )


def test_vmap_is_one_call_with_the_batch_in_front():
    x = jnp.ones((5, 3, 4))
    text = lowered(jax.vmap(jax.grad(lambda r: soj.soft_rank(r, 0.5).sum())), x)
    assert text.count("@softorder_rank(") == 2  # one forward and one backward call


def test_ties_values_equal_gradients_close(rng):
    """With ties only the order among equal elements differs (the handlers sort stably,
    NumPy's argsort does not): values are bitwise the NumPy API's, gradients equal to
    rounding.
    """
    x = np.round(rng.standard_normal((3, 40)), 1)
    x[0, :5] = 0.0
    x[0, 5] = -0.0
    w = rng.standard_normal((3, 40))
    with jax.enable_x64(True):
        for bridge, numpy_op, extra, kwargs in CASES.values():
            value = bridge(x, *extra, 0.5, **kwargs)

            def loss(x, bridge=bridge, extra=extra, kwargs=kwargs):
                return jnp.sum(bridge(x, *extra, 0.5, **kwargs) * w)

            grad = jax.grad(loss)(x)
            expected, pullback = softorder.vjp(numpy_op, x, *extra, 0.5, **kwargs)
            equal(value, expected)
            np.testing.assert_allclose(grad, pullback(w)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_infinities_nan_and_a_middle_axis(case, dtype, rng, callbacks):
    """+-inf and a NaN row, on a (2, n, 3) batch along its middle axis: the routes agree bit
    for bit, values and gradients, and with the NumPy API (no ties: with ties only the
    order of equal elements can differ: test_ties_values_equal_gradients_close).
    """
    bridge, numpy_op, extra, kwargs = CASES[case]
    x = data(rng, (2, 3, 11), dtype)  # its NaN is at [0, 1, 2]
    x[0, 0, :2] = [np.inf, -np.inf]
    x[1, 2, 4] = -np.inf
    x = np.moveaxis(x, -1, 1)  # along axis 1
    w = rng.standard_normal(x.shape).astype(dtype)

    def f(x):
        return bridge(x, *extra, 0.5, axis=1, **kwargs)

    with jax.enable_x64(dtype == np.float64):
        ffi, callback = callbacks(
            lambda: (jax.jit(f)(x), jax.jit(jax.grad(lambda x: jnp.sum(f(x) * w)))(x))
        )
    equal(ffi[0], callback[0])
    equal(ffi[1], callback[1])
    expected, pullback = softorder.vjp(numpy_op, x, *extra, 0.5, axis=1, **kwargs)
    equal(ffi[0], flushed(expected))
    equal(ffi[1], flushed(pullback(w)[0]))
    assert np.isnan(ffi[0][0, :, 1]).all() and np.isnan(ffi[1][0, :, 1]).all()
    if bridge is soj.soft_sort:
        assert np.isinf(ffi[0][0, :, 0]).sum() == 2 and np.isfinite(ffi[1][0, :, 0]).all()


def bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def _handler(bridge) -> str:
    """How the lowered text names the FFI handler of ``bridge``."""
    return "@softorder_" + {"soft_rank": "rank", "soft_sort": "sort"}.get(bridge.__name__, "topk")


def _value_and_gradient(bridge, extra, kwargs, x, w):
    """The jitted value of ``bridge`` at ``x`` and the jitted gradient of its sum against ``w``."""

    def loss(x):
        return jnp.sum(bridge(x, *extra, 0.5, **kwargs) * w)

    return jax.jit(lambda x: bridge(x, *extra, 0.5, **kwargs))(x), jax.jit(jax.grad(loss))(x)


@pytest.mark.parametrize("case", ["sort", "sort descending", "rank descending", "topk"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_handler_copies_keep_signs_zeros_and_infinities(case, dtype, callbacks):
    """The handlers copy float32 or float64 rows in and out, negated for ``descending`` and
    ``largest``: -0.0 and +-inf in the input, the results and the cotangent come out as the
    callbacks' NumPy negation gives them, to the bit, and so do the NaN rows (their signs
    included: test_nan_rows_have_the_numpy_apis_signs).
    """
    bridge, _, extra, kwargs = CASES[case]
    nan = np.array(np.nan, dtype)
    x = np.array(
        [
            [1.5, -0.0, 0.0, np.inf, -np.inf, 2.5, -3.0, 0.25],
            [1.0, nan, -2.0, 0.5, 3.0, -1.0, 2.0, 0.0],
            [1.0, -nan, -2.0, 0.5, 3.0, -1.0, 2.0, -0.0],
        ],
        dtype,
    )
    w = np.array([[0.5, -0.0, 0.0, 1.0, -1.0, 2.0, -0.25, 3.0]] * 3, dtype)

    def step():
        return _value_and_gradient(bridge, extra, kwargs, x, w)

    with jax.enable_x64(dtype == np.float64):
        ffi, callback = callbacks(step)
    for a, b in zip(ffi, callback, strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(bits(a), bits(b))
    assert np.isnan(ffi[0][1:]).all() and not np.isnan(ffi[0][0]).any()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_rows_have_the_numpy_apis_signs(case, dtype, callbacks):
    """A NaN row gives NaN values and gradients with the NumPy API's sign bits in both
    routes: the NumPy API negates a descending sort's result by a product with -1, which
    keeps a NaN's sign (+NaN), and its gradients by a negation, which flips it.
    """
    bridge, numpy_op, extra, kwargs = CASES[case]
    nan = np.array(np.nan, dtype)
    x = np.array([[1.0, nan, -2.0, 0.5, 3.0], [1.0, -nan, -2.0, 0.5, 3.0]], dtype)
    w = np.array([[0.5, -1.0, 2.0, 1.0, -0.25]] * 2, dtype)

    def step():
        return _value_and_gradient(bridge, extra, kwargs, x, w)

    with jax.enable_x64(dtype == np.float64):
        ffi, callback = callbacks(step)
    expected, pullback = softorder.vjp(numpy_op, x, *extra, 0.5, **kwargs)
    for got in (ffi, callback):
        assert np.isnan(got[0]).all() and np.isnan(got[1]).all()
        np.testing.assert_array_equal(bits(got[0]), bits(np.asarray(expected)))
        np.testing.assert_array_equal(bits(got[1]), bits(pullback(w)[0]))


@pytest.mark.parametrize("case", ["rank", "sort descending", "topk smallest", "log topk"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_large_row_takes_the_ffi_route_and_matches_the_numpy_api(case, dtype, rng):
    """A row of 2**17 + 3 (the handlers' radix sort; below ``FFI_MAX_N``, the FFI route):
    the NumPy API's values and gradients, to the bit, ties included.
    """
    bridge, numpy_op, extra, kwargs = CASES[case]
    n = 2**17 + 3
    x = rng.standard_normal(n).astype(dtype)
    x[::7] = np.round(x[::7], 1)  # ties
    w = rng.standard_normal(n).astype(dtype)

    def loss(x):
        return jnp.sum(bridge(x, *extra, 0.5, **kwargs) * w)

    handler = _handler(bridge)
    with jax.enable_x64(dtype == np.float64):
        text = lowered(jax.grad(loss), x)
        assert text.count(handler + "(") == 2 and CALLBACK not in text
        value, grad = _value_and_gradient(bridge, extra, kwargs, x, w)
    expected, pullback = softorder.vjp(numpy_op, x, *extra, 0.5, **kwargs)
    np.testing.assert_array_equal(bits(value), bits(flushed(expected)))
    np.testing.assert_array_equal(bits(grad), bits(flushed(pullback(w)[0])))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("negate", [False, True])
def test_widen_and_narrow_flip_the_sign_bit_alone(dtype, negate):
    """The handlers' copies (``widen`` into float64, ``narrow`` back) negate by flipping the
    sign bit: every value, NaN of either sign and with a payload included, comes back as
    NumPy's negation gives it.
    """
    import numba

    @numba.njit
    def roundtrip(source, code, negate, wide, target, address, target_address):
        _jax_ffi.widen(wide, address, code, negate)
        _jax_ffi.narrow(target_address, code, wide, negate)

    nan = np.array(np.nan, dtype)
    payload = (bits(nan) | 5).view(dtype)
    source = np.array([1.5, -0.0, 0.0, np.inf, -np.inf, nan, -nan, payload, -payload], dtype)
    wide, target = np.empty(source.size), np.empty_like(source)
    code = _jax_ffi.F32 if dtype == np.float32 else 12
    roundtrip(source, code, negate, wide, target, source.ctypes.data, target.ctypes.data)
    expected = -source.astype(np.float64) if negate else source.astype(np.float64)
    np.testing.assert_array_equal(bits(wide), bits(expected))
    np.testing.assert_array_equal(bits(target), bits(source))  # negated twice, or never


def test_handlers_answer_the_metadata_query_and_skip_other_stages():
    """XLA asks a handler for its API version through a metadata extension (here behind
    another extension) and calls it at stages before execution: it answers, or returns,
    without reading the (here absent) arguments.
    """
    import ctypes

    call = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(_jax_ffi._compile("rank").address)
    metadata = np.full(6, 7, np.int64)
    metadata[0] = 48  # its struct_size
    found = np.array([32, _jax_ffi.METADATA, 0, metadata.ctypes.data], np.int64)
    other = np.array([32, 2, found.ctypes.data, 0], np.int64)
    frame = np.zeros(22, np.int64)
    frame[1] = other.ctypes.data
    assert call(frame.ctypes.data) is None  # NULL: success
    assert list(metadata[[1, 2, 5]]) == [24, 0, 0]
    versions = metadata.view(np.int32)[6:9]
    assert list(versions) == [_jax_ffi.API_MAJOR, _jax_ffi.API_MINOR, 0]  # and no traits
    frame[1] = 0
    for stage in (0, 1, 2):  # XLA's instantiate, prepare and initialize stages
        frame[4] = stage
        assert call(frame.ctypes.data) is None


def test_second_derivatives_refused():
    x = jnp.array([0.3, -1.0, 2.0])
    with pytest.raises(NotImplementedError, match="softorder"):
        jax.hessian(lambda x: soj.soft_rank(x, 0.5).sum())(x)
    with pytest.raises(NotImplementedError, match="softorder"):
        jax.grad(lambda x: jax.grad(lambda x: soj.soft_topk(x, 1, 0.5)[0])(x).sum())(x)


def test_bad_values_still_raise_at_trace_time():
    with pytest.raises(ValueError, match="alpha"):
        jax.jit(lambda x: soj.soft_rank(x, -1.0))(jnp.ones(3))
    with pytest.raises(ValueError, match="k must lie"):
        jax.jit(lambda x: soj.soft_topk(x, 3, 0.5))(jnp.ones(3))


def _shard_child() -> None:  # runs in a child process with 2 host devices
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(8, 6)).astype(np.float32)
    w_np = rng.normal(size=(8, 6)).astype(np.float32)
    x = jax.device_put(x_np, NamedSharding(mesh, P("batch")))
    w = jax.device_put(w_np, NamedSharding(mesh, P("batch")))

    def local_loss(x, w):
        return jnp.sum(soj.soft_topk(x, 2, 0.5) * w)

    sharded = jax.shard_map(
        jax.grad(local_loss), mesh=mesh, in_specs=(P("batch"), P("batch")), out_specs=P("batch")
    )
    step = jax.jit(sharded)
    text = step.lower(x, w).compile().as_text()
    grad = step(x, w)
    _, pullback = softorder.vjp(softorder.soft_topk, x_np, 2, 0.5)
    report = {
        "ffi": "softorder_topk" in text and CALLBACK not in text,
        "gather": "all-gather" in text,
        "equal": bool(np.array_equal(np.asarray(grad), pullback(w_np)[0])),
        "sharded": list(grad.sharding.spec),
    }
    print(json.dumps(report))


def test_shard_map_runs_the_handlers_per_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    code = "import tests.test_jax_ffi as t; t._shard_child()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "ffi": True,
        "gather": False,
        "equal": True,
        "sharded": ["batch"],
    }


def test_rows_longer_than_ffi_max_n_take_the_callbacks(monkeypatch, rng):
    """The route is chosen by the length of the rows when a call is traced: longer than
    ``FFI_MAX_N`` of the operation (2**20 for rank), the callbacks; at most, the FFI route.
    Both give the NumPy API's values and gradients, to the bit.
    """
    limit = soj.FFI_MAX_N["soft_rank"]
    for n, route in ((limit, "@softorder_rank("), (limit + 1, CALLBACK)):
        row = jax.ShapeDtypeStruct((n,), np.float32)  # (traced only)
        text = lowered(jax.grad(lambda x: soj.soft_rank(x, 0.5).sum()), row)
        assert route in text and ("@softorder_" in text) == (route != CALLBACK)
    monkeypatch.setattr(soj, "FFI_MAX_N", dict.fromkeys(soj.FFI_MAX_N, 300))
    for case in ("rank descending", "sort descending", "topk", "log topk"):
        bridge, numpy_op, extra, kwargs = CASES[case]
        handler = _handler(bridge)
        for n, route in ((300, handler), (301, CALLBACK)):
            x = rng.standard_normal((2, n))
            x[:, ::5] = np.round(x[:, ::5], 1)  # ties
            w = rng.standard_normal((2, n))

            def loss(x, bridge=bridge, extra=extra, kwargs=kwargs, w=w):
                return jnp.sum(bridge(x, *extra, 0.5, **kwargs) * w)

            with jax.enable_x64(True):
                text = lowered(jax.grad(loss), x)
                assert text.count(route) == 2 and ("@softorder_" in text) == (route != CALLBACK)
                value, grad = _value_and_gradient(bridge, extra, kwargs, x, w)
            expected, pullback = softorder.vjp(numpy_op, x, *extra, 0.5, **kwargs)
            np.testing.assert_array_equal(bits(value), bits(flushed(expected)))
            np.testing.assert_array_equal(bits(grad), bits(flushed(pullback(w)[0])))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("q", [0.3, [[0.9], [0.05]], np.full((1, 1, 3), [0.25, 0.5, 0.8])])
def test_quantiles_take_the_ffi_route_and_match_the_numpy_api(q, dtype, rng, callbacks):
    """A few quantile levels per row (one for every row, one per row, three for every row),
    along a middle axis of a batch with infinities and a NaN row: the FFI route (forward and
    backward) gives the callbacks' and the NumPy API's values and gradients, to the bit.
    """
    x = data(rng, (2, 3, 40), dtype)  # its NaN is at [0, 1, 2]
    x[0, 0, :2] = [np.inf, -np.inf]
    x = np.moveaxis(x, -1, 1)  # along axis 1
    levels = np.asarray(q, dtype)  # (the levels as the kernels see them in dtype)
    expected, pullback = softorder.vjp(softorder.soft_quantile, x, levels, 0.5, axis=1)
    w = rng.standard_normal(np.shape(expected)).astype(dtype)

    def f(x):
        return soj.soft_quantile(x, q, 0.5, axis=1)

    def loss(x):
        return jnp.sum(f(x) * w)

    with jax.enable_x64(dtype == np.float64):
        text = lowered(jax.grad(loss), x)
        assert text.count("@softorder_quantile(") == 2 and CALLBACK not in text
        ffi, callback = callbacks(lambda: (jax.jit(f)(x), jax.jit(jax.grad(loss))(x)))
    for got in (ffi, callback):
        equal(got[0], flushed(expected))
        equal(got[1], flushed(pullback(w)[0]))
    assert np.isnan(ffi[0][0, ..., 1]).all() and np.isnan(ffi[1][0, :, 1]).all()
    assert np.isfinite(ffi[0][1]).all() and np.isfinite(ffi[1][1]).all()


def test_quantiles_under_vmap_and_the_routes_left_to_the_callbacks(rng, callbacks):
    x = data(rng, (3, 4, 30))

    def vmapped():
        g = jax.vmap(jax.grad(lambda r: jnp.sum(soj.soft_quantile(r, [[0.3, 0.6]], 0.5) ** 2)))
        return jax.jit(g)(x), jax.vmap(lambda r: soj.soft_quantile(r, 0.5, 0.7))(x)

    ffi, callback = callbacks(vmapped)
    for a, b in zip(ffi, callback, strict=True):
        equal(a, b)
    text = lowered(jax.vmap(jax.grad(lambda r: soj.soft_quantile(r, 0.5, 0.5).sum())), x)
    assert text.count("@softorder_quantile(") == 2
    # traced levels, and more levels per row than few_targets allows: the callbacks
    assert CALLBACK in lowered(lambda r, q: soj.soft_quantile(r, q, 0.5), x[0], 0.5)
    many = np.linspace(0.05, 0.95, 5)[None]  # 5 * FEW_TARGETS > 30
    assert not softorder.core.sort.few_targets(5, 30)
    assert CALLBACK in lowered(lambda r: soj.soft_quantile(r, many, 0.5), x[0])


# --- the losses: traced labels and target ranks, checked by the handlers --------------------

#: (bridge loss, NumPy loss, the integer argument's maker, extra positional arguments before
#: alpha, keyword arguments); labels and ranks are traced (arguments of the jitted function)
LOSSES = {
    "topk CE": (soj.topk_cross_entropy, softorder.topk_cross_entropy, "labels", ([0.5, 0.5],), {}),
    "topk CE split, K=3": (
        soj.topk_cross_entropy,
        softorder.topk_cross_entropy,
        "labels",
        ([0.25, 0.5, 0.25],),
        {"split_top1": True},
    ),
    "perm CE": (
        soj.permutation_cross_entropy,
        softorder.permutation_cross_entropy,
        "ranks",
        (),
        {},
    ),
    "perm CE descending": (
        soj.permutation_cross_entropy,
        softorder.permutation_cross_entropy,
        "ranks",
        (),
        {"descending": True},
    ),
}


def integers(rng, kind, batch, n, dtype=np.int32):
    if kind == "labels":
        return rng.integers(0, n, batch).astype(dtype)
    ranks = np.argsort(rng.standard_normal(batch + (n,)), axis=-1) + 1
    return ranks.astype(dtype)


def loss_steps(bridge, extra, kwargs, reduction):
    """Jitted value and gradient (in x) of ``bridge``, the labels or ranks traced."""

    def f(x, labels):
        return bridge(x, labels, *extra, 0.5, reduction=reduction, **kwargs)

    def loss(x, labels, w):
        out = f(x, labels)
        return jnp.sum(out * w) if reduction == "none" else out

    return jax.jit(f), jax.jit(jax.grad(loss))


@pytest.mark.parametrize("case", LOSSES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_losses_take_the_ffi_route_and_match_the_numpy_api(case, dtype, reduction, rng, callbacks):
    """A (2, 3) batch of rows with infinities and a NaN row: the FFI route (forward and
    backward, the labels or ranks traced) gives the callbacks' values and gradients to the
    bit (the reductions in JAX alike), and, per row, the NumPy API's.
    """
    bridge, numpy_op, kind, extra, kwargs = LOSSES[case]
    n = 11
    x = data(rng, (2, 3, n), dtype)  # its NaN is at [0, 1, 2]
    x[0, 0, :2] = [np.inf, -np.inf]
    x[1, 2, 4] = -np.inf
    labels = integers(rng, kind, (2, 3), n)
    w = rng.standard_normal((2, 3)).astype(dtype)
    with jax.enable_x64(dtype == np.float64):
        value, grad = loss_steps(bridge, extra, kwargs, reduction)
        text = jax.jit(grad).lower(x, labels, w).as_text()
        handler = "@softorder_topk_loss(" if kind == "labels" else "@softorder_permutation_loss("
        assert text.count(handler) == 2 and CALLBACK not in text
        ffi, callback = callbacks(lambda: (value(x, labels), grad(x, labels, w)))
        ffi_again = value(x, labels), grad(x, labels, w)  # (compiled: the FFI route)
    equal(ffi[0], callback[0])
    equal(ffi[1], callback[1])
    equal(ffi_again[0], ffi[0])
    expected, pullback = softorder.vjp(numpy_op, x, labels, *extra, 0.5, reduction="none", **kwargs)
    cot = w if reduction == "none" else np.full(w.shape, 1 / w.size if reduction == "mean" else 1)
    if reduction == "none":
        equal(ffi[0], flushed(expected))
    equal(ffi[1], flushed(pullback(cot.astype(dtype))[0]))
    assert np.isnan(ffi[1][0, 1]).all() and np.isfinite(ffi[1][1]).all()


@pytest.mark.parametrize("case", ["topk CE split, K=3", "perm CE descending"])
def test_losses_under_vmap_with_int64_and_narrow_integers(case, rng, callbacks):
    """``vmap`` over a batch of batches (one call), labels or ranks in int64 (x64), int8 and
    uint16 (widened to int32), p_k per row: the routes agree bit for bit.
    """
    bridge, _, kind, extra, kwargs = LOSSES[case]
    n = 9
    x = data(rng, (4, 3, n))
    labels = integers(rng, kind, (4, 3), n)
    if kind == "labels":
        extra = (np.tile(np.asarray(extra[0]), (3, 1)),)  # p_k per row

    def f(x, labels):
        return bridge(x, labels, *extra, 0.5, **kwargs)

    def run():
        out = []
        for dtype in (np.int8, np.uint16, np.int64):
            with jax.enable_x64(dtype == np.int64):
                g = jax.jit(jax.vmap(jax.value_and_grad(f)))
                out += [*g(x, labels.astype(dtype))]
        return out

    text = lowered(jax.vmap(jax.grad(f)), x, labels)
    assert text.count("@softorder_") == 2 and CALLBACK not in text
    ffi, callback = callbacks(run)
    for a, b in zip(ffi, callback, strict=True):
        equal(a, b)


def test_loss_routes_left_to_the_callbacks(rng):
    x = data(rng, (3, 8))
    labels = np.array([1, 2, 3])
    ranks = integers(rng, "ranks", (3,), 8)
    # traced p_k, labels whose dtype int32 cannot hold (uint32 without x64)
    pk = np.array([0.5, 0.5], np.float32)
    assert CALLBACK in lowered(lambda x, p: soj.topk_cross_entropy(x, labels, p, 0.5), x, pk)
    u = labels.astype(np.uint32)
    assert CALLBACK in lowered(lambda x, u: soj.topk_cross_entropy(x, u, [0.5, 0.5], 0.5), x, u)
    # concrete labels and ranks, a traced alpha: the FFI route
    assert "@softorder_topk_loss(" in lowered(
        lambda x, a: soj.topk_cross_entropy(x, labels, [0.5, 0.5], a), x, 0.5
    )
    assert "@softorder_permutation_loss(" in lowered(
        lambda x, a: soj.permutation_cross_entropy(x, ranks, a), x, 0.5
    )
    assert "@softorder_topk_loss(" in lowered(
        lambda x: soj.topk_cross_entropy(x, labels, [0.5, 0.5], 0.5), x
    )
    assert "@softorder_permutation_loss(" in lowered(
        lambda x: soj.permutation_cross_entropy(x, ranks, 0.5), x
    )


#: (loss, bad integers, the message: the NumPy API's, named by softorder)
BAD = [
    ("topk CE", [1, 7, 2], "softorder: labels must lie in [0, 5]; got 7"),
    ("topk CE", [-1, 2, 2], "softorder: labels must lie in [0, 5]; got -1"),
    ("perm CE", [[1, 2, 3, 4, 5, 9]] * 3, "softorder: target_ranks must lie in [1, 6]; got 9"),
    ("perm CE", [[0, 2, 3, 4, 5, 6]] * 3, "softorder: target_ranks must lie in [1, 6]; got 0"),
    (
        "perm CE",
        [[1, 2, 3, 4, 5, 6], [2, 1, 3, 4, 5, 6], [1, 3, 3, 4, 5, 3]],
        "softorder: target_ranks must be a permutation of 1..6 along the last axis (each rank "
        "once); row 2 (of the rows in order, every batch axis flattened) repeats rank 3",
    ),
]


@pytest.mark.parametrize(("case", "bad", "message"), BAD)
@pytest.mark.parametrize("x64", [False, True])
def test_bad_traced_integers_raise_and_the_process_goes_on(case, bad, message, x64, rng):
    """A bad traced label or rank is known only when the handler runs: it returns XLA's
    INVALID_ARGUMENT error with the NumPy API's message, in the forward and in the gradient
    step; the process goes on and the next good call gives the right values.
    """
    bridge, numpy_op, kind, extra, kwargs = LOSSES[case]
    x = data(rng, (3, 6))
    good = integers(rng, kind, (3,), 6)
    value, grad = loss_steps(bridge, extra, kwargs, "none")
    w = np.ones(3, np.float32)
    with jax.enable_x64(x64):
        bad = np.asarray(bad, np.int64 if x64 else np.int32)
        assert "@softorder_" in jax.jit(grad).lower(x, bad, w).as_text()
        for step in (lambda: value(x, bad), lambda: grad(x, bad, w)):
            with pytest.raises(jax.errors.JaxRuntimeError) as raised:
                jax.block_until_ready(step())
            assert str(raised.value) == "INVALID_ARGUMENT: " + message
        got = value(x, good)
    equal(got, flushed(numpy_op(x, good, *extra, 0.5, reduction="none", **kwargs)))
    # a NaN row's ranks are checked too (the kernel does not read them), as the NumPy API does
    if kind == "ranks" and "permutation" in message:
        x[2, 0] = np.nan
        with pytest.raises(jax.errors.JaxRuntimeError, match="repeats rank 3"):
            jax.block_until_ready(value(x, bad))


def test_fail_writes_xlas_error_arguments():
    """``fail`` calls ``XLA_FFI_Error_Create`` (word 6 of the API, word 2 of the call frame)
    with ``{struct_size 28, extension_start NULL, message, INVALID_ARGUMENT}`` and returns
    what it returns; integers are written in decimal, signs and extremes included.
    """
    import ctypes

    import numba

    seen = []

    @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    def create(address):
        words = (ctypes.c_int64 * 3).from_address(address)
        errc = ctypes.c_int32.from_address(address + 24).value
        seen.append((words[0], words[1], ctypes.string_at(words[2]).decode(), errc))
        return 12345

    api = np.zeros(8, np.int64)
    api[6] = ctypes.cast(create, ctypes.c_void_p).value
    frame = np.zeros(16, np.int64)
    frame[2] = api.ctypes.data

    @numba.njit
    def call(frame, a, b, c):
        return _jax_ffi.fail(frame, "softorder: a=", a, ", b=", b, "; c", c, ".")

    low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    assert call(frame.ctypes.data, 0, -7, low) == 12345
    assert call(frame.ctypes.data, high, 1234567890, 10) == 12345
    assert seen == [
        (28, 0, f"softorder: a=0, b=-7; c{low}.", _jax_ffi.INVALID_ARGUMENT),
        (28, 0, f"softorder: a={high}, b=1234567890; c10.", _jax_ffi.INVALID_ARGUMENT),
    ]
    # floats as C's %.17g writes them (every float64 told apart), float32 widened
    seen.clear()

    @numba.njit
    def call_floats(frame, a, b, c):
        return _jax_ffi.fail(frame, "softorder: a=", a, " b=", b, " c=", c)

    tiny = -np.finfo(np.float64).smallest_subnormal
    assert call_floats(frame.ctypes.data, 0.1, np.float32(-2.5), tiny) == 12345
    assert call_floats(frame.ctypes.data, np.nan, np.float32(np.inf), -1e300) == 12345
    assert [message for _, _, message, _ in seen] == [
        "softorder: a=0.10000000000000001 b=-2.5 c=-4.9406564584124654e-324",
        "softorder: a=nan b=inf c=-1.0000000000000001e+300",
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_permutation_loss_rows_left_by_the_ladder_take_the_general_kernel(dtype, rng):
    """Boundaries whose anchors step back (never solved so: made by hand, as in
    test_permutation_ladder) leave the ladder VJP; the handler's backward pass then runs the
    general kernel on those rows (through Python: :func:`_jax_ffi.rows_left`), as the NumPy
    API's ``ladder_loss_vjp`` does, to the bit; a failure there is an XLA error naming
    softorder, and the process goes on.
    """
    from softorder.core import permutation as perm

    n = 40
    x = data(rng, (2, n), dtype)
    x[1, 2] = 1.25  # (no NaN row here)
    ranks = integers(rng, "ranks", (2,), n)
    cot = np.array([1.0, -0.5], dtype)
    with jax.enable_x64(dtype == np.float64):
        kernel = soj._Ffi("permutation_loss")
        alpha = np.full(2, 0.3, dtype)
        arrays = tuple(map(jnp.asarray, (x, alpha, np.zeros(1, np.int32), ranks)))
        _, order, anchor, offset = kernel.forward(arrays, True)
        anchor, offset = np.array(anchor), np.array(offset).view(np.float64)
        anchor[0, 20:] = anchor[0, ::-1][20:]
        offset[0, 20:] = offset[0, ::-1][20:]
        residuals = (order, jnp.asarray(anchor), jnp.asarray(offset.view(np.uint32)))
        (grad,) = kernel.backward(arrays, residuals, jnp.asarray(cot), (0,))
    xs = np.take_along_axis(x.astype(np.float64), np.asarray(order), 1)
    x_bar, alpha_bar = np.empty((2, n)), np.empty(2)
    work = np.empty((2, perm.LADDER_VJP_WORK, n))
    args = (xs, np.asarray(order), alpha.astype(np.float64), ranks, anchor, offset)
    assert perm._ladder_vjp_rows.serial(
        *args, cot.astype(np.float64), x_bar, alpha_bar, work, False
    )
    perm.ladder_loss_vjp(*args, cot.astype(np.float64), x_bar, alpha_bar, work)
    equal(grad, flushed(x_bar.astype(dtype)))

    def broken(*args):
        raise RuntimeError("the general kernel failed")

    with jax.enable_x64(dtype == np.float64), pytest.MonkeyPatch.context() as patch:
        patch.setattr(perm, "ladder_vjp_left_rows", broken)
        with pytest.raises(jax.errors.JaxRuntimeError, match="softorder: permutation_cross"):
            jax.jit(lambda *a: kernel.backward(a[:4], a[4:7], a[7], (0,))[0])(
                *arrays, *residuals, jnp.asarray(cot)
            ).block_until_ready()


def test_precompile_registers_the_loss_handlers():
    """``softorder.precompile(apis=["jax"])`` runs the losses through the FFI route: their
    handlers (and the kernels they call) are compiled and registered with XLA, and so is
    what a learnable alpha's gradient calls.
    """
    _jax_ffi.ALPHA_SUMS.unlink()
    softorder.precompile(
        ["topk_cross_entropy", "permutation_cross_entropy"], apis=["jax"], progress=False
    )
    assert {"softorder_topk_loss", "softorder_permutation_loss"} <= set(_jax_ffi._registered)
    assert _jax_ffi.ALPHA_SUMS.linked("float64")


@pytest.mark.parametrize("case", ["topk CE split, K=3", "perm CE"])
def test_loss_ties_values_equal_gradients_close(case, rng):
    """With ties (the handlers sort stably, NumPy's argsort does not) the losses are the
    NumPy API's to the bit and their gradients equal to rounding.
    """
    bridge, numpy_op, kind, extra, kwargs = LOSSES[case]
    x = np.round(rng.standard_normal((4, 40)), 1)
    x[0, :6] = 0.0
    x[1, ::2] = 1.0
    labels = integers(rng, kind, (4,), 40)
    with jax.enable_x64(True):
        value, grad = loss_steps(bridge, extra, kwargs, "none")
        got = value(x, labels), grad(x, labels, np.ones(4))
    expected, pullback = softorder.vjp(numpy_op, x, labels, *extra, 0.5, reduction="none", **kwargs)
    equal(got[0], expected)
    np.testing.assert_allclose(got[1], pullback(np.ones(4))[0], rtol=1e-12, atol=1e-12)


# --- a traced alpha: checked by the handlers, its gradient summed by them ---------------------

#: (bridge, NumPy function, extra positional arguments before alpha, keyword arguments); the
#: losses take their labels or ranks first (made per test), then these
ALPHA_OPS = {
    "rank": (soj.soft_rank, softorder.soft_rank, (), {}),
    "topk": (soj.soft_topk, softorder.soft_topk, (1,), {}),
    "log topk smallest": (soj.log_soft_topk, softorder.log_soft_topk, (1,), {"largest": False}),
    "sort": (soj.soft_sort, softorder.soft_sort, (), {}),
    "sort descending": (soj.soft_sort, softorder.soft_sort, (), {"descending": True}),
    "quantile": (soj.soft_quantile, softorder.soft_quantile, (np.float32(0.3),), {}),  # exact
    "topk CE": (soj.topk_cross_entropy, softorder.topk_cross_entropy, ([0.5, 0.5],), {}),
    "perm CE": (soj.permutation_cross_entropy, softorder.permutation_cross_entropy, (), {}),
}

#: (batch shape, n, alpha: a scalar or the shape of values in [0.2, 2), x's scale, a NaN row)
ALPHAS = {
    "scalar": ((3, 4), 100, 0.5, 1.0, False),
    "per row": ((3, 4), 100, (3, 4), 1.0, True),
    "leading axis": ((3, 4), 100, (3, 1), 1.0, True),
    "keepdims": ((3, 4), 100, (3, 1, 1), 1.0, True),  # (x's axes, length 1 along axis)
    "one row": ((), 100, 0.5, 1.0, False),
    "n=2": ((3, 4), 2, 0.5, 1.0, False),
    "n=1000": ((2,), 1000, (2,), 1.0, True),
    "300 rows": ((300,), 2, 0.25, 1.0, False),  # NumPy's pairwise sum splits at 128
    "runs of 150": ((2, 150), 2, (2, 1), 1.0, False),
    "alpha 1e-8": ((3, 4), 100, 1e-8, 1.0, False),
    "alpha 1e8": ((3, 4), 100, 1e8, 1.0, False),
    "values 1e30": ((3, 4), 100, 3e29, 1e30, False),
}


def alpha_call(case, rng, batch, n):
    """``f(x, alpha)`` of the operation ``case`` (a loss with labels or ranks of ``batch``,
    ``reduction="none"``), and its NumPy API twin.
    """
    bridge, numpy_op, extra, kwargs = ALPHA_OPS[case]
    if bridge in (soj.topk_cross_entropy, soj.permutation_cross_entropy):
        kind = "labels" if bridge is soj.topk_cross_entropy else "ranks"
        if kind == "labels" and n < 3:
            extra = ([1.0],)  # (K < n)
        extra = (integers(rng, kind, batch, n), *extra)
        kwargs = {**kwargs, "reduction": "none"}
    return (
        lambda x, a: bridge(x, *extra, a, **kwargs),
        lambda x, a: softorder.vjp(numpy_op, x, *extra, a, **kwargs),
    )


def test_pairwise_sum_is_numpys_sum_bitwise(rng):
    """The handlers' float64 sum of a run of rows' gradients of alpha is NumPy's ``sum`` to
    the bit: values of many magnitudes and signs, so that any other order shows.
    """
    import numba

    stack, partial = np.empty((128, 2), np.int64), np.empty(64)
    call = numba.njit(lambda a, s, c, stack, sums: _jax_ffi._pairwise_sum(a, s, c, stack, sums))

    def total(a, start, count):
        return np.float64(call(a, start, count, stack, partial))

    for count in [*range(1, 300), 1000, 1031, 4096, 100_003]:
        a = rng.standard_normal(count + 5) * 10.0 ** rng.integers(-8, 9, count + 5)
        got, expected = total(a, 3, count), np.sum(a[3 : 3 + count])
        assert bits(got) == bits(expected), count
    assert bits(total(np.array([-0.0, -0.0]), 0, 2)) == bits(np.sum([-0.0, -0.0]))


@pytest.mark.parametrize(
    ("shape", "batch", "axis", "group"),
    [
        ((), (3, 4), -1, (12, True)),
        ((), (), -1, (1, False)),
        ((3, 4), (3, 4), -1, (1, False)),
        ((3, 1), (3, 4), -1, (4, True)),
        ((3, 1, 1), (3, 4), 2, (4, True)),  # keepdims
        ((1, 1), (3, 4), -1, (12, True)),
        ((1,), (3, 1), -1, (3, True)),
        ((2, 1, 1), (2, 5, 6), -1, (30, True)),
        ((2, 1, 6), (2, 5, 6), -1, None),  # along an inner axis, broadcast along an outer one
        ((4,), (3, 4), -1, None),
    ],
)
def test_alpha_group_runs_of_rows(shape, batch, axis, group):
    from softorder._engine.layout import Layout

    layout = Layout.of((*batch, 7) if axis == -1 else (*batch[:axis], 7, *batch[axis:]), axis, "x")
    assert soj._alpha_group(shape, layout) == group


@pytest.mark.parametrize("case", ALPHA_OPS)
@pytest.mark.parametrize("alphas", ALPHAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_traced_alpha_takes_the_ffi_route_and_matches_bitwise(case, alphas, dtype, rng, callbacks):
    """``jit(grad(f, argnums=(0, 1)))`` with a traced alpha runs the handlers (no callback),
    and gives the callbacks' values and gradients, alpha's included, to the bit, and the
    NumPy API's (float64 sums of the rows' gradients of alpha, rounded once).
    """
    batch, n, alpha, scale, nan = ALPHAS[alphas]
    f, numpy_f = alpha_call(case, rng, batch, n)
    x = data(rng, (*batch, max(n, 3)) if batch else (2, n), dtype)[..., :n]  # (NaN: [1, 2])
    if not nan or not batch:
        x = np.nan_to_num(x, nan=-7.125)
    x = (x[0] if not batch else x) * dtype(scale)
    if isinstance(alpha, tuple):
        alpha = rng.uniform(0.2, 2.0, alpha)
    alpha = np.asarray(alpha, dtype)
    out = np.asarray(numpy_f(x, alpha)[0])
    w = rng.standard_normal(out.shape).astype(dtype)

    def loss(x, a):
        return jnp.sum(f(x, a) * w)

    with jax.enable_x64(dtype == np.float64):
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        text = step.lower(x, alpha).as_text()
        concrete = jax.jit(jax.grad(lambda x: loss(x, alpha))).lower(x).as_text()
        if CALLBACK not in concrete:  # (a quantile of rows of 2: not the FFI route's)
            assert text.count("@softorder_") == 2 and CALLBACK not in text
        ffi, callback = callbacks(lambda: (jax.jit(f)(x, alpha), *step(x, alpha)))
    for a, b in zip(ffi, callback, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))
    expected, pullback = numpy_f(x, alpha)
    grads = pullback(w)
    equal(ffi[0], flushed(expected))
    equal(ffi[1], near_flushed(ffi[1], grads[0]))
    assert bits(ffi[2]).tolist() == bits(np.asarray(grads[-1], dtype)).tolist()
    if nan:
        assert np.isnan(ffi[2].reshape(-1)).sum() == 1  # the NaN row's alpha alone


@pytest.mark.parametrize("case", ["rank", "sort descending", "quantile", "topk CE", "perm CE"])
@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0)])
@pytest.mark.parametrize("alpha_shape", [(), (2, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_traced_alpha_under_vmap_sums_per_element(
    case, in_axes, alpha_shape, dtype, rng, callbacks
):
    """``vmap`` over x, over alpha or over both (one call for the batch, alpha tiled where it
    is not vmapped): each vmapped element gets its own float64 sum of its rows' gradients of
    alpha (to the bit the callbacks' and, per element, the NumPy API's); a scalar alpha and a
    leading-axis one; over an alpha that is not vmapped JAX then sums the elements' gradients,
    as it does the callbacks'.
    """
    V, batch, n = 3, (2, 3), 20
    f, numpy_f = alpha_call(case, rng, batch, n)
    xs = np.nan_to_num(data(rng, (V, *batch, n), dtype), nan=-7.125)
    alpha = rng.uniform(0.2, 2.0, (V, *alpha_shape)).astype(dtype)
    x_in = xs if in_axes[0] == 0 else xs[0]
    a_in = alpha if in_axes[1] == 0 else alpha[0]
    w = rng.standard_normal(np.shape(numpy_f(xs[0], alpha[0])[0])).astype(dtype)

    def loss(x, a):
        return jnp.sum(f(x, a) * w)

    per_element = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=in_axes))
    summed = jax.jit(
        jax.grad(lambda x, a: jnp.sum(jax.vmap(loss, in_axes=in_axes)(x, a)), argnums=(0, 1))
    )
    with jax.enable_x64(dtype == np.float64):
        text = per_element.lower(x_in, a_in).as_text()
        assert text.count("@softorder_") == 2 and CALLBACK not in text
        ffi, callback = callbacks(lambda: (*per_element(x_in, a_in), *summed(x_in, a_in)))
    for a, b in zip(ffi, callback, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))
    for v in range(V):
        x_v = xs[v] if in_axes[0] == 0 else xs[0]
        a_v = alpha[v] if in_axes[1] == 0 else alpha[0]
        grads = numpy_f(x_v, a_v)[1](w)
        assert bits(ffi[1][v]).tolist() == bits(np.asarray(grads[-1], dtype)).tolist()
        equal(ffi[0][v], near_flushed(ffi[0][v], grads[0]))


#: (a bad alpha, the message of the handlers' error)
BAD_ALPHAS = [
    (0.0, "softorder: alpha must be positive and finite; got alpha=0"),
    (-2.5, "softorder: alpha must be positive and finite; got alpha=-2.5"),
    (np.nan, "softorder: alpha must be positive and finite; got alpha=nan"),
    (np.inf, "softorder: alpha must be positive and finite; got alpha=inf"),
]


@pytest.mark.parametrize("case", ["rank", "topk", "quantile", "topk CE", "perm CE"])
@pytest.mark.parametrize(("bad", "message"), BAD_ALPHAS)
@pytest.mark.parametrize("x64", [False, True])
def test_bad_traced_alpha_raises_and_the_process_goes_on(case, bad, message, x64, rng):
    """A bad traced alpha (a scalar, or one row's) is known only when the handler runs: XLA's
    INVALID_ARGUMENT with the NumPy API's words, naming softorder and alpha, in the forward
    pass and in the gradient step; the next good call gives the NumPy API's values.
    """
    dtype = np.float64 if x64 else np.float32
    f, numpy_f = alpha_call(case, rng, (3,), 20)
    x = np.nan_to_num(data(rng, (3, 20), dtype), nan=1.0625)
    step = jax.jit(jax.grad(lambda x, a: jnp.sum(f(x, a)), argnums=(0, 1)))
    value = jax.jit(f)
    with jax.enable_x64(x64):
        for alpha in (np.array(bad, dtype), np.array([0.5, bad, 1.0], dtype)):
            assert CALLBACK not in step.lower(x, alpha).as_text()
            for run in (lambda a=alpha: value(x, a), lambda a=alpha: step(x, a)):
                with pytest.raises(jax.errors.JaxRuntimeError) as raised:
                    jax.block_until_ready(run())
                assert str(raised.value) == "INVALID_ARGUMENT: " + message
            with pytest.raises(ValueError, match="alpha must be positive and finite"):
                numpy_f(x, alpha)
        if x64:  # a subnormal alpha (XLA's threads compare it as 0: the handlers read bits)
            tiny = np.array([0.5, 1e-310, 1.0])
            with pytest.raises(ValueError) as numpy_error:
                numpy_f(x, tiny)
            with pytest.raises(jax.errors.JaxRuntimeError) as raised:
                jax.block_until_ready(step(x, tiny))
            expected = str(numpy_error.value).replace("1e-310", "9.9999999999999694e-311")
            assert str(raised.value) == "INVALID_ARGUMENT: softorder: " + expected
        good = np.array([0.5, 0.25, 1.0], dtype)
        got = value(x, good), step(x, good)
    expected, pullback = numpy_f(x, good)
    equal(got[0], flushed(expected))
    grads = pullback(np.ones_like(expected))
    equal(got[1][0], flushed(grads[0]))
    equal(got[1][1], np.asarray(grads[-1], dtype))


def test_traced_alpha_first_derivatives_only():
    """Forward mode and second derivatives in a traced alpha raise as in x."""
    x = jnp.array([[0.3, -1.0, 2.0], [1.0, 0.5, -0.25]])
    alpha = jnp.float32(0.5)

    def loss(x, a):
        return soj.soft_rank(x, a).sum()

    with pytest.raises(TypeError, match="softorder's JAX operations have reverse-mode"):
        jax.jvp(lambda a: loss(x, a), (alpha,), (alpha,))
    with pytest.raises(TypeError, match="softorder's JAX operations have reverse-mode"):
        jax.jit(lambda a: jax.jvp(lambda a: loss(x, a), (a,), (a,)))(alpha)
    with pytest.raises(NotImplementedError, match="softorder"):
        jax.hessian(loss, argnums=1)(x, alpha)
    with pytest.raises(NotImplementedError, match="softorder"):
        jax.jit(jax.grad(lambda a: jax.grad(loss, argnums=1)(x, a)))(alpha)
    with pytest.raises(NotImplementedError, match="softorder"):
        jax.grad(lambda x: jax.grad(loss, argnums=1)(x, alpha))(x)


@pytest.mark.parametrize("case", ALPHA_OPS)
def test_traced_alpha_with_ties_values_equal_gradients_close(case, rng):
    """With ties (the handlers sort stably, NumPy's argsort does not) the values are the
    NumPy API's to the bit and the gradients, alpha's included, equal to rounding.
    """
    x = np.round(rng.standard_normal((4, 40)), 1)
    x[0, :6] = 0.0
    x[1, ::2] = 1.0
    f, numpy_f = alpha_call(case, rng, (4,), 40)
    alpha = np.array([0.5, 0.25, 1.0, 2.0])
    with jax.enable_x64(True):
        value = jax.jit(f)(x, alpha)
        grads = jax.jit(jax.grad(lambda x, a: jnp.sum(f(x, a)), argnums=(0, 1)))(x, alpha)
    expected, pullback = numpy_f(x, alpha)
    equal(value, expected)
    expected_grads = pullback(np.ones_like(expected))
    np.testing.assert_allclose(grads[0], expected_grads[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads[1], expected_grads[-1], rtol=1e-12, atol=1e-12)


def test_alpha_gradient_only_when_asked(rng):
    """The backward pass sums alpha's gradient only when alpha is differentiated: with a
    traced alpha and ``argnums=0`` the backward call has one result, as with a concrete
    alpha; ``argnums=1`` alone gives the same gradient of alpha as ``argnums=(0, 1)``.
    """
    x = np.nan_to_num(data(rng, (2, 5)), nan=0.125)
    alpha = np.float32(0.5)

    def loss(x, a):
        return jnp.sum(soj.soft_rank(x, a) ** 2)

    calls = [
        line
        for line in lowered(jax.grad(loss), x, alpha).splitlines()
        if "@softorder_rank(" in line
    ]
    assert len(calls) == 2 and all("-> (" in c for c in calls[:1]) and "-> (" not in calls[1]
    both = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, alpha)
    equal(jax.jit(jax.grad(loss, argnums=1))(x, alpha), both[1])
    equal(jax.jit(jax.grad(loss))(x, alpha), both[0])


def _alpha_sums_child():
    """In a fresh process: a concrete alpha's gradient compiles no ``alpha_sums``; a traced
    alpha's links it when traced, and gives the NumPy API's gradient of alpha to the bit.
    """
    x = np.random.default_rng(5).standard_normal((3, 7)).astype(np.float32)
    jax.block_until_ready(jax.jit(jax.grad(lambda u: soj.soft_rank(u, 0.5).sum()))(x))
    before = (_jax_ffi.ALPHA_SUMS.linked("float64"), len(_jax_ffi.alpha_sums.overloads))
    grad = jax.jit(jax.grad(lambda u, a: soj.soft_rank(u, a).sum(), argnums=1))
    alpha_bar = np.asarray(grad(x, np.float32(0.5)))
    _, pullback = softorder.vjp(softorder.soft_rank, x, alpha=np.float32(0.5))
    expected = pullback(np.ones_like(x))[1]
    after = (_jax_ffi.ALPHA_SUMS.linked("float64"), len(_jax_ffi.alpha_sums.overloads))
    print(json.dumps({"before": before, "after": after, "equal": bool(alpha_bar == expected)}))


def test_alpha_sums_are_compiled_only_for_a_traced_alpha(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    code = "import tests.test_jax_ffi as t; t._alpha_sums_child()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"before": [False, 0], "after": [True, 1], "equal": True}


def test_a_handler_without_alpha_sums_fails_with_an_error(rng):
    """Were the slot empty when a handler sums alpha's gradient (the bridge links it when it
    traces the call), the handler returns an error naming softorder, never a wrong number.
    """
    x = np.nan_to_num(data(rng, (2, 5)), nan=0.125)
    grad = jax.jit(jax.grad(lambda u, a: soj.soft_rank(u, a).sum(), argnums=1))
    jax.block_until_ready(grad(x, np.float32(0.5)))  # traced, linked, compiled
    _jax_ffi.ALPHA_SUMS.unlink()
    try:
        # (JAX raises XLA's INVALID_ARGUMENT as JaxRuntimeError or, on its fast path,
        # ValueError)
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError)) as raised:
            jax.block_until_ready(grad(x, np.float32(0.25)))
    finally:
        _jax_ffi.link_alpha_sums()
    message = "INVALID_ARGUMENT: softorder: the JAX bridge's alpha_sums is not linked"
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("alpha_shape", "batch"), [((1,), (3, 4)), ((1, 1), (3, 2, 2)), ((1,), (2, 3, 4))]
)
def test_traced_alpha_with_fewer_axes_than_the_batch_sums_as_the_numpy_api(alpha_shape, batch, rng):
    """An alpha of ones with fewer axes than the batch (one value for a run of every row) on
    the FFI route: its gradient is the NumPy API's to the bit, both NumPy's one pairwise sum
    of the rows' gradients (not a sum over the leading axes, then one over the rest).
    """
    n = 5
    alpha = np.full(alpha_shape, 0.7)
    f = jax.jit(jax.grad(lambda x, a, w: jnp.sum(soj.soft_rank(x, a) * w), argnums=1))
    for _ in range(20):  # (a wrong order shows in about half the draws)
        x = rng.standard_normal((*batch, n)) * 10.0 ** rng.integers(-3, 4, (*batch, 1))
        w = rng.standard_normal((*batch, n))
        with jax.enable_x64(True):
            got = np.asarray(f(x, alpha, w))
        expected = softorder.vjp(softorder.soft_rank, x, alpha)[1](w)[1]
        per_row = softorder.vjp(softorder.soft_rank, x, np.full(batch, 0.7))[1](w)[1]
        assert got.shape == expected.shape == alpha_shape
        assert (
            bits(got).tolist()
            == bits(expected).tolist()
            == bits(np.sum(per_row)).reshape(alpha_shape).tolist()
        )
