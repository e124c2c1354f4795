"""A VJP may write its gradient into softorder's own float64 copy of the cotangent (one array
of n less at the peak of a float32 call): the results must be those of a separate output, and
the caller's cotangent must never be written.
"""

import numpy as np
import pytest

import softorder

CASES = [
    (softorder.soft_rank, (), {}),
    (softorder.soft_rank, (), {"descending": True}),
    (softorder.soft_topk, (3,), {}),
    (softorder.soft_topk, (3,), {"largest": False}),
    (softorder.log_soft_topk, (2.5,), {}),
]
SEVERAL_K = (softorder.soft_topk, (np.array([[2.0, 5.0]]).repeat(4, 0),), {})  # no reuse


@pytest.mark.parametrize(
    ("fn", "args", "kwargs", "axis"),
    [(*case, axis) for case in CASES for axis in (-1, 0)] + [(*SEVERAL_K, -1)],
)
def test_gradient_same_with_own_copy_or_caller_array(fn, args, kwargs, axis):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 9)).astype(np.float32)
    x[1, 3] = x[1, 5]  # a tie
    x[2, 0] = np.inf
    if axis == 0:
        x = np.ascontiguousarray(x.T)
    out, pullback = softorder.vjp(fn, x, *args, alpha=0.3, axis=axis, **kwargs)
    u32 = rng.standard_normal(out.shape).astype(np.float32)
    u64 = u32.astype(np.float64)  # the same values, read in place (no copy of softorder's)
    u32_before, u64_before = u32.copy(), u64.copy()
    reused = pullback(u32)  # converted: softorder's own copy
    separate = pullback(u64)
    for a, b in zip(reused, separate, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(u32, u32_before)
    np.testing.assert_array_equal(u64, u64_before)
    again = pullback(u32)  # the pullback can be called again, with the same result
    for a, b in zip(reused, again, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gradient_not_written_into_a_float64_cotangent():
    x = np.random.default_rng(3).standard_normal(50)
    _, pullback = softorder.vjp(softorder.soft_topk, x, 5, alpha=0.2)
    u = np.linspace(-1.0, 1.0, 50)
    before = u.copy()
    x_bar = pullback(u)[0]
    np.testing.assert_array_equal(u, before)
    assert not np.shares_memory(x_bar, u)
