"""The JAX bridge's device path (``buffer_callback``, numba device arrays, GPU kernels), end to
end, in numba's simulator.

Without a GPU, the switch ``softorder.bridges.jax._DEVICE_CALLBACKS = True`` routes the CPU
backend through the device path: ``buffer_callback`` hands the callbacks XLA's host buffers,
which become the simulator's device arrays, and the GPU kernels run in the simulator. Values
and gradients (under ``jax.jit``) must equal those of the CPU backend's callbacks (also
``buffer_callback``, into the CPU kernels), and the GPU kernels must be the ones that ran.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import softorder.bridges.jax as soj  # noqa: E402
from softorder.core import cuda as gpu  # noqa: E402

#: the kernel entry points of softorder.core.cuda (what the rules call on device arrays)
KERNELS = [name for name in gpu.__all__ if name not in ("SIMULATOR", "configure", "on_stream")]

X = np.array([[0.3, -1.2, 2.0, 0.7, 0.9], [1.0, 5.0, -3.0, 0.0, 2.5], [0.1, -0.4, 0.2, 3.0, 0.4]])
ALPHA = np.array([0.5, 1.0, 2.0])  # one per row


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@contextlib.contextmanager
def device_path(monkeypatch):
    """Force the buffer_callback path; record the GPU kernels called (by name)."""
    calls = []

    def counting(name, launcher):
        def run(*args):
            calls.append(name)
            return launcher(*args)

        return run

    with monkeypatch.context() as patch:
        patch.setattr(soj, "_DEVICE_CALLBACKS", True)
        for name in KERNELS:
            patch.setattr(gpu, name, counting(name, getattr(gpu, name)))
        yield calls


def weights(shape, dtype):
    size = int(np.prod(shape))
    return jnp.asarray(np.linspace(-1.0, 2.0, max(size, 1))[:size].reshape(shape), dtype=dtype)


def value_and_grads(fn, args, argnums):
    """``jax.jit`` of ``fn(*args)`` and the gradients of a fixed weighting of it; a new
    function each time, so that each path is traced afresh.
    """

    def loss(*a):
        out = fn(*a)
        return jnp.sum(out * weights(out.shape, out.dtype))

    def both(*a):
        return fn(*a), jax.grad(loss, argnums)(*a)

    jaxpr = str(jax.make_jaxpr(both)(*args))
    out, grads = jax.jit(both)(*args)
    return out, grads, jaxpr


def assert_close(got, expected, rtol, atol):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=rtol, atol=atol)


def check(monkeypatch, fn, args, argnums, kernels, rtol=1e-10, atol=1e-12):
    """The device path equals the CPU kernels' path: value and gradients under jit."""
    args = tuple(jnp.asarray(a) for a in args)
    with monkeypatch.context() as patch:  # the CPU's callbacks (a traced alpha takes FFI)
        patch.setattr(soj, "_FFI_CALLS", False)
        expected, expected_grads, jaxpr = value_and_grads(fn, args, argnums)
    assert "buffer_callback" in jaxpr and "pure_callback" not in jaxpr
    with device_path(monkeypatch) as calls:
        out, grads, jaxpr = value_and_grads(fn, args, argnums)
    assert "buffer_callback" in jaxpr and "pure_callback" not in jaxpr
    assert set(kernels) <= set(calls), calls
    assert_close(out, expected, rtol, atol)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close(g, e, rtol, atol)
    return calls


def test_soft_rank_per_row_alpha(monkeypatch, x64):
    check(
        monkeypatch,
        lambda x, a: soj.soft_rank(x, a, descending=True),
        (X, ALPHA),
        (0, 1),
        {"rank_forward", "rank_vjp"},
    )


def test_soft_topk_traced_k(monkeypatch, x64):
    check(
        monkeypatch,
        lambda x, k, a: soj.soft_topk(x, k, a),
        (X, 2.5, 0.7),
        (0, 1, 2),
        {"topk_forward", "topk_vjp"},
    )


def test_log_soft_topk_k_per_row(monkeypatch, x64):
    check(
        monkeypatch,
        lambda x, k, a: soj.log_soft_topk(x, k, a),
        (X, np.array([1.0, 3.0, 2.5]), ALPHA),
        (0, 1, 2),
        {"topk_forward", "topk_vjp"},
    )


def test_soft_sort_eager_and_jit(monkeypatch, x64):
    fn = lambda x, a: soj.soft_sort(x, a)  # noqa: E731
    check(monkeypatch, fn, (X, ALPHA), (0, 1), {"inverse_kernel", "inverse_vjp"})
    expected = fn(X, 0.5)
    with device_path(monkeypatch) as calls:
        out = fn(X, 0.5)  # not jitted: buffer_callback's own dispatch
    assert "inverse_kernel" in calls
    assert_close(out, expected, 1e-10, 1e-12)


def test_soft_quantile_several_q(monkeypatch, x64):
    check(
        monkeypatch,
        lambda x, q, a: soj.soft_quantile(x, q, a),
        (X, np.array([[0.2, 0.5, 0.9]]), ALPHA),
        (0, 1, 2),
        {"inverse_kernel", "inverse_vjp"},
    )


def test_soft_permutation(monkeypatch, x64):
    check(
        monkeypatch,
        lambda x, a: soj.soft_permutation(x, a),
        (X[:2, :4], 0.5),
        (0, 1),
        {"permutation_forward", "permutation_vjp"},
    )


def test_topk_cross_entropy(monkeypatch, x64):
    labels, p_k = np.array([0, 1, 3]), np.array([0.5, 0.3, 0.2])
    check(
        monkeypatch,
        lambda x, a: soj.topk_cross_entropy(x, labels, p_k, a, split_top1=True),
        (X, ALPHA),
        (0, 1),
        {"topk_loss_forward", "topk_loss_vjp"},
    )


def test_permutation_cross_entropy(monkeypatch, x64):
    target = np.array([[2, 1, 5, 3, 4], [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
    check(
        monkeypatch,
        lambda x, a: soj.permutation_cross_entropy(x, target, a, reduction="sum"),
        (X, 0.8),
        (0, 1),
        {"permutation_loss_forward", "permutation_loss_vjp"},
    )


def test_vmap_is_one_batched_call(monkeypatch, x64):
    fn = jax.vmap(lambda row, a: soj.soft_rank(row, a))  # per-row alpha, vmapped too
    check(monkeypatch, fn, (X, ALPHA), (0, 1), {"rank_forward", "rank_vjp"})
    with device_path(monkeypatch) as calls:
        jax.jit(lambda x, a: fn(x, a))(X, ALPHA).block_until_ready()
    assert calls.count("rank_forward") == 1, calls


def test_float32_without_x64_packs_residuals(monkeypatch):
    assert not jax.config.jax_enable_x64
    x = X.astype(np.float32)
    check(
        monkeypatch,
        lambda x, k, a: soj.soft_topk(x, k, a, largest=False),
        (x, np.array([[1.0, 2.5]], np.float32), ALPHA.astype(np.float32)),
        (0, 1, 2),
        {"topk_forward", "topk_vjp"},
        rtol=1e-6,
        atol=1e-7,
    )


def test_traced_bad_alpha_raises_from_the_callback(monkeypatch):
    with (
        device_path(monkeypatch),
        pytest.raises(
            jax.errors.JaxRuntimeError, match="ValueError: alpha must be positive and finite"
        ),
    ):
        jax.jit(soj.soft_rank)(jnp.asarray(X, jnp.float32), -1.0).block_until_ready()


def test_host_buffers_without_simulator_run_the_cpu_kernels(monkeypatch, x64):
    """A computation placed on the CPU while the device path was chosen: NumPy views of the
    buffers and the CPU kernels, results written in place.
    """
    fn = lambda x, k, a: soj.soft_topk(x, k, a)  # noqa: E731
    args = (jnp.asarray(X), jnp.asarray(2.5), jnp.asarray(ALPHA))
    expected, expected_grads, _ = value_and_grads(fn, args, (0, 1, 2))
    with device_path(monkeypatch) as calls:
        monkeypatch.setattr(soj, "_simulator", lambda: False)
        out, grads, jaxpr = value_and_grads(fn, args, (0, 1, 2))
    assert "buffer_callback" in jaxpr and calls == []
    assert_close(out, expected, 0, 0)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close(g, e, 0, 0)


def test_auto_on_the_cpu_backend_keeps_the_cpu_kernels_without_numba_cuda():
    """The default on a CPU backend: buffer_callback into the CPU kernels (or the FFI
    route), and numba.cuda is never imported.
    """
    code = textwrap.dedent(
        """
        import sys, jax, jax.numpy as jnp
        import softorder.bridges.jax as soj
        f = lambda x: soj.soft_rank(x, 0.5).sum()
        g = lambda x, k: soj.soft_topk(x, k, 0.5).sum()  # (a traced k: the callbacks)
        assert "ffi_call" in str(jax.make_jaxpr(jax.grad(f))(jnp.ones(3)))
        assert "buffer_callback" in str(jax.make_jaxpr(jax.grad(g))(jnp.ones(3), 1.5))
        jax.jit(jax.grad(f))(jnp.arange(3.0)).block_until_ready()
        jax.jit(jax.grad(g))(jnp.arange(3.0), 1.5).block_until_ready()
        loaded = [m for m in sys.modules if m.startswith(("numba.cuda", "softorder.core.cuda"))]
        assert soj._DEVICE_CALLBACKS == "auto" and not loaded, loaded
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
