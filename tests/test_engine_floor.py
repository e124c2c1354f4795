"""The engine's per-call fast paths (argument binding, layouts, host arrays used as they are)
give what the general paths give: the same values bit for bit, the same errors, inputs and
cotangents never written.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

import softorder
from softorder._engine.autodiff import bind
from softorder._engine.layout import _MAX_LAYOUTS, Layout
from tests.compiled import read_only_signatures

OPERATIONS = {
    "soft_rank": (),
    "soft_sort": (),
    "soft_topk": (3,),
    "log_soft_topk": (3,),
    "soft_quantile": (0.3,),
    "soft_permutation": (),
}


def _signature_bind(fn, args, kwargs) -> dict:
    full = fn.signature.bind(*args, **kwargs)
    full.apply_defaults()
    return dict(full.arguments)


CALLS = [
    ((1.0,), {}),
    ((1.0, 0.5), {}),
    ((1.0,), {"alpha": 0.5, "axis": 0}),
    ((), {"x": 1.0}),
    ((), {"axis": 0, "x": 1.0, "alpha": 2.0}),
]


@pytest.mark.parametrize("name", sorted(OPERATIONS))
@pytest.mark.parametrize("call", range(len(CALLS)))
def test_bind_gives_what_signature_bind_gives(name, call):
    fn = getattr(softorder, name)
    args, kwargs = CALLS[call]
    args = args[:1] + OPERATIONS[name] + args[1:] if args else args
    if not args:
        second = next(iter(list(fn.signature.parameters)[1:2]))
        if OPERATIONS[name] and second != "alpha":
            kwargs = {**kwargs, second: OPERATIONS[name][0]}
    got = bind(fn.signature, args, kwargs)
    expected = _signature_bind(fn, args, kwargs)
    assert got == expected
    assert list(got) == list(expected)  # in signature order


BAD_CALLS = [
    ((), {}),  # missing x
    ((1.0, 0.5, 0.5, 0.5, 0.5), {}),  # too many positional
    ((1.0,), {"bogus": 1}),  # unknown keyword
    ((1.0,), {"x": 1.0}),  # x twice
    ((1.0, 0.5, -1), {}),  # axis is keyword-only
]


@pytest.mark.parametrize("call", range(len(BAD_CALLS)))
def test_a_bad_call_raises_signature_binds_error(call):
    fn = softorder.soft_rank
    args, kwargs = BAD_CALLS[call]
    with pytest.raises(TypeError) as expected:
        _signature_bind(fn, args, kwargs)
    for attempt in (
        lambda: bind(fn.signature, args, kwargs),
        lambda: fn(*args, **kwargs),
        lambda: softorder.vjp(fn, *args, **kwargs),
    ):
        with pytest.raises(TypeError) as got:
            attempt()
        assert str(got.value) == str(expected.value)


def test_a_type_error_of_the_rule_is_not_taken_for_a_bad_call():
    """The operations bind and prepare in one generated function (``start``): a TypeError
    raised inside the rule (an argument's own check) comes out as the rule raised it, once,
    and is not answered with ``Signature.bind``'s (which would bind these calls fine).
    """
    x = np.arange(4.0)
    masked = np.ma.array(x)
    for attempt, message in (
        (lambda: softorder.soft_rank(x, descending="no"), "descending must be a bool"),
        (lambda: softorder.vjp(softorder.soft_topk, x, 2, largest=1), "largest must be a bool"),
        (lambda: softorder.soft_sort(masked), "x is a numpy.ma.MaskedArray"),
        (lambda: softorder.vjp(softorder.soft_rank, x, alpha="a"), "alpha must be a positive"),
    ):
        with pytest.raises(TypeError, match=message) as got:
            attempt()
        assert got.value.__context__ is None  # not raised while handling another error


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_start_prepares_what_bind_prepares(name):
    fn = getattr(softorder, name)
    rule = fn.rule
    x = np.random.default_rng(3).standard_normal((5, 6))
    for args, kwargs in (
        ((x, *OPERATIONS[name]), {}),
        ((x, *OPERATIONS[name], 0.5), {"axis": 0}),
        (
            (),
            {
                "x": x,
                "alpha": 2.0,
                **dict(zip(list(fn.signature.parameters)[1:2], OPERATIONS[name], strict=False)),
            },
        ),
    ):
        expected = rule.forward(rule.prepare(**bind(fn.signature, args, kwargs)))
        assert rule.forward(fn.start(*args, **kwargs)).tobytes() == expected.tobytes()
        assert fn(*args, **kwargs).tobytes() == expected.tobytes()


def test_bind_of_any_signature():
    def f(a, /, b, *c, d=1, **e): ...

    signature = inspect.signature(f)
    assert bind(signature, (1, 2, 3), {"g": 4}) == _bound(signature, (1, 2, 3), {"g": 4})

    def g(a, b=2, *, c, d=4): ...

    signature = inspect.signature(g)
    assert bind(signature, (1,), {"c": 3}) == {"a": 1, "b": 2, "c": 3, "d": 4}
    with pytest.raises(TypeError, match="missing a required argument: 'c'"):
        bind(signature, (1,), {})


def _bound(signature, args, kwargs):
    full = signature.bind(*args, **kwargs)
    full.apply_defaults()
    return dict(full.arguments)


def test_layouts_are_reused_and_errors_are_not():
    assert Layout.of((3, 4), -1) is Layout.of((3, 4), -1)
    assert Layout.of((3, 4), 0) == Layout(batch_shape=(4,), axis=0, ndim=2, n=3)
    assert Layout.of([3, 4], np.int64(-1)) == Layout.of((3, 4), -1)  # not cached: same result
    for _ in range(2):
        with pytest.raises(ValueError, match="empty axis"):
            Layout.of((3, 0), -1)
        with pytest.raises(ValueError, match="out of range"):
            Layout.of((3, 4), 2)
        with pytest.raises(TypeError, match="axis must be an integer"):
            Layout.of((3, 4), True)
        with pytest.raises(ValueError, match="x must have at least one axis"):
            Layout.of((), -1)
    for n in range(1, 2 * _MAX_LAYOUTS):  # the cache stays bounded
        Layout.of((n,), -1)
    from softorder._engine.layout import _LAYOUTS

    assert len(_LAYOUTS) <= _MAX_LAYOUTS


def _forward_backward(name, x, v, **kwargs):
    fn = getattr(softorder, name)
    out, pullback = softorder.vjp(fn, x, *OPERATIONS[name], 0.5, **kwargs)
    return out, pullback(v)


CASES = ["soft_rank", "soft_sort", "soft_topk", "log_soft_topk"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("flag", [False, True])
def test_the_fast_path_matches_the_general_one_bitwise(name, flag):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 7))
    x[1, 2] = x[1, 4]  # a tie
    x[2, :] = [np.inf, 0.0, -np.inf, 1.0, 1.0, 2.0, -3.0]
    v = rng.standard_normal((3, 7))
    kwargs = {"largest": flag} if "topk" in name else {"descending": flag}
    x0, v0 = x.copy(), v.copy()
    out, grads = _forward_backward(name, x, v, **kwargs)
    # the same rows along axis 0 of a transposed copy, given as a non-contiguous view
    xt, vt = np.asfortranarray(x.T), v.T[:, :]
    out_t, grads_t = _forward_backward(name, xt, vt, axis=0, **kwargs)
    np.testing.assert_array_equal(x, x0)  # inputs and cotangents never written
    np.testing.assert_array_equal(v, v0)
    assert out.tobytes() == np.ascontiguousarray(out_t.T).tobytes()
    assert grads[0].tobytes() == np.ascontiguousarray(grads_t[0].T).tobytes()
    for g, gt in zip(grads[1:], grads_t[1:], strict=True):
        assert np.asarray(g).tobytes() == np.asarray(gt).tobytes()
    # a list (converted) and a strided view of the same values give the same bits too
    wide = np.zeros((3, 14))
    wide[:, ::2] = x
    out_s, grads_s = _forward_backward(name, wide[:, ::2], v.tolist(), **kwargs)
    assert out.tobytes() == out_s.tobytes()
    assert grads[0].tobytes() == grads_s[0].tobytes()
    # results and gradients are new arrays: nothing aliases the caller's
    for result in (out, grads[0]):
        assert not np.may_share_memory(result, x) and not np.may_share_memory(result, v)


@pytest.mark.parametrize("name", CASES)
def test_float32_and_single_elements(name):
    n_extra = OPERATIONS[name]
    for n in ([1] if not n_extra else []) + [5]:
        x = np.linspace(-1.0, 1.0, n).astype(np.float32)
        out, (x_bar, *rest) = _forward_backward(name, x, np.ones(n, np.float32))
        assert out.dtype == np.float32 and x_bar.dtype == np.float32
        ref, (ref_bar, *_) = _forward_backward(name, x.astype(np.float64), np.ones(n))
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(x_bar, ref_bar, rtol=1e-5, atol=1e-5)
        assert isinstance(rest[-1], np.float32)  # alpha's gradient: a scalar of x's dtype


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_, np.float16])
def test_non_float64_inputs_reach_the_sort_as_float64(dtype, monkeypatch):
    """Integer, boolean and float16 inputs are converted before the rows are sorted (the host
    kernels are compiled for float64 rows only), and give the float64 input's values (in
    float16 for float16).
    """
    from softorder._engine.backend import NUMPY

    seen, sort_rows = [], NUMPY.sort_rows

    def recording(rows2d, order=None):
        seen.append(rows2d.dtype)
        return sort_rows(rows2d, order)

    monkeypatch.setattr(NUMPY, "sort_rows", recording)
    x = np.array([[3, 1, 0, 2, 1]]).astype(dtype)
    for name in CASES:
        out, grads = _forward_backward(name, x, np.ones((1, 5)))
        ref, ref_grads = _forward_backward(name, x.astype(np.float64), np.ones((1, 5)))
        # (float16 results: the float64 ones, rounded once)
        np.testing.assert_array_equal(out, ref.astype(out.dtype))
        np.testing.assert_array_equal(grads[0], ref_grads[0].astype(grads[0].dtype))
    assert seen and all(d == np.float64 for d in seen)


def test_nan_rows_stay_in_their_row():
    x = np.array([[0.0, np.nan, 1.0], [0.0, 2.0, 1.0]])
    out, (x_bar, alpha_bar) = _forward_backward("soft_rank", x, np.ones((2, 3)))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    assert np.isfinite(x_bar[1]).all()


@pytest.mark.parametrize("name", CASES)
def test_cotangent_errors_on_the_fast_path(name):
    x = np.arange(5.0)
    _, pullback = softorder.vjp(getattr(softorder, name), x, *OPERATIONS[name], 0.5)
    with pytest.raises(ValueError, match=r"cotangent must have shape \(5,\); got \(4,\)"):
        pullback(np.ones(4))
    with pytest.raises(ValueError, match=r"cotangent must have shape \(5,\); got \(1, 5\)"):
        pullback(np.ones((1, 5)))
    with pytest.raises(TypeError, match="cotangent is a numpy.ma.MaskedArray"):
        pullback(np.ma.masked_array(np.ones(5), mask=[0, 1, 0, 0, 0]))
    with pytest.raises(TypeError, match="cotangent must be real"):
        pullback(np.ones(5, complex))


def test_input_errors_on_the_fast_path():
    with pytest.raises(TypeError, match="x is a numpy.ma.MaskedArray"):
        softorder.soft_rank(np.ma.masked_array(np.ones(3)))
    with pytest.raises(TypeError, match="x must be real"):
        softorder.soft_rank(np.ones(3, complex))
    with pytest.raises(ValueError, match="alpha must be positive and finite"):
        softorder.soft_rank(np.ones(3), -1.0)
    with pytest.raises(ValueError, match="k must lie strictly between 0 and n=3"):
        softorder.soft_topk(np.ones(3), 3)
    with pytest.raises(TypeError, match="descending must be a bool"):
        softorder.soft_sort(np.ones(3), descending="no")


def test_alpha_gradient_has_alpha_shape():
    x = np.random.default_rng(1).standard_normal((2, 4))
    v = np.ones((2, 4))
    for alpha, shape in [(0.5, ()), (np.float64(0.5), ()), (np.full(2, 0.5), (2,))]:
        _, pullback = softorder.vjp(softorder.soft_rank, x, alpha)
        alpha_bar = pullback(v)[1]
        assert np.shape(alpha_bar) == shape
    scalar = softorder.vjp(softorder.soft_rank, x, 0.5)[1](v)[1]
    per_row = softorder.vjp(softorder.soft_rank, x, np.full(2, 0.5))[1](v)[1]
    assert scalar == per_row.sum()


def test_per_row_alpha_and_read_only_arguments_compile_no_second_kernel():
    """A per-row ``alpha`` (``broadcast_to`` gives a read-only view) or a caller's read-only
    ``alpha`` or labels reach the kernels as writable arrays: numba would otherwise compile each
    kernel again for read-only arrays (seconds on a first call), and ``alpha`` is never aliased.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 9))
    alpha = np.full(3, 0.5)
    frozen = np.full(3, 0.5)
    frozen.flags.writeable = False
    labels = np.array([0, 2, 1])
    labels.flags.writeable = False
    before = read_only_signatures()
    for a in (alpha, frozen):
        out, pullback = softorder.vjp(softorder.soft_quantile, x, 0.3, alpha=a)
        pullback(np.ones_like(out))
        out, pullback = softorder.vjp(
            softorder.topk_cross_entropy, x, labels, np.array([0.5, 0.5]), alpha=a
        )
        pullback(np.ones_like(out))
    assert read_only_signatures() == before
    assert np.array_equal(alpha, np.full(3, 0.5)) and alpha.flags.writeable


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_per_row_alpha_is_checked_like_any_alpha(dtype):
    """One alpha per row, shaped like the batch (the common case of a bridge's call): the same
    per-row values as a list gives, a writable copy that never aliases the caller's array, and
    the same errors for a zero, negative, subnormal-in-float64, infinite or NaN entry.
    """
    from softorder._engine.checks import check_alpha

    alpha = np.array([[0.5, 2.0], [1e-3, 7.0]], dtype=dtype)
    per_row, shape = check_alpha(alpha, (2, 2))
    listed, _ = check_alpha(alpha.tolist(), (2, 2))
    assert shape == (2, 2) and per_row.dtype == np.float64
    assert np.array_equal(per_row, listed) and per_row.flags.writeable
    assert not np.shares_memory(per_row, alpha)
    for bad in (0.0, -1.0, np.inf, np.nan):
        wrong = np.array([0.5, bad], dtype=dtype)
        with pytest.raises(ValueError, match="alpha must be"):
            check_alpha(wrong, (2,))
    with pytest.raises(ValueError, match="alpha must be at least"):
        check_alpha(np.array([0.5, 1e-310]), (2,))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(2,), (2, 3)])
def test_per_row_targets_are_checked_like_any_targets(dtype, shape):
    """Targets already shaped one (or m) per row, as the bridges' callbacks pass them: the same
    values, flag and shape as a list gives, and the same errors for an entry out of range."""
    from softorder._engine.checks import check_targets

    q = np.linspace(0.1, 0.9, math.prod(shape)).reshape(shape).astype(dtype)
    fast = check_targets(q, (2,), "q", 1.0, "1")
    general = check_targets(q.tolist(), (2,), "q", 1.0, "1")
    assert np.array_equal(fast[0], general[0]) and fast[1:] == general[1:]
    assert fast[0].flags.writeable and not np.shares_memory(fast[0], q)
    for bad in (0.0, 1.0, -0.5, np.nan, np.inf):
        wrong = q.copy()
        wrong.flat[-1] = bad
        with pytest.raises(ValueError, match="q must lie strictly between 0 and 1"):
            check_targets(wrong, (2,), "q", 1.0, "1")


@pytest.mark.parametrize("value", [[0.25, 0.5, 0.75], (0.5,), [1, 0.5], [0.3, 0.3]])
def test_a_list_of_targets_of_one_row_is_checked_like_any_targets(value):
    """One row's targets as a list of numbers (``soft_quantile(x, [0.25, 0.5, 0.75])``): the
    same values, flag and shape as the general path gives (NumPy numbers in the list take
    it), and the same errors for an entry out of range or a bool."""
    from softorder._engine.checks import check_targets

    high = 2.0
    fast = check_targets(value, (), "k", high, "n=2")
    general = check_targets([np.float64(v) for v in value], (), "k", high, "n=2")
    assert np.array_equal(fast[0], general[0]) and fast[1:] == general[1:]
    assert fast[0].dtype == np.float64 and fast[0].shape == (1, len(value))
    for bad in (0, 2.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k must lie strictly between 0 and n=2"):
            check_targets([*value, bad], (), "k", high, "n=2")
    with pytest.raises(TypeError, match="not a bool"):
        check_targets([True, False], (), "k", high, "n=2")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_per_row_p_k_is_checked_like_any_p_k(dtype):
    """``p_k`` already one distribution per row (as the bridges' callbacks pass it): the same
    float64 array as a list gives, never aliased, and the same errors for a negative, NaN or
    infinite entry, a sum off 1, or K >= n."""
    from softorder._engine.checks import check_p_k

    p_k = np.array([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]], dtype=dtype)
    fast = check_p_k(p_k, (3,), 5)
    assert np.array_equal(fast, check_p_k(p_k.tolist(), (3,), 5))
    assert fast.dtype == np.float64 and not np.shares_memory(fast, p_k)
    for bad in (-0.25, np.nan, np.inf, 0.6):
        wrong = p_k.copy()
        wrong[1, 1] = bad
        with pytest.raises(ValueError, match="p_k must be a probability distribution"):
            check_p_k(wrong, (3,), 5)
    with pytest.raises(ValueError, match="top-k needs k < number of classes"):
        check_p_k(p_k, (3,), 2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("batch", [(), (1,), (3,), (2, 3)])
def test_one_p_k_for_every_row_is_the_tiled_p_k(dtype, batch):
    """A single distribution (a list, or an array of shape (K,)) is every row's: the same
    float64 rows as the tiled array, a copy, and the same errors as the general path."""
    from softorder._engine.checks import check_p_k

    one = np.array([0.25, 0.75], dtype=dtype)
    tiled = check_p_k(np.tile(one, batch + (1,)), batch, 5)
    for given in (one, one.tolist(), tuple(one.tolist())):
        got = check_p_k(given, batch, 5)
        assert got.shape == batch + (2,) and got.dtype == np.float64
        assert np.array_equal(got, tiled) and not np.shares_memory(got, one)
    for bad in ([-0.25, 1.25], [np.nan, 1.0], [np.inf, 0.0], [0.5, 0.6]):
        with pytest.raises(ValueError, match="p_k must be a probability distribution"):
            check_p_k(bad, batch, 5)
    with pytest.raises(TypeError, match="p_k must hold probabilities, not bools"):
        check_p_k([True, False], batch, 5)
    with pytest.raises(ValueError, match="top-k needs k < number of classes"):
        check_p_k(one.tolist(), batch, 2)
    # a bfloat16-exact distribution off 1 by more than 1e-6 takes the general path's tolerance
    bf16 = check_p_k([0.2998046875, 0.69921875], batch, 5)
    assert np.array_equal(bf16[..., 0], np.full(batch, 0.2998046875))


@pytest.mark.parametrize("name", ["topk_cross_entropy", "permutation_cross_entropy"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_loss_cotangent_scalar_is_the_per_row_cotangent(name, reduction, dtype):
    """A scalar cotangent of a reduced loss (Python float, NumPy scalar or 0-d array, as
    ``np.ones_like`` gives) pulls back as the per-row cotangents of ``reduction="none"`` do:
    the cotangent widened to float64, times 1/rows for the mean, in one rounding; the loss
    itself is the float64 reduction rounded once to the input's dtype."""
    rng = np.random.default_rng(3)
    rows, n = 3, 6
    x = rng.standard_normal((rows, n)).astype(dtype)
    if name == "topk_cross_entropy":
        extra = (np.array([0, 4, 2]), [0.5, 0.5])
    else:
        extra = (np.argsort(rng.standard_normal((rows, n)), axis=-1) + 1,)
    fn = getattr(softorder, name)
    per_row, pull_rows = softorder.vjp(fn, x, *extra, alpha=0.3, reduction="none")
    out, pullback = softorder.vjp(fn, x, *extra, alpha=0.3, reduction=reduction)
    # (a float32 input's values widen exactly: the float64 call's per-row losses are its own)
    total = np.sum(fn(x.astype(np.float64), *extra, alpha=0.3, reduction="none"))
    if reduction == "mean":
        total = total * (1.0 / rows)
    assert type(out) is np.dtype(dtype).type and out == dtype(total)
    scale = 1.0 / rows if reduction == "mean" else 1.0
    for cotangent in (0.1, np.float64(0.1), np.float32(0.1), np.array(0.1, dtype), 3):
        expected = pull_rows(np.full(rows, float(cotangent) * scale).astype(per_row.dtype))
        if dtype == np.float32 and float(cotangent) * scale != float(
            np.float32(float(cotangent) * scale)
        ):
            continue  # (a float32 per-row cotangent cannot hold the float64 product)
        got = pullback(cotangent)
        for g, e in zip(got, expected, strict=True):
            assert _bits(g) == _bits(e)


def _bits(value) -> tuple:
    """A gradient's type, dtype, shape and bytes (NaN payloads and signed zeros included)."""
    arr = np.asarray(value)
    return type(value), arr.dtype, arr.shape, arr.tobytes()


def _alpha_bars(rows: int) -> dict:
    """Per-row alpha gradients that a sum or a cast could round, overflow or turn to NaN."""
    rng = np.random.default_rng(rows)
    wide = rng.standard_normal(rows) * 10.0 ** rng.integers(-300, 300, rows)
    cases = {
        "normal": rng.standard_normal(rows),
        "wide": wide,  # (the order of a pairwise sum shows in its bits)
        "negative_zero": np.full(rows, -0.0),
        "nan": np.where(np.arange(rows) == rows // 2, np.nan, 1.0),
        "overflow": np.full(rows, 1.5e308),  # (a sum of more than one overflows)
        "beyond_float32": np.full(rows, 3e38) * np.where(np.arange(rows) % 2, 1.0, 1.5),
        "subnormal": np.full(rows, 5e-324),
    }
    if rows > 1:
        cases["inf_minus_inf"] = np.where(np.arange(rows) == 0, np.inf, -np.inf)
    return cases


@pytest.mark.parametrize(
    "batch", [(), (1,), (1, 1), (2,), (8,), (2, 4), (3, 5, 7), (16, 16), (256,)]
)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_scalar_alpha_gradient_is_the_general_paths_sum(batch, dtype):
    """One alpha for every row of a host call: alpha_grad's sum of the per-row gradients gives
    the general path's (unbroadcast's sum over the batch axes, then the cast) to the bit, with
    the same type and the same warnings (an overflowing sum warns; inf - inf does not)."""
    import warnings

    from softorder._engine.layout import Rows
    from softorder._engine.rules import Context

    rows = Rows.from_input(np.zeros(batch + (3,), dtype))
    ctx = Context.of(rows, 0.5)
    assert ctx.alpha_shape == ()
    for name, alpha_bar in _alpha_bars(math.prod(batch)).items():
        results = []
        for path in (ctx.alpha_grad, ctx._alpha_grad_general):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                grad = path(alpha_bar.copy())
            results.append((_bits(grad), [str(w.message) for w in caught]))
        assert results[0] == results[1], name


@pytest.mark.parametrize(
    "batch, alpha",
    [((8,), np.full(8, 0.5)), ((8,), np.full(1, 0.5)), ((2, 4), np.full((2, 1), 0.5))],
)
def test_alpha_arrays_take_the_general_gradient_path(batch, alpha, monkeypatch):
    """Only one alpha for every row (shape ()) takes alpha_grad's sum; an alpha array, per row
    or broadcast, takes the general path (its sum over the broadcast axes only)."""
    from softorder._engine.layout import Rows
    from softorder._engine.rules import Context

    calls = []
    general = Context._alpha_grad_general

    def counted(self, alpha_bar):
        calls.append(alpha_bar.shape)
        return general(self, alpha_bar)

    monkeypatch.setattr(Context, "_alpha_grad_general", counted)
    rows = Rows.from_input(np.zeros(batch + (3,)))
    Context.of(rows, 0.5).alpha_grad(np.ones(math.prod(batch)))
    assert calls == []
    grad = Context.of(rows, alpha).alpha_grad(np.ones(math.prod(batch)))
    assert calls == [(math.prod(batch),)] and grad.shape == alpha.shape


@pytest.mark.parametrize("name", ["soft_rank", "soft_sort", "soft_topk", "soft_quantile"])
def test_an_unwanted_alpha_gradient_is_none_and_the_others_keep_their_bits(name):
    """A context whose alpha gradient nobody wants (a bridge's alpha given as a number) gives
    None for it, and the other gradients to the bit."""
    fn = getattr(softorder, name)
    rule = fn.rule
    extra = OPERATIONS[name]
    x = np.random.default_rng(4).standard_normal((3, 9))
    v = np.random.default_rng(5).standard_normal(fn(x, *extra).shape)
    arguments = bind(fn.signature, (x, *extra, 0.5), {})
    wanted, unwanted = rule.prepare(**arguments), rule.prepare(**arguments)
    rule.forward(wanted)
    rule.forward(unwanted)
    unwanted.alpha_wanted = False
    full, partial = rule.vjp(wanted, v), rule.vjp(unwanted, v)
    position = rule.differentiable.index("alpha")
    assert partial[position] is None and full[position] is not None
    for i, (a, b) in enumerate(zip(full, partial, strict=True)):
        if i != position:
            assert _bits(a) == _bits(b)


@pytest.mark.parametrize("batch", [(), (1,), (1, 1), (8,), (2, 4), (16, 16)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("k", [2, np.array(2.0)])
def test_one_target_gradient_is_the_general_paths_sum(batch, dtype, k):
    """One k (or q) for every row of a host call: Targets.grad_to_user's sum of the per-row
    gradients gives the general path's to the bit, as a 0-d array, with the same warnings."""
    import warnings

    from softorder._engine.layout import Rows, Targets

    rows = Rows.from_input(np.zeros(batch + (5,), dtype))
    targets = Targets.parse(k, rows, "k", 5.0, "n=5")
    assert targets.shape == () and not targets.multi
    for name, w_bar in _alpha_bars(rows.rows).items():
        results = []
        for path in (targets.grad_to_user, targets._grad_to_user_general):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                grad = path(w_bar.reshape(rows.rows, 1).copy(), rows, rows.dtype)
            results.append((_bits(grad), [str(w.message) for w in caught]))
        assert results[0] == results[1], name


@pytest.mark.parametrize(
    "k, shape", [(np.full(8, 2.0), (8,)), (np.full(1, 2.0), (1,)), (np.array([[1.0, 2.0]]), (1, 2))]
)
def test_target_arrays_take_the_general_gradient_path(k, shape, monkeypatch):
    """Only one target for every row (shape ()) takes grad_to_user's sum; per-row, broadcast
    or several targets per row take the general path."""
    from softorder._engine.layout import Rows, Targets

    calls = []
    general = Targets._grad_to_user_general

    def counted(self, w_bar, rows, dtype):
        calls.append(w_bar.shape)
        return general(self, w_bar, rows, dtype)

    monkeypatch.setattr(Targets, "_grad_to_user_general", counted)
    rows = Rows.from_input(np.zeros((8, 5)))
    one = Targets.parse(2.0, rows, "k", 5.0, "n=5")
    one.grad_to_user(np.ones((8, 1)), rows, rows.dtype)
    assert calls == []
    targets = Targets.parse(k, rows, "k", 5.0, "n=5")
    grad = targets.grad_to_user(np.ones((8, targets.m)), rows, rows.dtype)
    assert calls == [(8, targets.m)] and grad.shape == shape


ALPHAS = [
    0.5,
    3,
    2**53,
    np.float64(0.25),
    np.float32(0.1),
    np.float16(0.1),
    np.float32(1e-45),
    np.int64(7),
    np.uint8(2),
    np.array(0.5, np.float32),
]


@pytest.mark.parametrize("alpha", ALPHAS, ids=repr)
def test_check_alpha_scalars_as_the_general_path_converts_them(alpha):
    """Scalars taken without the general path give its float64 value, and no warning (a
    float16 compared with 2**53 would overflow)."""
    import warnings

    from softorder._engine.checks import check_alpha

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        per_row, shape = check_alpha(alpha, (2, 3), 1)
    want = np.broadcast_to(np.asarray(alpha, dtype=np.float64), (2, 3)).reshape(-1)
    assert shape == () and per_row.dtype == np.float64 and per_row.flags.writeable
    assert per_row.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    "alpha, message",
    [
        (0, "positive and finite"),
        (-2, "positive and finite"),
        (np.int64(0), "positive and finite"),
        (np.float32(-1.0), "positive and finite"),
        (np.float16(np.nan), "positive and finite"),
        (np.array([[0.5], [-1.0]]), "positive and finite"),
        (np.array([[0.5], [np.nan]]), "positive and finite"),
        (np.array([[0.5, 0.1]]), "does not broadcast"),
    ],
    ids=repr,
)
def test_check_alpha_refuses_what_the_fast_cases_pass_on(alpha, message):
    from softorder._engine.checks import check_alpha

    with pytest.raises(ValueError, match=message):
        check_alpha(alpha, (2,), 1)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_keepdims_alpha_per_row_is_the_general_paths(dtype):
    from softorder._engine.checks import alpha_rows, check_alpha

    alpha = np.random.default_rng(2).uniform(0.1, 2.0, (3, 1, 4)).astype(dtype)
    per_row, shape = check_alpha(alpha, (3, 4), 1)
    assert shape == (3, 1, 4) and per_row.flags.writeable and per_row.dtype == np.float64
    want, want_shape = alpha_rows(alpha, (3, 4), 1)  # (the general conversion, unchecked)
    assert want_shape == shape and per_row.tobytes() == want.tobytes()
    assert not np.may_share_memory(per_row, alpha)


@pytest.mark.parametrize(
    "k",
    [3, 2.5, np.int64(3), np.uint8(2), np.float64(2.5), np.array(4), np.array(4.5)],
    ids=repr,
)
def test_targets_parse_takes_numpy_scalars_as_check_targets_does(k):
    """A NumPy number (or 0-d array) k is taken on the scalar fast path: check_targets's
    float64 values and argsort, for every row; the same results as through the general path.
    """
    from softorder._engine.checks import check_targets
    from softorder._engine.layout import Rows, Targets

    x = np.random.default_rng(4).standard_normal((3, 8))
    rows = Rows.from_input(x, -1)
    targets = Targets.parse(k, rows, "k", 8.0, "n=8")
    values, multi, shape = check_targets(k, (3,), "k", 8.0, "n=8")
    assert targets.values.tobytes() == values.tobytes() and targets.values.dtype == values.dtype
    assert targets.order.tobytes() == np.argsort(values, axis=1).tobytes()
    assert (targets.multi, targets.shape, targets.m) == (multi, shape, 1)
    out, pullback = softorder.vjp(softorder.soft_topk, x, k, 0.5)
    want, want_pullback = softorder.vjp(softorder.soft_topk, x, np.array([float(k)] * 3), 0.5)
    assert out.tobytes() == want.tobytes()
    v = np.ones((3, 8))
    x_bar, k_bar, _ = pullback(v)
    want_x_bar, want_k_bar, _ = want_pullback(v)
    assert x_bar.tobytes() == want_x_bar.tobytes() and k_bar.shape == ()
    assert k_bar == want_k_bar.sum()


@pytest.mark.parametrize(
    "shape, source, destination",
    [
        ((2, 3, 4), 0, -1),
        ((2, 3, 4), 1, -1),
        ((2, 3, 4), [2], [0]),
        ((2, 3, 4, 5), [2, 3], [0, 1]),
        ((2, 3, 4, 5), [1, 2], [3, 0]),
        ((5,), 0, -1),
    ],
)
def test_host_moveaxis_is_numpys(shape, source, destination):
    from softorder._engine.backend import NUMPY

    a = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    for _ in range(2):  # computed, then reused
        got = NUMPY.moveaxis(a, source, destination)
        want = np.moveaxis(a, source, destination)
        assert got.shape == want.shape and got.strides == want.strides
        assert np.shares_memory(got, a) and np.array_equal(got, want)
    with pytest.raises(ValueError):  # (numpy.exceptions.AxisError)
        NUMPY.moveaxis(a, len(shape), 0)


def _bits(a) -> bytes:
    a = np.asarray(a)
    return a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("shape", [(100,), (1, 100), (3, 7)])
def test_small_rank_paths_match_the_general_ones(dtype, descending, shape):
    """soft_rank's lean small paths (contiguous rows, float64, a float64 cotangent of the
    result's shape, one float alpha) give the general paths' bits: those of a non-contiguous
    input, a non-contiguous cotangent and a 0-d alpha array."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(dtype)
    x.flat[1] = np.nan
    v = rng.standard_normal(shape).astype(dtype)
    strided_x = np.repeat(x, 2, axis=-1)[..., ::2]
    strided_v = np.repeat(v, 2, axis=-1)[..., ::2]
    kw = dict(descending=descending)
    y, pullback = softorder.vjp(softorder.soft_rank, x, 0.5, **kw)
    y2, pullback2 = softorder.vjp(softorder.soft_rank, strided_x, np.array(0.5), **kw)
    assert _bits(y) == _bits(y2)
    for a, b in zip(pullback(v), pullback2(strided_v), strict=True):
        assert _bits(a) == _bits(b)


@pytest.mark.parametrize("q", [[0.3], [0.2, 0.7, 0.4], (0.6,), [1]])
@pytest.mark.parametrize("shape", [(1, 9), (3, 9), (2, 3, 9)])
def test_targets_as_lists_with_batch_axes(q, shape):
    """k and q listed as Python numbers with batch axes (one for every row, or one per row of
    one batch axis) give what the same targets as an array give, and the same errors."""
    x = np.random.default_rng(6).standard_normal(shape)
    arr = np.asarray(q)  # (the general path: an array of the same dtype)
    try:
        expected = softorder.vjp(softorder.soft_quantile, x, arr, 0.5)
    except ValueError as error:
        with pytest.raises(ValueError) as info:
            softorder.vjp(softorder.soft_quantile, x, q, 0.5)
        assert str(info.value) == str(error)
        return
    got = softorder.vjp(softorder.soft_quantile, x, q, 0.5)
    assert _bits(got[0]) == _bits(expected[0])
    v = np.ones(np.shape(got[0]))
    for a, b in zip(got[1](v), expected[1](v), strict=True):
        assert _bits(a) == _bits(b)
    with pytest.raises(ValueError, match="q must lie strictly between 0 and 1"):
        softorder.soft_quantile(x, [1.5] * len(q), 0.5)


def test_serial_kernel_takes_only_plain_kernels():
    """serial_kernel gives a kernel's serial dispatcher only where it takes the kernel's own
    arguments: not for a Python function that picks among kernels (whose ``serial`` is one
    of them), nor for a stand-in."""
    from softorder import core
    from softorder._engine.backends.numpy_host import serial_kernel

    assert serial_kernel(core.take_rows) is core.take_rows.serial
    assert serial_kernel(core.topk_vjp) is core.topk_vjp  # picks by the number of targets
    assert serial_kernel(core.topk_loss_forward) is core.topk_loss_forward

    def stand_in(*args):
        return None

    assert serial_kernel(stand_in) is stand_in


@pytest.mark.parametrize("op", ["soft_topk", "log_soft_topk", "soft_quantile"])
def test_targets_given_as_strided_arrays(op):
    """Targets given as a strided (Fortran-ordered, transposed) array reach the kernels as
    C-ordered rows: the values and gradients of the same targets given C-ordered.
    """
    x = np.random.default_rng(3).standard_normal((3, 10))
    given = np.array([[1.0, 2.0], [2.0, 3.0], [1.0, 3.0]])
    if op == "soft_quantile":
        given = given / 4.0
    fn = getattr(softorder, op)
    for strided in (np.asfortranarray(given), np.ascontiguousarray(given.T).T):
        assert not strided.flags.c_contiguous
        got, pullback = softorder.vjp(fn, x, strided, 0.5)
        want, want_pullback = softorder.vjp(fn, x, given, 0.5)
        np.testing.assert_array_equal(got, want)
        g = np.cos(np.arange(got.size)).reshape(got.shape)
        for a, b in zip(pullback(g), want_pullback(g), strict=True):
            np.testing.assert_array_equal(a, b)
