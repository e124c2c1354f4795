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
