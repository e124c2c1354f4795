"""The JAX bridge: values equal the NumPy API's, gradients check numerically, and jit, vmap and
grad compose (softorder.bridges.jax).
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import softorder  # noqa: E402
import softorder.bridges.jax as soj  # noqa: E402
from tests.compiled import read_only_signatures  # noqa: E402


@pytest.fixture
def x64():
    """float64 in JAX for this test only (the flag is process-wide; the context restores it)."""
    with jax.enable_x64(True):
        yield


def distinct(rng, shape, gap=0.3):
    """Values at least ``gap`` apart along the last axis, shuffled (stable finite differences)."""
    n = shape[-1]
    base = np.arange(n) * gap + rng.uniform(0, 0.1 * gap, size=shape)
    return rng.permuted(base, axis=-1)


# (name, bridge function, NumPy function, positional extras after x, keyword statics)
def cases(rng):
    x = distinct(rng, (3, 6))
    labels = np.array([0, 3, 5])
    target_ranks = np.argsort(np.argsort(rng.normal(size=(3, 6)), axis=-1), axis=-1) + 1
    return [
        ("soft_topk", (x, 2.5, 0.4), {}),
        ("soft_topk", (x, 2.5, 0.4), {"largest": False}),
        ("log_soft_topk", (x, 1.5, 0.4), {}),
        ("soft_rank", (x, 0.4), {}),
        ("soft_rank", (x, 0.4), {"descending": True}),
        ("soft_sort", (x, 0.4), {}),
        ("soft_sort", (x, 0.4), {"descending": True}),
        ("soft_quantile", (x, 0.3, 0.4), {}),
        ("soft_permutation", (x, 0.4), {}),
        ("topk_cross_entropy", (x, labels, np.array([0.2, 0.3, 0.5]), 0.4), {}),
        ("topk_cross_entropy", (x, labels, np.array([0.2, 0.3, 0.5]), 0.4), {"split_top1": True}),
        ("permutation_cross_entropy", (x, target_ranks, 0.4), {"reduction": "sum"}),
        ("permutation_cross_entropy", (x, target_ranks, 0.4), {"descending": True}),
    ]


def case_ids():
    return [f"{name}-{i}" for i, (name, _, _) in enumerate(cases(np.random.default_rng(0)))]


CASES = range(len(case_ids()))


def get_case(i, rng):
    name, args, kwargs = cases(rng)[i]
    return getattr(soj, name), getattr(softorder, name), args, kwargs


# --- values --------------------------------------------------------------------------------


@pytest.mark.parametrize("i", CASES, ids=case_ids())
def test_values_equal_numpy_api_float64(i, rng, x64):
    bridge, numpy_fn, args, kwargs = get_case(i, rng)
    out = bridge(*args, **kwargs)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), numpy_fn(*args, **kwargs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("i", CASES, ids=case_ids())
def test_values_float32_by_default_and_jit_equals_eager(i, rng):
    bridge, numpy_fn, args, kwargs = get_case(i, rng)
    x32 = np.asarray(args[0], dtype=np.float32)
    out = bridge(x32, *args[1:], **kwargs)
    assert out.dtype == jnp.float32
    expected = numpy_fn(x32.astype(np.float64), *args[1:], **kwargs)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-6, atol=2e-6)
    jitted = jax.jit(lambda *a: bridge(*a, **kwargs))(x32, *args[1:])
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(out))


@pytest.mark.parametrize("i", CASES, ids=case_ids())
def test_gradients_match_numpy_pullback_float32(i, rng):
    """Without x64 the residuals still travel bit for bit: gradients equal the float64 core's
    up to the float32 rounding of the inputs and results.
    """
    bridge, numpy_fn, args, kwargs = get_case(i, rng)
    x32 = np.asarray(args[0], dtype=np.float32)
    out = bridge(x32, *args[1:], **kwargs)
    cot = rng.normal(size=out.shape).astype(np.float32)

    def f(x):
        return jnp.sum(bridge(x, *args[1:], **kwargs) * cot)

    grad = jax.grad(f)(x32)
    _, pullback = softorder.vjp(numpy_fn, x32.astype(np.float64), *args[1:], **kwargs)
    expected = pullback(cot.astype(np.float64) if cot.shape else float(cot))[0]
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-5)


def test_several_k_and_q_per_row_and_per_row_alpha(rng, x64):
    x = distinct(rng, (4, 7))
    k = np.array([[1.5, 3.0, 5.5]])
    alpha = np.array([0.2, 0.3, 0.4, 0.5])
    np.testing.assert_allclose(
        np.asarray(soj.soft_topk(x, k, alpha)), softorder.soft_topk(x, k, alpha), rtol=1e-12
    )
    q = np.array([[0.1, 0.5, 0.9]])
    np.testing.assert_allclose(
        np.asarray(soj.soft_quantile(x, q, alpha)),
        softorder.soft_quantile(x, q, alpha),
        rtol=1e-12,
    )
    grad_alpha = jax.grad(lambda a: soj.soft_quantile(x, q, a).sum())(alpha)
    assert grad_alpha.shape == alpha.shape
    grad_k = jax.grad(lambda k: soj.soft_topk(x, k, 0.3)[:, :, 0].sum())(k)
    assert grad_k.shape == k.shape


def test_axis_other_than_last(rng, x64):
    x = distinct(rng, (2, 5, 3)).transpose(0, 2, 1)  # distinct along axis 1
    for name in ("soft_rank", "soft_sort", "soft_permutation"):
        np.testing.assert_allclose(
            np.asarray(getattr(soj, name)(x, 0.3, axis=1)),
            getattr(softorder, name)(x, 0.3, axis=1),
            rtol=1e-12,
        )
    np.testing.assert_allclose(
        np.asarray(soj.soft_topk(x, 2, 0.3, axis=-2)), softorder.soft_topk(x, 2, 0.3, axis=-2)
    )


def test_lists_of_traced_values(rng, x64):
    """A list that holds traced values (k, alpha, q, p_k, labels of a jitted function's
    arguments, or a list jax.grad differentiates) is a traced argument: NumPy cannot read it
    (it raised jax's TracerArrayConversionError).
    """
    x = distinct(rng, (3, 6))
    k = [1.5, 2.0, 4.5]
    out = jax.jit(lambda a, b, c: soj.soft_topk(x, [a, b, c], 0.4))(*k)
    np.testing.assert_array_equal(np.asarray(out), softorder.soft_topk(x, k, 0.4))
    out = jax.jit(lambda a, b: soj.soft_rank(x, [a, b, 0.7]))(0.3, 0.5)
    np.testing.assert_array_equal(np.asarray(out), softorder.soft_rank(x, [0.3, 0.5, 0.7]))
    out = jax.jit(lambda q: soj.soft_quantile(x, (q, 0.5, 0.9), 0.4))(0.2)
    np.testing.assert_array_equal(np.asarray(out), softorder.soft_quantile(x, [0.2, 0.5, 0.9], 0.4))
    loss = jax.jit(lambda label, p: soj.topk_cross_entropy(x, [label, 3, 5], [p, 0.7], 0.4))
    expected = softorder.topk_cross_entropy(x, [0, 3, 5], [0.3, 0.7], 0.4)
    np.testing.assert_allclose(np.asarray(loss(0, 0.3)), expected, rtol=1e-15)
    grad_k = jax.grad(lambda k: soj.soft_topk(x, k, 0.4)[:, 0].sum())(k)
    _, pullback = softorder.vjp(softorder.soft_topk, x, k, 0.4)
    expected = pullback(np.eye(6)[0] * np.ones((3, 1)))[1]
    np.testing.assert_array_equal(np.asarray(grad_k), expected)
    with pytest.raises(ValueError, match="k of shape"):
        jax.jit(lambda a: soj.soft_topk(x, [a, a], 0.4))(1.0)


# --- gradients (float64, numerical check) ---------------------------------------------------


def grad_targets(name, args):
    """Positions of the arguments to differentiate: the input, alpha, and k or q."""
    if name in ("soft_topk", "log_soft_topk", "soft_quantile"):
        return (0, 1, 2)
    if name == "topk_cross_entropy":
        return (0, 3)
    return (0, len(args) - 1)


@pytest.mark.parametrize("i", CASES, ids=case_ids())
def test_check_grads_float64(i, rng, x64):
    name, args, kwargs = cases(rng)[i]
    bridge = getattr(soj, name)
    wrt = grad_targets(name, args)

    def f(*diff):
        full = list(args)
        for pos, value in zip(wrt, diff, strict=True):
            full[pos] = value
        return bridge(*full, **kwargs)

    primals = tuple(jnp.asarray(args[pos], dtype=jnp.float64) for pos in wrt)
    check_grads(f, primals, order=1, modes=["rev"], eps=1e-6, atol=1e-5, rtol=1e-5)


def test_check_grads_per_row_alpha_and_several_k(rng, x64):
    x = jnp.asarray(distinct(rng, (3, 6)))
    alpha = jnp.array([[0.3], [0.4], [0.5]])[:, 0]
    k = jnp.array([1.5, 4.0])[None, :]
    check_grads(
        lambda x, k, a: soj.soft_topk(x, k, a),
        (x, k, alpha),
        order=1,
        modes=["rev"],
        eps=1e-6,
    )
    check_grads(
        lambda x, q, a: soj.soft_quantile(x, q, a),
        (x, jnp.array([[0.2, 0.7]]), alpha),
        order=1,
        modes=["rev"],
        eps=1e-6,
    )


# --- transformations ------------------------------------------------------------------------


@pytest.fixture
def count_calls(monkeypatch):
    """Count how often the NumPy rules run forward and backward (the host callbacks)."""
    counts = {"forward": 0, "vjp": 0}
    monkeypatch.setattr(soj, "_FFI_CALLS", False)  # the callbacks, not the FFI route (no rules)

    def counting(rule):
        forward, vjp = rule.forward, rule.vjp

        def counted_forward(ctx):
            counts["forward"] += 1
            return forward(ctx)

        def counted_vjp(ctx, cotangent):
            counts["vjp"] += 1
            return vjp(ctx, cotangent)

        monkeypatch.setattr(rule, "forward", counted_forward)
        monkeypatch.setattr(rule, "vjp", counted_vjp)

    for name in soj.__all__:
        counting(getattr(softorder, name).rule)
    return counts


@pytest.mark.parametrize("i", CASES, ids=case_ids())
def test_vmap_is_one_batched_call(i, rng, count_calls):
    """vmap over an extra leading axis equals the batched call, in one kernel call."""
    bridge, _, args, kwargs = get_case(i, rng)
    xb = np.stack([args[0], args[0][::-1] * 1.5, -args[0]]).astype(np.float32)

    def f(x):
        return bridge(x, *args[1:], **kwargs)

    out = jax.vmap(f)(xb)
    assert count_calls["forward"] == 1
    expected = np.stack([np.asarray(f(row)) for row in xb])
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)

    count_calls["forward"] = 0
    grads = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(f(x) ** 2))))(xb)
    assert count_calls == {"forward": 1, "vjp": 1}
    expected = np.stack([np.asarray(jax.grad(lambda x: jnp.sum(f(x) ** 2))(row)) for row in xb])
    np.testing.assert_allclose(np.asarray(grads), expected, rtol=1e-5, atol=1e-6)


def test_vmap_over_alpha_k_and_q(rng, count_calls):
    x = jnp.asarray(distinct(rng, (3, 6)), dtype=jnp.float32)
    alphas = jnp.array([0.2, 0.5, 1.0])
    ks = jnp.array([1.5, 2.0, 4.5])

    out = jax.vmap(lambda a, k: soj.soft_topk(x, k, a))(alphas, ks)
    assert out.shape == (3, 3, 6) and count_calls["forward"] == 1
    for j in range(3):
        np.testing.assert_allclose(
            np.asarray(out[j]), np.asarray(soj.soft_topk(x, ks[j], alphas[j])), rtol=1e-6
        )
    # per-row alpha inside, vmapped alpha outside; gradient lands in each alpha's shape
    per_row = jnp.array([0.3, 0.4, 0.5])
    g = jax.vmap(jax.grad(lambda a, s: soj.soft_rank(x, a * s).sum() ** 2), in_axes=(None, 0))(
        per_row, alphas
    )
    assert g.shape == (3, 3)
    for j in range(3):
        scale = alphas[j]
        expected = jax.grad(lambda a, s=scale: soj.soft_rank(x, a * s).sum() ** 2)(per_row)
        np.testing.assert_allclose(np.asarray(g[j]), np.asarray(expected), rtol=1e-5, atol=1e-6)
    qs = jnp.array([[0.25, 0.5], [0.1, 0.9]])
    out = jax.vmap(lambda q: soj.soft_quantile(x, q[None, :], 0.3))(qs)
    assert out.shape == (2, 3, 2)
    np.testing.assert_allclose(
        np.asarray(out[1]), np.asarray(soj.soft_quantile(x, qs[1:], 0.3)), rtol=1e-6
    )


def test_vmap_with_axis_and_unbatched_input(rng):
    x = jnp.asarray(distinct(rng, (2, 5)).T, dtype=jnp.float32)  # ranked along axis 0
    alphas = jnp.array([0.1, 0.7])
    out = jax.vmap(lambda a: soj.soft_rank(x, a, axis=0))(alphas)
    assert out.shape == (2, 5, 2)
    np.testing.assert_allclose(
        np.asarray(out[1]), softorder.soft_rank(np.asarray(x), 0.7, axis=0), rtol=1e-6
    )
    xb = jnp.stack([x, 2 * x], axis=2)  # vmapped along the last axis
    out = jax.vmap(lambda x: soj.soft_permutation(x, 0.3, axis=0), in_axes=2)(xb)
    assert out.shape == (2, 2, 5, 5)
    np.testing.assert_allclose(
        np.asarray(out[1]), softorder.soft_permutation(np.asarray(2 * x), 0.3, axis=0), atol=1e-6
    )


def test_nested_vmap(rng, count_calls):
    x = jnp.asarray(distinct(rng, (2, 3, 4, 6)), dtype=jnp.float32)
    k = jnp.array([1.5, 2.5, 3.5])

    def f(x, k):
        return soj.soft_topk(x, k, 0.3)

    out = jax.vmap(jax.vmap(f, in_axes=(0, 0)), in_axes=(0, None))(x, k)
    assert count_calls["forward"] == 1
    for a in range(2):
        for b in range(3):
            np.testing.assert_allclose(
                np.asarray(out[a, b]), np.asarray(f(x[a, b], k[b])), rtol=1e-6, atol=1e-7
            )
    grads = jax.vmap(jax.vmap(jax.grad(lambda x, k: f(x, k)[0, 0], argnums=(0, 1))))(
        x, jnp.broadcast_to(k, (2, 3))
    )
    assert grads[0].shape == x.shape and grads[1].shape == (2, 3)


def test_vmapped_losses_reduce_per_element(rng):
    logits = jnp.asarray(rng.normal(size=(4, 5, 6)), dtype=jnp.float32)
    labels = jnp.asarray(rng.integers(0, 6, size=(4, 5)))
    p_k = jnp.array([0.0, 0.0, 1.0])
    out = jax.vmap(lambda z, y: soj.topk_cross_entropy(z, y, p_k, 0.5))(logits, labels)
    expected = [soj.topk_cross_entropy(logits[j], labels[j], p_k, 0.5) for j in range(4)]
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6)


def test_a_derivative_in_p_k_is_refused_naming_softorder(rng):
    """The loss has no derivative in p_k: asking for one raises, where JAX would take it as 0;
    with a constant p_k the gradients in the logits go on."""
    logits = jnp.asarray(rng.normal(size=(3, 5)), dtype=jnp.float32)
    labels = jnp.array([0, 4, 2])
    p_k = jnp.array([0.5, 0.5])

    def loss(z, p):
        return soj.topk_cross_entropy(z, labels, p, 0.5)

    message = "^softorder: topk_cross_entropy has no derivative in p_k"
    for transform in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        with pytest.raises(NotImplementedError, match=message):
            transform(lambda p: loss(logits, p))(p_k)
    with pytest.raises(NotImplementedError, match=message):
        jax.vjp(loss, logits, p_k)
    grad = jax.grad(loss)(logits, p_k)
    expected = softorder.vjp(
        softorder.topk_cross_entropy, np.asarray(logits), np.asarray(labels), np.asarray(p_k), 0.5
    )[1](np.float32(1.0))[0]
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_narrow_p_k_is_accepted_as_the_numpy_api_accepts_it(dtype):
    logits, labels = jnp.zeros((2, 5)), jnp.array([0, 3])
    thirds = jnp.full(3, 1 / 3, dtype)
    expected = softorder.topk_cross_entropy(
        np.zeros((2, 5)), np.array([0, 3]), np.asarray(thirds, np.float64), 0.5
    )
    for call in (soj.topk_cross_entropy, jax.jit(soj.topk_cross_entropy)):
        np.testing.assert_allclose(call(logits, labels, thirds, 0.5), expected, rtol=1e-6)


def test_grad_of_jit_and_jit_of_grad(rng):
    x = jnp.asarray(distinct(rng, (8,)), dtype=jnp.float32)
    w = jnp.asarray(rng.normal(size=8), dtype=jnp.float32)

    def loss(x, alpha, q):
        return jnp.dot(soj.soft_sort(x, alpha), w) + soj.soft_quantile(x, q, alpha)

    g1 = jax.grad(jax.jit(loss), argnums=(0, 1, 2))(x, 0.5, 0.3)
    g2 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, 0.5, 0.3)
    g3 = jax.grad(loss, argnums=(0, 1, 2))(x, 0.5, 0.3)
    for a, b, c in zip(g1, g2, g3, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(b), np.asarray(c), rtol=1e-6)
    value, grads = jax.value_and_grad(loss)(x, 0.5, 0.3)
    assert value.shape == () and grads.shape == (8,)


def test_jacrev_batches_the_cotangents(rng):
    x = jnp.asarray(distinct(rng, (5,)), dtype=jnp.float32)
    jac = jax.jacrev(lambda x: soj.soft_rank(x, 0.5))(x)
    assert jac.shape == (5, 5)
    np.testing.assert_allclose(np.asarray(jac.sum(axis=0)), 0.0, atol=1e-5)  # ranks sum to const


# --- dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_narrow_floats_are_computed_in_float32(dtype, rng):
    x = jnp.asarray(distinct(rng, (2, 6)), dtype=dtype)
    out = soj.soft_rank(x, 0.5)
    assert out.dtype == dtype
    expected = soj.soft_rank(x.astype(jnp.float32), 0.5)
    np.testing.assert_allclose(np.asarray(out, dtype=np.float32), np.asarray(expected), rtol=1e-2)
    g = jax.grad(lambda x: soj.soft_topk(x, 2, 0.5).astype(jnp.float32)[0, 0])(x)
    assert g.dtype == dtype and bool(jnp.all(jnp.isfinite(g)))
    loss = soj.topk_cross_entropy(x, jnp.array([1, 2]), [0.5, 0.5], 0.5)
    assert loss.dtype == dtype


def test_integer_input_gives_default_float(x64):
    out = soj.soft_rank(jnp.array([3, 1, 2]), 0.01)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), [3.0, 1.0, 2.0])


def test_integer_input_float32_without_x64():
    assert soj.soft_sort(np.array([3, 1, 2]), 0.5).dtype == jnp.float32


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x: soj.soft_rank(x, 0.5, axis=2), ValueError, "out of range"),
        (lambda x: soj.soft_rank(x, 0.5, axis=1.0), TypeError, "axis must be an integer"),
        (lambda x: soj.soft_rank(x[:, :0], 0.5), ValueError, "empty axis"),
        (lambda x: soj.soft_rank(x[0, 0], 0.5), ValueError, "at least one axis"),
        (lambda x: soj.soft_rank(x, -1.0), ValueError, "alpha must be positive"),
        (lambda x: soj.soft_rank(x, np.array([1.0, 0.0])), ValueError, "alpha must be positive"),
        (lambda x: soj.soft_rank(x, jnp.ones(3)), ValueError, "does not broadcast"),
        (lambda x: soj.soft_rank(x.astype(jnp.complex64), 1.0), TypeError, "must be real"),
        (lambda x: soj.soft_topk(x, 5, 0.5), ValueError, "k must lie strictly"),
        (lambda x: soj.soft_topk(x, jnp.ones((2, 2, 2)), 0.5), ValueError, "dimensions"),
        (lambda x: soj.soft_quantile(x, 1.0, 0.5), ValueError, "q must lie strictly"),
        (
            lambda x: soj.topk_cross_entropy(x, np.array([0, 5]), [1.0], 0.5),
            ValueError,
            "labels must lie",
        ),
        (
            lambda x: soj.topk_cross_entropy(x, jnp.array([0.0, 1.0]), [1.0], 0.5),
            TypeError,
            "integer",
        ),
        (
            lambda x: soj.topk_cross_entropy(x, jnp.array([0, 1]), [0.5, 0.6], 0.5),
            ValueError,
            "probability distribution",
        ),
        (
            lambda x: soj.topk_cross_entropy(x, jnp.array([0, 1]), [0.2] * 5, 0.5),
            ValueError,
            "K=5",
        ),
        (
            lambda x: soj.topk_cross_entropy(x, jnp.array([0, 1]), [1.0], reduction="avg"),
            ValueError,
            "reduction must be one of",
        ),
        (
            lambda x: soj.permutation_cross_entropy(x, np.zeros((2, 5), int)),
            ValueError,
            "target_ranks must lie",
        ),
        (
            lambda x: soj.permutation_cross_entropy(x, jnp.ones((2, 4), int)),
            ValueError,
            "target_ranks must have shape",
        ),
    ],
)
def test_bad_input_raises_at_trace_time(call, error, match):
    x = jnp.arange(10.0).reshape(2, 5)
    with pytest.raises(error, match=match):
        call(x)
    with pytest.raises(error, match=match):  # also while tracing under jit (concrete values)
        jax.jit(call)(x)


def test_traced_bad_shapes_raise_at_trace_time():
    x = jnp.arange(10.0).reshape(2, 5)
    with pytest.raises(ValueError, match="does not broadcast"):
        jax.jit(lambda a: soj.soft_rank(x, a))(jnp.ones(3))
    with pytest.raises(TypeError, match="integer"):
        jax.jit(lambda y: soj.topk_cross_entropy(x, y, [1.0]))(jnp.zeros(2))


@pytest.mark.parametrize(
    ("call", "bad", "match"),
    [
        (lambda x, a: soj.soft_rank(x, a), -1.0, "alpha must be positive"),
        (lambda x, k: soj.soft_topk(x, k, 0.5), 7.0, "k must lie strictly"),
        (lambda x, q: soj.soft_quantile(x, q, 0.5), 0.0, "q must lie strictly"),
    ],
)
def test_traced_bad_values_raise_when_the_callback_runs(call, bad, match, monkeypatch):
    """A traced value can only be checked on the host: jax.errors.JaxRuntimeError carrying
    the NumPy API's message and the callback's traceback (the FFI route's handlers check a
    traced alpha themselves: tests/test_jax_ffi.py).
    """
    monkeypatch.setattr(soj, "_FFI_CALLS", False)
    x = jnp.arange(10.0).reshape(2, 5)
    f = jax.jit(call)
    with pytest.raises(jax.errors.JaxRuntimeError, match=match) as raised:
        f(x, bad).block_until_ready()
    assert "Traceback" in str(raised.value)  # buffer_callback's error carries it


def test_nan_row_gives_nan_for_that_row_only():
    x = jnp.array([[1.0, jnp.nan, 0.0], [0.5, 2.0, -1.0]])
    out = jax.jit(lambda x: soj.soft_rank(x, 0.5))(x)
    assert bool(jnp.all(jnp.isnan(out[0]))) and bool(jnp.all(jnp.isfinite(out[1])))


def test_callbacks_run_on_the_cpu_backend():
    """The callbacks run on the host; on the CPU backend that is also where the data lives."""
    x = jax.device_put(jnp.array([0.5, -1.0, 3.0]), jax.devices("cpu")[0])
    out = jax.jit(lambda x: soj.soft_rank(x, 0.01))(x)
    assert out.devices() == {jax.devices("cpu")[0]}
    np.testing.assert_allclose(np.asarray(out), [2.0, 1.0, 3.0], atol=1e-6)


# --- training on real data ------------------------------------------------------------------


def test_linear_model_on_digits_learns_top5(rng):
    """Plain gradient descent on the top-k cross-entropy (P_K: "in the top 5") of a linear
    model on scikit-learn's bundled digits: held-out top-5 accuracy far above chance (0.5).
    """
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    features = (digits.data / 16.0).astype(np.float32)
    labels = digits.target
    perm = rng.permutation(len(labels))
    train, test = perm[:1200], perm[1200:]
    x_train, y_train = jnp.asarray(features[train]), jnp.asarray(labels[train])
    p_k = jnp.array([0.0, 0.0, 0.0, 0.0, 1.0])

    def loss(params):
        w, b = params
        return soj.topk_cross_entropy(x_train @ w + b, y_train, p_k, 1.0)

    @jax.jit
    def step(params):
        value, grads = jax.value_and_grad(loss)(params)
        return [p - 0.5 * g for p, g in zip(params, grads, strict=True)], value

    params = [jnp.zeros((64, 10)), jnp.zeros(10)]
    first = None
    for _ in range(100):
        params, value = step(params)
        first = value if first is None else first
    assert float(value) < 0.5 * float(first)
    scores = features[test] @ np.asarray(params[0]) + np.asarray(params[1])
    top5 = np.argsort(-scores, axis=1)[:, :5]
    accuracy = np.mean(np.any(top5 == labels[test][:, None], axis=1))
    assert accuracy > 0.9


def test_forward_mode_is_not_available():
    """custom_vjp functions have reverse-mode derivatives only (documented in the module):
    refused naming softorder, also under jit(jvp), where JAX's own refusal comes after the
    call has traced.
    """
    x = jnp.array([0.5, -1.0, 3.0])
    match = "softorder's JAX operations have reverse-mode derivatives only.*forward mode"
    with pytest.raises(TypeError, match=match):
        jax.jvp(soj.soft_rank, (x,), (x,))
    with pytest.raises(TypeError, match=match):
        jax.jacfwd(lambda x: soj.soft_topk(x, 1.5, 0.5))(x)
    with pytest.raises(TypeError, match=match):
        jax.jit(jax.jacfwd(lambda x: soj.soft_sort(x, 0.5)))(x)
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda x: jax.jvp(soj.soft_rank, (x,), (x,)))(x)
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda x: jax.jvp(soj.soft_sort, (x,), (x,)))(x)  # the FFI route
    with pytest.raises(TypeError, match=match):  # a tangent on alpha only
        jax.jit(lambda a: jax.jvp(lambda a: soj.soft_topk(x, 1.5, a), (a,), (a,)))(0.5)
    # forward mode in another argument leaves softorder's first derivatives alone
    out, tangent = jax.jvp(lambda s: s * soj.soft_sort(x, 0.5), (2.0,), (1.0,))
    np.testing.assert_array_equal(tangent, soj.soft_sort(x, 0.5))


SECOND_ORDER = "softorder's JAX operations have first derivatives only: second derivatives"
SECOND_ORDER_OPS = {
    "soft_rank": lambda x: soj.soft_rank(x, 0.5),
    "soft_topk": lambda x: soj.soft_topk(x, 1.5, 0.5),
    "soft_quantile": lambda x: soj.soft_quantile(x, 0.4, 0.5),
    "permutation_cross_entropy": lambda x: soj.permutation_cross_entropy(
        x, jnp.array([2, 1, 3]), 0.5
    ),
}


def _squares(op):
    return lambda x: jnp.sum(op(x) ** 2)


SECOND_ORDER_PATHS = {
    "hessian": lambda op, x: jax.hessian(_squares(op))(x),
    "jit(hessian)": lambda op, x: jax.jit(jax.hessian(_squares(op)))(x),
    "jacfwd(jacrev)": lambda op, x: jax.jacfwd(jax.jacrev(op))(x),
    "jacrev(jacrev)": lambda op, x: jax.jacrev(jax.jacrev(op))(x),
    "grad(grad)": lambda op, x: jax.grad(lambda x: jnp.sum(jax.grad(_squares(op))(x)))(x),
    "jvp(grad)": lambda op, x: jax.jvp(jax.grad(_squares(op)), (x,), (x,)),
    "mixed with jnp": lambda op, x: jax.hessian(lambda x: _squares(op)(x) + jnp.sin(x).sum())(x),
}


@pytest.mark.parametrize("path", list(SECOND_ORDER_PATHS))
@pytest.mark.parametrize("op", list(SECOND_ORDER_OPS))
def test_second_derivatives_are_refused(op, path):
    """Every second-order path names softorder and says what is unsupported (the callbacks
    have no derivative of their own), at trace time: no silent zeros.
    """
    x = jnp.array([0.5, -1.0, 3.0])
    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
        SECOND_ORDER_PATHS[path](SECOND_ORDER_OPS[op], x)


def test_first_derivatives_still_work_where_a_jvp_runs_inside_reverse_mode(rng):
    """grad through lax.scan linearizes the body with JVP tracers: no refusal there, and the
    gradient equals the one of the unrolled loop.
    """
    x = jnp.asarray(distinct(rng, (5,)), dtype=jnp.float32)

    def scanned(x):
        step = lambda c, _: (soj.soft_sort(c, 0.7) * 0.9, None)  # noqa: E731
        return jnp.sum(jax.lax.scan(step, x, None, length=2)[0] ** 2)

    def unrolled(x):
        for _ in range(2):
            x = soj.soft_sort(x, 0.7) * 0.9
        return jnp.sum(x**2)

    np.testing.assert_allclose(jax.grad(scanned)(x), jax.grad(unrolled)(x), rtol=1e-5)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x: soj.soft_rank(x, 1e-40), r"alpha=1e-40 rounds to 0\.0 in float32"),
        (lambda x: soj.soft_rank(x, 1e308), r"alpha=1e\+308 rounds to inf in float32"),
        (lambda x: soj.soft_rank(x, np.float32(1e-40)), r"rounds to 0\.0 in float32"),
        (lambda x: soj.soft_rank(x, np.array([0.5, 1e-40])), r"alpha=1e-40 rounds to 0\.0"),
        (lambda x: soj.soft_topk(x, 5 - 1e-12, 0.5), r"k=4\.999999999999 rounds to 5\.0"),
        (
            lambda x: soj.soft_quantile(x, np.nextafter(1.0, 0.0), 0.5),
            r"q=0\.9999999999999999 rounds to 1\.0 in float32",
        ),
        (
            lambda x: soj.topk_cross_entropy(x, jnp.array([0, 1]), [0.5, 0.5 - 9.99e-7], 0.5),
            r"p_k, which sums to 0\.99999900.*sums to 0\.99999898.* once rounded .*float32",
        ),
    ],
)
def test_float32_checks_the_value_the_kernels_see(call, match):
    """Concrete values are checked after rounding to float32 (subnormals flush to zero, as
    XLA does), at trace time, naming the value given and the value it becomes.
    """
    x = jnp.arange(10.0).reshape(2, 5)
    with pytest.raises(ValueError, match=match + ".*, the dtype this call computes in"):
        call(x)
    with pytest.raises(ValueError, match=match):
        jax.jit(call)(x)


def test_float64_keeps_values_that_float32_would_round_away(x64):
    x = jnp.arange(10.0).reshape(2, 5)
    assert x.dtype == jnp.float64
    assert bool(jnp.all(jnp.isfinite(soj.soft_rank(x, 1e-40))))
    assert bool(jnp.all(jnp.isfinite(soj.soft_topk(x, 5 - 1e-12, 0.5))))
    with pytest.raises(ValueError, match=r"alpha=1e-40 rounds to 0\.0 in float32"):
        soj.soft_rank(x.astype(jnp.float32), 1e-40)  # float32 input computes in float32


def test_primal_call_skips_the_residuals(rng, monkeypatch):
    """Without a gradient the forward callback returns only the result."""
    monkeypatch.setattr(soj, "_FFI_CALLS", False)  # soft_sort's callbacks, not its FFI route
    x = jnp.asarray(distinct(rng, (6,)), dtype=jnp.float32)

    def callbacks(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "buffer_callback":  # the CPU's callbacks
                found.append([v.aval.dtype.name for v in eqn.outvars])
            for param in eqn.params.values():  # nested jaxprs (pjit, custom_vjp_call)
                sub = getattr(param, "jaxpr", param)
                if hasattr(sub, "eqns"):
                    found += callbacks(sub)
        return found

    primal = callbacks(jax.make_jaxpr(lambda x: soj.soft_sort(x, 0.5))(x).jaxpr)
    assert primal == [["float32"]]
    grad = callbacks(jax.make_jaxpr(jax.grad(lambda x: soj.soft_sort(x, 0.5).sum()))(x).jaxpr)
    assert len(grad) == 2 and grad[0] == ["float32", "uint32", "uint32", "uint32"]  # 64-bit words


def test_alpha_in_the_keepdims_shape(rng, x64, count_calls):
    """``alpha = x.std(axis, keepdims=True)`` is one alpha per row, in JAX too: the NumPy API's
    values, gradients checked numerically (in that shape), and under vmap one batched call.
    """
    x = jnp.asarray(distinct(rng, (3, 6)))
    for axis in (0, -1):
        alpha = 0.3 + jnp.std(x, axis=axis, keepdims=True)
        out = soj.soft_sort(x, alpha, axis=axis)
        expected = softorder.soft_sort(np.asarray(x), np.asarray(alpha), axis=axis)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-12)
        g = jax.grad(lambda a, axis=axis: jnp.sum(soj.soft_rank(x, a, axis=axis) ** 2))(alpha)
        assert g.shape == alpha.shape
        check_grads(
            lambda x, a, axis=axis: soj.soft_topk(x, 1.5, a, axis=axis),
            (x, alpha),
            order=1,
            modes=["rev"],
            eps=1e-6,
        )
    xs = jnp.stack([x, 2 * x])
    alphas = 0.3 + jnp.std(xs, axis=-1, keepdims=True)  # (2, 3, 1)
    count_calls["forward"] = 0
    batched = jax.vmap(lambda x, a: soj.soft_rank(x, a))(xs, alphas)
    assert count_calls["forward"] == 1
    for i in range(2):
        np.testing.assert_allclose(batched[i], soj.soft_rank(xs[i], alphas[i]), rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_callbacks_run_the_numpy_apis_kernels(rng, dtype, monkeypatch):
    """NumPy sees XLA's buffers as read-only arrays, for which numba would compile every kernel
    again: the callbacks hand the kernels writable ones, so a JAX call compiles nothing the
    NumPy API has compiled (in a fresh cache: half the first call's compile time).
    """
    monkeypatch.setattr(soj, "_FFI_CALLS", False)  # (a traced alpha takes it where it can)
    x = distinct(rng, (3, 9)).astype(dtype)
    before = read_only_signatures()
    cases = [
        ("soft_quantile", (np.array([[0.3, 0.8]]),)),
        ("soft_permutation", ()),
        ("topk_cross_entropy", (np.array([0, 2, 1]), np.array([0.5, 0.5]))),
        ("permutation_cross_entropy", (np.tile(np.arange(1, 10), (3, 1)),)),
        ("soft_rank", ()),
    ]
    with jax.enable_x64(dtype == "float64"):
        for name, extras in cases:
            fn = getattr(soj, name)
            args = [jnp.asarray(a) for a in extras]
            grad = jax.jit(jax.grad(lambda u, a, fn=fn, args=args: fn(u, *args, a).sum(), (0, 1)))
            jax.block_until_ready(grad(jnp.asarray(x), 0.5))
    assert read_only_signatures() == before


#: (function, extra arguments, argnums to differentiate), on the callbacks
IN_PLACE_CASES = {
    "soft_quantile": (soj.soft_quantile, (np.array([[0.2, 0.5, 0.9]]),), (0, 1, 2)),
    "soft_permutation": (soj.soft_permutation, (), (0, 1)),
    "topk_cross_entropy": (soj.topk_cross_entropy, (np.array([0, 4, 2]), [0.5, 0.5]), (0, 3)),
    "permutation_cross_entropy": (
        soj.permutation_cross_entropy,
        (np.array([[3, 1, 2, 5, 4], [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]]),),
        (0, 2),
    ),
    "soft_rank traced alpha": (soj.soft_rank, (), (0, 1)),
}


@pytest.mark.parametrize("case", IN_PLACE_CASES)
@pytest.mark.parametrize("x64_on", [False, True])
def test_in_place_callbacks_equal_pure_callback_bitwise(case, x64_on, rng, monkeypatch):
    """On the CPU the callbacks run the kernels on XLA's buffers (buffer_callback); with
    ``_IN_PLACE = False`` they take pure_callback: the same values and gradients to the bit,
    under jit, grad (every differentiable argument) and vmap.
    """
    fn, extra, argnums = IN_PLACE_CASES[case]
    monkeypatch.setattr(soj, "_FFI_CALLS", False)  # (a traced alpha takes it where it can)
    x = distinct(rng, (3, 5))
    with jax.enable_x64(x64_on):
        args = (jnp.asarray(x), *(jnp.asarray(a) for a in extra), jnp.asarray(0.7))

        def loss(*a):
            out = fn(*a)
            return jnp.sum(out * jnp.arange(1.0, out.size + 1.0).reshape(out.shape))

        def run():
            value = jax.jit(fn)(*args)
            grads = jax.jit(jax.grad(loss, argnums))(*args)
            rows = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0,) + (None,) * (len(args) - 1)))
            batched = rows(jnp.stack([args[0], -args[0]]), *args[1:])
            return jax.tree.map(np.asarray, (value, grads, batched))

        in_place = run()
        text = jax.jit(jax.grad(loss, argnums)).lower(*args).as_text()
        assert "xla_buffer_python_cpu_callback" in text and "xla_ffi_python" not in text
        monkeypatch.setattr(soj, "_IN_PLACE", False)
        copied = run()
        text = jax.jit(jax.grad(loss, argnums)).lower(*args).as_text()
        assert "xla_ffi_python_cpu_callback" in text and "buffer_callback" not in text
    for got, expected in zip(jax.tree.leaves(in_place), jax.tree.leaves(copied), strict=True):
        np.testing.assert_array_equal(got, expected, strict=True)
        assert np.isfinite(got).all()


def test_a_complex_input_is_refused_under_its_own_name():
    """As the NumPy API says it: ``logits`` for the top-k loss, not ``x``."""
    logits, labels = jnp.ones((2, 3), jnp.complex64), jnp.array([0, 1])
    with pytest.raises(TypeError, match="^logits must be real"):
        soj.topk_cross_entropy(logits, labels, [1.0])
    with pytest.raises(TypeError, match="^logits must be real"):
        softorder.topk_cross_entropy(np.asarray(logits), np.asarray(labels), [1.0])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda f: f.soft_rank(None), TypeError, "^x must be a numeric array; got dtype object"),
        (lambda f: f.soft_rank(np.array(["a", "b"])), TypeError, "^x must be a numeric array"),
        (lambda f: f.soft_sort([[1.0, 2.0], [3.0]]), ValueError, "^x must be a rectangular"),
        (lambda f: f.topk_cross_entropy("ab", [0], [1.0]), TypeError, "^logits must be a numeric"),
        (lambda f: f.soft_topk(np.ones((2, 3)), [[1.0], [2.0, 1.5]]), ValueError, "^k must be a"),
    ],
)
def test_unreadable_arguments_are_refused_under_their_own_names(call, error, match):
    """None, strings and ragged lists: JAX's own errors ("None is not a valid value for
    jnp.array", "Error interpreting argument to stage as a JAX value", NumPy's "setting an
    array element with a sequence") named neither softorder nor the argument; now the NumPy
    API's.
    """
    with pytest.raises(error, match=match):
        call(softorder)
    with pytest.raises(error, match=match):
        call(soj)
    with pytest.raises(ValueError, match="^alpha must be a rectangular array"):
        soj.soft_rank(np.ones((2, 3)), [0.5, [1.0]])  # (the NumPy API's words name no argument)
