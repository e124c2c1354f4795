"""The host's sort (``NumpyBackend.sort_rows``: packed keys, ``softorder.core.rows``) against
NumPy's stable argsort: the same order and the same sorted values, bit for bit, for every kind
of row, on both of its paths (short inputs, and long ones until the packed sort is compiled,
take NumPy's argsort and ``take_rows``) and in the fallback for rows whose values differ only
in their lowest bits.
"""

import zlib

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from softorder import core
from softorder._engine.backends.numpy_host import NUMPY, PACKED, PACKED_SORT_SIZE

pytestmark = pytest.mark.skipif(
    numba.config.DISABLE_JIT, reason="NUMBA_DISABLE_JIT: Python kernels, too slow here"
)

EPS = np.finfo(np.float64).eps
NAN_PAYLOADS = np.array([0x7FF0000000000001, 0xFFF8000000000123], np.uint64).view(np.float64)
SPECIALS = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1.0, -1.0, 5e-324, -5e-324, 1e308]
SPECIALS += list(NAN_PAYLOADS)


def check(values):
    """``sort_rows`` gives ``np.argsort(kind="stable")`` as int32 and the rows in its order,
    and leaves ``values`` as they were, by packed keys and by NumPy's argsort alike.
    """
    values = np.ascontiguousarray(values, dtype=np.float64)
    before = values.copy()
    expected = np.argsort(values, axis=1, kind="stable")
    sorted_rows = np.take_along_axis(values, expected, 1)
    for mode in ("packed", "argsort"):
        previous = PACKED.set_mode(mode)
        try:
            xs, order = NUMPY.sort_rows(values)
        finally:
            PACKED.set_mode(previous)
        np.testing.assert_array_equal(order, expected.astype(np.int32), strict=True)
        np.testing.assert_array_equal(xs.view(np.uint64), sorted_rows.view(np.uint64))
        np.testing.assert_array_equal(values.view(np.uint64), before.view(np.uint64))


def neighbours(rng, shape):
    """Pairs of neighbouring floats, in random places: each pair alike in all but its lowest
    bit, so the sort leaves the pair in its indices' order and insertion swaps half of them.
    """
    half = rng.standard_normal((shape[0], (shape[1] + 1) // 2))
    pairs = np.concatenate([half, np.nextafter(half, np.inf)], axis=1)[:, : shape[1]]
    return rng.permuted(pairs, axis=1)


KINDS = {
    "normal": lambda rng, shape: rng.standard_normal(shape),
    "float32": lambda rng, shape: rng.standard_normal(shape).astype(np.float32),
    # float32 values with their own specials: rows of exact keys but for -0.0 and NaN
    "float32 specials": lambda rng, shape: rng.choice(
        np.array(SPECIALS[:8] + [3.4e38, -1.5e-45, 0.1], np.float32), size=shape
    ),
    "ties": lambda rng, shape: np.round(rng.standard_normal(shape), 1),
    "specials": lambda rng, shape: rng.choice(SPECIALS, size=shape),
    "negative": lambda rng, shape: -np.abs(rng.standard_normal(shape)) * 1e-300,
    # two values per high key: put in order by insertion after the sort
    "neighbours": neighbours,
    # every value alike in its high bits: more moves than the row's length, so NumPy sorts it
    "near one, many": lambda rng, shape: (
        1.0 + rng.permuted(np.broadcast_to(np.arange(shape[1]) * EPS, shape), axis=1)
    ),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape",
    [(1, 0), (3, 1), (2, 2), (1, PACKED_SORT_SIZE - 1), (1, PACKED_SORT_SIZE)]
    + [(4, 100), (1, 1000), (3, 4099), (1, 70000)],
)
def test_same_as_stable_argsort(kind, shape):
    rng = np.random.default_rng(zlib.crc32(repr((kind, shape)).encode()))
    check(KINDS[kind](rng, shape))


def test_read_only_rows():
    """A read-only input (sorted through a copy: numba would compile the kernels again)."""
    values = np.random.default_rng(3).standard_normal((2, 500))
    values.flags.writeable = False
    check(values)


def test_rows_of_each_path_in_one_batch():
    """Rows put in order by insertion, rows sorted again by NumPy, and plain rows, together,
    serially and on the thread pool (the count of unfinished rows is a reduction there).
    """
    rng = np.random.default_rng(5)
    n = 40000
    rows = [rng.standard_normal(n), 1.0 + rng.permutation(n) * EPS, neighbours(rng, (1, n))[0]]
    values = np.stack(rows + rows[::-1])
    previous = core.set_parallel(False)
    try:
        check(values)
        core.set_parallel(True)
        check(values)
    finally:
        core.set_parallel(previous)


def unpack(values):
    """The kernels' sort of ``values`` (one row): the unpacked order and its ``redo`` flag, and
    whether the keys' sort alone left the values out of order.
    """
    n = values.shape[1]
    bits = values.view(np.int64)
    low = (1 << (n - 1).bit_length()) - 1
    keys, exact = np.empty_like(bits), np.empty(1, np.uint8)
    core.pack_sort_keys(bits, low, keys, exact)
    assert exact[0] == 0  # (float64 values alike in their high bits)
    keys.sort(axis=1)
    unordered = bool(np.any(np.diff(values[0, keys[0] & low]) < 0))
    order, redo = np.empty((1, n), np.int32), np.empty(1, np.uint8)
    unfinished = core.unpack_sorted(bits, low, keys, order, redo, exact)
    assert unfinished == redo[0]
    return order, redo[0], unordered


@pytest.mark.parametrize(
    ("values", "exact"),
    [
        (np.float32([3.0, -1.5, np.inf, -np.inf, 0.0, 1e-45, -3.4e38]), True),
        (np.float32([3.0, -1.5, -0.0]), False),  # -0.0 has 0.0's key
        (np.float32([3.0, np.nan]), False),  # every NaN has one key
        (np.array([1.0, 1.0 + EPS]), False),  # a bit among the index's
    ],
)
def test_exact_rows_take_their_values_from_the_keys(values, exact):
    """A row whose keys hold its values whole (a widened float32's low bits are zeros) is
    flagged by the packing, and its values come out of the keys, bit for bit.
    """
    values = np.ascontiguousarray(np.concatenate([values] * 200, dtype=np.float64)[None])
    n = values.shape[1]
    bits, low = values.view(np.int64), (1 << (n - 1).bit_length()) - 1
    keys, flag = np.empty_like(bits), np.empty(1, np.uint8)
    core.pack_sort_keys(bits, low, keys, flag)
    assert flag[0] == exact
    check(values)


def test_insertion_orders_values_alike_in_their_low_bits():
    values = neighbours(np.random.default_rng(2), (1, 1000))
    order, redo, unordered = unpack(values)
    assert unordered and redo == 0
    np.testing.assert_array_equal(order[0], np.argsort(values[0], kind="stable"))


def test_short_rows_are_put_in_order_whatever_their_values():
    """Reversing a row of 12 values alike in their high bits takes 66 moves: within the
    slack, so no short row is sorted a second time.
    """
    values = (1.0 + np.arange(12)[::-1] * EPS)[None]
    order, redo, unordered = unpack(values)
    assert unordered and redo == 0
    np.testing.assert_array_equal(order[0], np.arange(12)[::-1])


def test_fallback_is_taken_for_many_values_alike_in_their_low_bits():
    values = (1.0 + np.arange(1000)[::-1] * EPS)[None]
    assert unpack(values)[1] == 1
    check(values)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float64,
        st.tuples(st.integers(1, 3), st.integers(PACKED_SORT_SIZE // 2, 600)),
        elements=st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
            st.sampled_from(SPECIALS),
        ),
    )
)
def test_property_same_as_stable_argsort(values):
    check(values)
