"""The top-k rule's short returns for one plain float64 row (issue 14) give what the general
conversions give: the same values to the bit, and the same types (``x_bar`` an array, ``k_bar``
a 0-d array, ``alpha_bar`` a NumPy scalar)."""

import numpy as np
import pytest

import softorder


@pytest.mark.parametrize("fn", [softorder.soft_topk, softorder.log_soft_topk])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("shape", [(9,), (1, 9), (1, 1, 9)])
def test_one_row_matches_the_general_path(rng, fn, largest, shape):
    x = rng.normal(size=shape)
    v = rng.normal(size=shape)
    out, pullback = softorder.vjp(fn, x, 3, 0.5, largest=largest)
    x_bar, k_bar, alpha_bar = pullback(v)
    # two rows, the first one x: the general conversions (sums over the batch of k and alpha)
    x2 = np.concatenate([x.reshape(1, 9), rng.normal(size=(1, 9))])
    out2, pullback2 = softorder.vjp(
        fn, x2, np.array([3.0, 3.0]), np.array([0.5, 0.5]), largest=largest
    )
    v2 = np.concatenate([v.reshape(1, 9), np.zeros((1, 9))])
    x_bar2, k_bar2, alpha_bar2 = pullback2(v2)
    assert type(out) is np.ndarray and out.shape == shape and out.dtype == np.float64
    np.testing.assert_array_equal(out.reshape(9), out2[0])
    assert type(x_bar) is np.ndarray and x_bar.shape == shape and x_bar.flags.c_contiguous
    np.testing.assert_array_equal(x_bar.reshape(9), x_bar2[0])
    assert type(k_bar) is np.ndarray and k_bar.shape == () and k_bar.dtype == np.float64
    assert k_bar == k_bar2[0]
    assert type(alpha_bar) is np.float64 and alpha_bar == alpha_bar2[0]


def test_float32_row_keeps_its_dtype(rng):
    x = rng.normal(size=9).astype(np.float32)
    out, pullback = softorder.vjp(softorder.soft_topk, x, 3, 0.5)
    x_bar, k_bar, alpha_bar = pullback(np.ones(9, np.float32))
    assert out.dtype == x_bar.dtype == k_bar.dtype == np.float32
    assert type(alpha_bar) is np.float32


def test_cotangents_the_short_path_does_not_take(rng):
    x = rng.normal(size=9)
    _, pullback = softorder.vjp(softorder.soft_topk, x, 3, 0.5)
    v = rng.normal(size=9)
    expected = pullback(v)
    strided = np.empty(18)
    strided[::2] = v
    for other in (strided[::2], list(v), v.reshape(9, 1)[:, 0]):
        for a, b in zip(pullback(other), expected, strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="cotangent"):
        pullback(np.ones(8))
    with pytest.raises(ValueError, match="cotangent"):
        pullback(np.ones((1, 9)))


def _bits(value) -> tuple:
    """A gradient's type, dtype, shape and bytes (signed zeros included)."""
    arr = np.asarray(value)
    return type(value), arr.dtype, arr.shape, arr.tobytes()


def _one_row_gradients(fn, shape, v, largest=True):
    """The gradients of one row of x (9 values) laid out as ``shape``: along its last axis,
    or, for (9, 1), along axis 0 (no plain row: the general conversions)."""
    x = np.linspace(0.1, 0.9, 9)
    axis = 0 if shape == (9, 1) else -1
    _, pullback = softorder.vjp(fn, x.reshape(shape), 3, 0.5, axis=axis, largest=largest)
    return pullback(v.reshape(shape))


@pytest.mark.parametrize("largest", [True, False])
def test_one_row_signed_zeros_follow_the_batch_axes(largest):
    """The k gradient of one row: as the kernel gives it without batch axes (-0.0 here: a
    subnormal cotangent times 1 / G rounds to it), summed over the batch axes with them (0.0 +
    -0.0 is 0.0), as the general path and Context.alpha_grad give it; soft_rank's alpha
    gradient follows the same rule."""
    v = np.zeros(9)
    v[4] = -5e-324
    one = _one_row_gradients(softorder.soft_topk, (9,), v, largest)
    assert one[1] == 0.0 and np.signbit(one[1])  # the case this test is about
    general = _one_row_gradients(softorder.soft_topk, (9, 1), v, largest)
    assert not np.signbit(general[1])
    for shape in [(1, 9), (1, 1, 9)]:
        batched = _one_row_gradients(softorder.soft_topk, shape, v, largest)
        np.testing.assert_array_equal(batched[0].reshape(9), one[0].reshape(9))
        for a, b in zip(batched[1:], general[1:], strict=True):
            assert _bits(a) == _bits(b), shape
    _, pullback = softorder.vjp(softorder.soft_rank, np.linspace(0.1, 0.9, 9), 0.5)
    assert np.signbit(pullback(v)[1])
    _, pullback = softorder.vjp(softorder.soft_rank, np.linspace(0.1, 0.9, 9)[None], 0.5)
    assert not np.signbit(pullback(v[None])[1])


@pytest.mark.parametrize("fn", [softorder.soft_topk, softorder.log_soft_topk])
def test_one_row_conversions_of_negative_zero_gradients(fn, monkeypatch):
    """Per-row k and alpha gradients of -0.0 (written over the kernel's): one row without
    batch axes returns them as they are, with batch axes as the general path sums them
    (+0.0); the input gradient is untouched."""
    from softorder import core

    kernel = core.topk_vjp

    def negative_zeros(*args):
        kernel(*args)
        w_bar, alpha_bar = args[8], args[9]
        w_bar[...] = -0.0
        alpha_bar[...] = -0.0

    monkeypatch.setattr(core, "topk_vjp", negative_zeros)
    v = np.random.default_rng(3).standard_normal(9)
    one = _one_row_gradients(fn, (9,), v)
    assert _bits(one[1]) == _bits(np.array(-0.0)) and _bits(one[2]) == _bits(np.float64(-0.0))
    general = _one_row_gradients(fn, (9, 1), v)
    assert _bits(general[1]) == _bits(np.array(0.0))
    assert _bits(general[2]) == _bits(np.float64(0.0))
    for shape in [(1, 9), (1, 1, 9)]:
        batched = _one_row_gradients(fn, shape, v)
        assert batched[0].shape == shape
        np.testing.assert_array_equal(batched[0].reshape(9), one[0])
        for a, b in zip(batched[1:], general[1:], strict=True):
            assert _bits(a) == _bits(b), shape


@pytest.mark.parametrize("shape", [(9,), (1, 9)])
def test_one_row_unwanted_alpha_gradient_is_none(shape):
    """A context whose alpha gradient nobody wants (the torch bridge's plain backward) gets
    None for it from the one-row return too, and the same x and k gradients."""
    from softorder._engine.autodiff import bind

    fn = softorder.soft_topk
    x = np.random.default_rng(4).standard_normal(shape)
    v = np.random.default_rng(5).standard_normal(shape)
    arguments = bind(fn.signature, (x, 3, 0.5), {})
    wanted, unwanted = fn.rule.prepare(**arguments), fn.rule.prepare(**arguments)
    fn.rule.forward(wanted)
    fn.rule.forward(unwanted)
    unwanted.alpha_wanted = False
    full, partial = fn.rule.vjp(wanted, v), fn.rule.vjp(unwanted, v)
    assert partial[2] is None and full[2] is not None
    for a, b in zip(full[:2], partial[:2], strict=True):
        assert _bits(a) == _bits(b)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("axis", [-1, 0])
def test_narrow_memberships_and_k_gradient_are_the_casts_without_warnings(rng, dtype, axis):
    """A float32 (or float16) input's memberships are cast before they are laid out (they
    cannot overflow), and one row's k gradient is cast as a value: the bits of the float64
    computation's cast, with no warning, also for a NaN row."""
    import warnings

    x = rng.normal(size=(6, 4)).astype(dtype)
    x[2, 1] = np.nan  # a NaN row (axis -1) or column (axis 0)
    for x_in, v in ((x, rng.normal(size=(6, 4))), (x[0], rng.normal(size=4))):
        ax = axis if x_in.ndim == 2 else -1
        v = v.astype(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, pullback = softorder.vjp(softorder.soft_topk, x_in, 2, 0.5, axis=ax)
            _, k_bar, _ = pullback(v)
        wide = x_in.astype(np.float64)
        out64, pullback64 = softorder.vjp(softorder.soft_topk, wide, 2, 0.5, axis=ax)
        assert out.dtype == dtype and out.flags.c_contiguous
        assert out.tobytes() == out64.astype(dtype).tobytes()
        if x_in.ndim == 1 and dtype == np.float32:  # one row: the k gradient's own path
            assert type(k_bar) is np.ndarray and k_bar.shape == () and k_bar.dtype == dtype
            want = np.asarray(pullback64(v.astype(np.float64))[1]).astype(dtype)
            assert k_bar.tobytes() == want.tobytes()


@pytest.mark.parametrize("fn", [softorder.soft_topk, softorder.log_soft_topk])
@pytest.mark.parametrize("largest", [True, False])
def test_several_rows_match_the_general_path(rng, fn, largest):
    """Several plain float64 rows with one k and one alpha: k's and alpha's gradients are the
    sums of the per-row ones (summed as sum_over_rows sums them), x's the same bits."""
    x = rng.normal(size=(2, 5, 9))
    x[1, 2, 4] = np.nan  # a NaN row
    v = rng.normal(size=x.shape)
    out, pullback = softorder.vjp(fn, x, 3, 0.5, largest=largest)
    x_bar, k_bar, alpha_bar = pullback(v)
    ones = np.ones(x.shape[:-1])
    out2, pullback2 = softorder.vjp(fn, x, 3.0 * ones, 0.5 * ones, largest=largest)
    x_bar2, k_bar2, alpha_bar2 = pullback2(v)
    assert out.tobytes() == out2.tobytes() and x_bar.tobytes() == x_bar2.tobytes()
    assert type(k_bar) is np.ndarray and k_bar.shape == () and k_bar.dtype == np.float64
    assert type(alpha_bar) is np.float64
    with np.errstate(invalid="ignore"):
        want_k, want_alpha = k_bar2.reshape(-1, 1).sum(), alpha_bar2.reshape(-1).sum()
    assert k_bar.tobytes() == np.array(want_k).tobytes()
    assert np.array(alpha_bar).tobytes() == np.array(want_alpha).tobytes()
