"""The JAX bridge's CPU callbacks (softorder._engine.call.Call): a backward pass takes the
context its forward pass kept for the same arguments, or restores one from the residuals;
either way the gradients are the same to the bit, and a context is never taken for other
arguments. Scalars reach the rules as numbers; read-only buffers never reach a kernel.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import softorder.bridges.jax as soj  # noqa: E402
from softorder._engine import call as call_module  # noqa: E402
from tests.compiled import read_only_signatures  # noqa: E402

RANKS = np.array([[3, 1, 2, 5, 4], [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])


@pytest.fixture(autouse=True)
def _callbacks_only(monkeypatch):
    """Every call on the callbacks: a traced alpha would take the FFI route where it has one."""
    monkeypatch.setattr(soj, "_FFI_CALLS", False)


#: the operations on the callbacks (no FFI route), with their arguments after x and alpha's
#: position among the arguments
CASES = {
    "soft_quantile": (soj.soft_quantile, (0.3,)),
    "soft_quantile several q": (soj.soft_quantile, (np.array([0.2, 0.5, 0.9]),)),
    "soft_permutation": (soj.soft_permutation, ()),
    "topk_cross_entropy": (soj.topk_cross_entropy, (np.array([0, 4, 2]), [0.5, 0.5])),
    "permutation_cross_entropy": (soj.permutation_cross_entropy, (RANKS,)),
    "soft_topk several k": (soj.soft_topk, (np.array([[1.5, 3.0]]),)),
    "soft_rank traced alpha": (soj.soft_rank, ()),
}


def _rows(rng):
    base = np.arange(5) * 0.3 + rng.uniform(0, 0.03, size=(3, 5))
    return rng.permuted(base, axis=-1)


def _gradients(fn, extra, x, alpha):
    """value_and_grad in x and alpha under jit, and per row under vmap."""

    def loss(x, alpha):
        out = fn(x, *extra, alpha)
        return jnp.sum(out * jnp.arange(1.0, out.size + 1.0).reshape(out.shape))

    value, grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, alpha)
    batched = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(jnp.stack([x, -x]), alpha)
    return jax.tree.map(np.asarray, (value, grads, batched))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("x64_on", [False, True])
def test_kept_and_restored_contexts_give_the_same_gradients(case, x64_on, rng, monkeypatch):
    fn, extra = CASES[case]
    x = _rows(rng)
    with jax.enable_x64(x64_on):
        args = (jnp.asarray(x), jnp.asarray(0.7))
        call_module._RECENT.clear()
        before = read_only_signatures()
        kept = _gradients(fn, extra, *args)
        assert call_module._RECENT  # the forward passes kept their contexts
        monkeypatch.setattr(call_module, "_RECENT_BYTES", -1)  # none kept: all restored
        call_module._RECENT.clear()
        restored = _gradients(fn, extra, *args)
        assert not call_module._RECENT
        assert read_only_signatures() == before
    for got, expected in zip(jax.tree.leaves(kept), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(got, expected, strict=True)
        assert np.isfinite(got).all()


@pytest.mark.parametrize("case", CASES)
def test_a_kept_context_serves_several_pullbacks(case, rng, monkeypatch):
    """The rules' VJPs never write into a context: a pullback called twice on a kept context
    gives the restored context's gradients both times.
    """
    fn, extra = CASES[case]
    args = (jnp.asarray(_rows(rng).astype(np.float32)), jnp.asarray(np.float32(0.7)))
    out, pullback = jax.vjp(lambda x, a: fn(x, *extra, a), *args)
    cotangent = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32))
    twice = [jax.tree.map(np.asarray, pullback(cotangent)) for _ in range(2)]
    monkeypatch.setattr(call_module, "_RECENT_BYTES", -1)
    call_module._RECENT.clear()
    restored = jax.tree.map(np.asarray, jax.vjp(lambda x, a: fn(x, *extra, a), *args)[1](cotangent))
    for got in twice:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(a, b, strict=True)


def test_a_pullback_takes_only_its_own_forward_passes_context(rng):
    """Pullbacks called out of order, after more forward passes than are kept, on inputs
    that differ in one bit: each gives the gradient of its own forward pass.
    """
    x = jnp.asarray(_rows(rng).astype(np.float32))
    nudged = x.at[1, 2].set(np.nextafter(np.float32(x[1, 2]), np.float32(np.inf)))
    inputs = [x, nudged] + [x + i for i in range(1, call_module._RECENT_COUNT + 2)]
    cotangent = jnp.asarray(rng.standard_normal(3).astype(np.float32))

    def pullback(x):
        return jax.vjp(lambda x: soj.soft_quantile(x, 0.4, 0.5), x)[1]

    call_module._RECENT.clear()
    fresh = []
    for u in inputs:
        fresh.append(np.asarray(pullback(u)(cotangent)[0]))
        call_module._RECENT.clear()
    pullbacks = [pullback(u) for u in inputs]  # the first ones' contexts are no longer kept
    assert len(call_module._RECENT) == call_module._RECENT_COUNT
    for i in reversed(range(len(inputs))):
        got = np.asarray(pullbacks[i](cotangent)[0])
        np.testing.assert_array_equal(got, fresh[i])
        again = np.asarray(pullbacks[i](cotangent)[0])  # a kept context serves twice
        np.testing.assert_array_equal(again, fresh[i])
    assert not np.array_equal(fresh[0], fresh[1])  # (the nudge changes the gradient)


def test_scalars_pass_as_numbers_and_read_only_buffers_are_copied():
    x32 = np.linspace(-1.0, 1.0, 6, dtype=np.float32)
    x64 = x32.astype(np.float64)
    q, alpha = np.array(0.3, np.float32), np.array(0.5, np.float32)
    for arr in (x32, x64, q, alpha):
        arr.flags.writeable = False
    spec = call_module.CallSpec("soft_quantile", ("x", "q", "alpha"), (("axis", -1),))
    call = call_module.Call.plan(spec, {"x": x64, "q": q, "alpha": alpha}, "float64")
    arguments = call.arguments([x64, q, alpha])
    assert type(arguments["q"]) is float and arguments["q"] == float(np.float32(0.3))
    assert type(arguments["alpha"]) is float and arguments["alpha"] == 0.5
    assert arguments["x"].flags.writeable  # float64: the kernels would read it as it is
    np.testing.assert_array_equal(arguments["x"], x64)
    assert call.arguments([x32, q, alpha])["x"] is x32  # converted to float64 before any kernel


def _backward_outputs(jaxpr) -> list:
    """The number of results of each backward buffer_callback in ``jaxpr`` (nested too)."""
    found = []
    for eqn in jaxpr.eqns:
        callback = str(eqn.params.get("callback"))
        if eqn.primitive.name == "buffer_callback" and "wanted=None" not in callback:
            found.append(len(eqn.outvars))
        for param in eqn.params.values():
            sub = getattr(param, "jaxpr", param)
            if hasattr(sub, "eqns"):
                found += _backward_outputs(sub)
    return found


def test_the_backward_pass_returns_only_the_gradients_asked_for(rng):
    """Arguments that are not differentiated (JAX's symbolic zeros) get no gradient from the
    callback; those that are get the same gradients as when all are.
    """
    x = jnp.asarray(_rows(rng).astype(np.float32))
    q, alpha = jnp.float32(0.3), jnp.float32(0.7)

    def loss(x, q, alpha):
        return jnp.sum(soj.soft_quantile(x, q, alpha) * jnp.arange(1.0, 4.0))

    for argnums, outputs in (((0,), 1), ((0, 2), 2), ((1,), 1), ((0, 1, 2), 3)):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums))(x, q, alpha).jaxpr
        assert _backward_outputs(jaxpr) == [outputs]
    every = jax.jit(jax.grad(loss, (0, 1, 2)))(x, q, alpha)
    for argnums in ((0,), (1,), (2,), (0, 2)):
        some = jax.jit(jax.grad(loss, argnums))(x, q, alpha)
        for i, grad in zip(argnums, some, strict=True):
            np.testing.assert_array_equal(np.asarray(grad), np.asarray(every[i]), strict=True)


def test_a_symbolic_zero_cotangent_is_a_zero_cotangent(rng):
    x = jnp.asarray(_rows(rng).astype(np.float32))
    alpha = jnp.float32(0.7)
    call_args = (x, alpha)
    _, vjp = jax.vjp(lambda x, a: soj.soft_permutation(x, a), *call_args)
    zeros = vjp(jnp.zeros((3, 5, 5), jnp.float32))
    saved = None

    def grab(kernel, *primals):
        nonlocal saved
        out, saved = soj._apply_fwd(kernel, *primals)
        return out, saved

    # the backward rule itself, given JAX's symbolic zero for the cotangent
    primals = [jax.custom_derivatives.CustomVJPPrimal(a, True) for a in (x, alpha)]
    spec = soj.CallSpec("soft_permutation", ("x", "alpha"), (("axis", -1), ("descending", False)))
    call = soj.Call.plan(spec, {"x": x, "alpha": alpha}, "float32", True)
    kernel = soj._Callbacks(call, "host")
    grab(kernel, *primals)
    symbolic = jax.custom_derivatives.SymbolicZero(jax.core.ShapedArray((3, 5, 5), jnp.float32))
    got = soj._apply_bwd(kernel, saved, symbolic)
    for a, b in zip(got, zeros, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)


LABELS = np.array([0, 4, 2])


def test_a_kept_context_holds_no_view_of_the_callbacks_buffers(rng):
    """The arrays a callback receives are views of XLA's buffers (writable, in this JAX), which
    XLA may reuse once the callback returns: a kept context must not read them later. Here
    the forward pass's labels and target ranks are overwritten after it returns; the backward
    pass, on equal arguments in other buffers, still gives the restored context's gradients.
    """
    x = _rows(rng)
    cases = [
        ("topk_cross_entropy", ("logits", "labels", "p_k", "alpha"), (LABELS, [0.5, 0.5])),
        ("permutation_cross_entropy", ("x", "target_ranks", "alpha"), (RANKS,)),
    ]
    for op, names, extra in cases:
        arguments = [x, *(np.asarray(a) for a in extra), np.asarray(0.7)]
        statics = (("reduction", "mean"), ("descending", False))
        if op == "topk_cross_entropy":
            statics = (("reduction", "mean"), ("split_top1", False))
        spec = call_module.CallSpec(op, names, statics)
        call = call_module.Call.plan(spec, dict(zip(names, arguments, strict=True)), "float64")

        forward_buffers = [np.array(a) for a in arguments]  # XLA's buffers, as views
        views = [b[...] for b in forward_buffers]
        assert not any(v.flags.owndata for v in views)
        call_module._RECENT.clear()
        forward = [np.empty(shape, dtype) for shape, dtype in [call.result, *call.stored_shapes()]]
        call.forward_into(views, forward)
        assert call_module._RECENT  # kept
        for b in forward_buffers:  # reused by XLA for something else
            b[...] = np.zeros_like(b) if b.dtype.kind in "iu" else np.full_like(b, np.nan)
        cotangent = np.asarray(1.0)
        flat = [np.array(a) for a in arguments] + [np.asarray(r) for r in forward[1:]]
        grads = [np.empty(np.shape(arguments[i]), np.float64) for i in call.differentiable]
        call.backward_into([*flat, cotangent], grads)
        call_module._RECENT.clear()
        restored = call.backward([np.array(a) for a in arguments], forward[1:], cotangent)
        for got, want in zip(grads, restored, strict=True):
            np.testing.assert_array_equal(got, want)
            assert np.isfinite(got).all()
