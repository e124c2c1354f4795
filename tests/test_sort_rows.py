"""softorder.core.sort_rows (the JAX FFI handlers' per-row argsort) against NumPy's stable
argsort: the same order and the same sorted values, bit for bit, for every kind of row.
"""

import numba
import numpy as np
import pytest

from softorder.core.sort_rows import MERGE_MAX, RUN, gather_rows, sort_rows

pytestmark = pytest.mark.skipif(
    numba.config.DISABLE_JIT, reason="NUMBA_DISABLE_JIT: the helpers need compiled callers"
)

SPECIALS = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1.0, -1.0, 5e-324, -5e-324]
#: row lengths of the merge sort (one run of insertion, runs and a short last run, around its
#: limit) and of the radix sort (beyond it)
LENGTHS = (1, 2, 3, RUN - 1, RUN, RUN + 1, 2 * RUN + 5, 100)
LENGTHS += (MERGE_MAX - 1, MERGE_MAX, MERGE_MAX + 1, 300, 4099)


@numba.njit
def argsort(values, xs, order):  # an intrinsic: compiled code calls it
    sort_rows(values, xs, order)


@numba.njit
def take(out, values, order):
    gather_rows(out, values, order)


def equal(a, b):
    np.testing.assert_array_equal(a, b, strict=True)


def same_bits(a, b):
    """Equal bit for bit: -0.0 is not 0.0, NaN payloads count."""
    assert a.dtype == b.dtype
    equal(*(np.ascontiguousarray(x).view(f"u{x.itemsize}") for x in (a, b)))


def check(values, index=np.int32):
    """``sort_rows`` on ``values`` (not written) gives NumPy's stable argsort and sorted rows;
    ``gather_rows`` with that argsort gives the same sorted rows.
    """
    before = values.copy()
    xs, order = np.empty(values.shape, values.dtype), np.empty(values.shape, index)
    argsort(values, xs, order)
    expected = np.argsort(values, axis=1, kind="stable")
    equal(order, expected.astype(index))
    sorted_rows = np.take_along_axis(values, expected, 1)
    same_bits(xs, sorted_rows)
    same_bits(values, before)
    if values.flags.c_contiguous:
        out = np.empty_like(xs)
        take(out, values, order)
        same_bits(out, xs)


def rows_of(rng, n, dtype):
    """Rows of length n: random, with many ties, of special values, constant, sorted and
    reversed, in ``dtype``.
    """
    normal = rng.standard_normal((3, n))
    yield normal.astype(dtype)
    yield np.round(normal, 1).astype(dtype)  # ties
    yield rng.choice(SPECIALS, size=(3, n)).astype(dtype)
    span = 300 if dtype == np.float64 else 30  # magnitudes across the exponent range
    yield (rng.standard_normal((2, n)) * 10.0 ** rng.integers(-span, span, (2, n))).astype(dtype)
    yield np.full((2, n), 7.0, dtype)
    yield np.sort(normal, axis=1).astype(dtype)
    yield np.sort(normal, axis=1)[:, ::-1].astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n", LENGTHS)
def test_sort_rows_is_numpys_stable_argsort(rng, n, dtype):
    for values in rows_of(rng, n, dtype):
        check(values)


def test_every_merge_sort_length(rng):
    """Every row length up to past the merge sort's limit: whole and partial runs, merges of
    unequal runs, with ties, signed zeros, NaN and infinities in every run.
    """
    for n in range(1, MERGE_MAX + 3):
        check(rng.choice(SPECIALS + [2.0, 2.0, -3.0], size=(2, n)))
        check(np.round(rng.standard_normal((2, n)), 1).astype(np.float32))


def test_float32_widened_rows_sort_as_float32(rng):
    """The handlers sort float32 input widened to float64 (exact): the low bytes of every key
    are then equal, and the passes over them are skipped.
    """
    for n in (MERGE_MAX, MERGE_MAX + 1, 1000):
        single = np.round(rng.standard_normal((4, n)), 2).astype(np.float32)
        xs, order = np.empty((4, n)), np.empty((4, n), np.int32)
        argsort(single.astype(np.float64), xs, order)
        expected = np.argsort(single, axis=1, kind="stable")
        equal(order, expected.astype(np.int32))
        equal(xs, np.take_along_axis(single, expected, 1).astype(np.float64))


def test_nan_payloads_and_signs_are_one_value(rng):
    """Every NaN (either sign, any payload) sorts last, in its original order."""
    bits = [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0xFFFFFFFFFFFFFFFF]
    nans = np.array(bits, np.uint64).view(np.float64)
    for n in (8, 100, 300):
        values = rng.standard_normal((2, n))
        values[:, ::3] = rng.choice(nans, size=values[:, ::3].shape)
        check(values)


def test_zero_rows_and_zero_length(rng):
    check(np.empty((0, 5)))
    check(np.empty((3, 0)))


def test_int64_orders_float32_results_and_strided_arrays_refused(rng):
    values = rng.standard_normal((6, 200))
    check(values, index=np.int64)
    check(values[::2].copy())
    xs, order = np.empty(values.shape, np.float32), np.empty(values.shape, np.int32)
    argsort(values, xs, order)  # sorted rows rounded to float32
    expected = np.argsort(values, axis=1, kind="stable")
    equal(order, expected.astype(np.int32))
    equal(xs, np.take_along_axis(values, expected, 1).astype(np.float32))
    for strided in (values[::2, ::3], np.asfortranarray(values)):
        with pytest.raises(numba.core.errors.TypingError):
            argsort(strided, np.empty(strided.shape), np.empty(strided.shape, np.int32))


def test_gather_rows_takes_an_int64_argsort_and_refuses_strided_arrays(rng):
    values = rng.standard_normal((3, 50))
    order = np.argsort(values, axis=1)
    out = np.empty_like(values)
    take(out, values, order)
    equal(out, np.take_along_axis(values, order, 1))
    with pytest.raises(numba.core.errors.TypingError):
        take(out, values[:, ::2], order[:, :25])


def alike_in_low_bits(rng, shape, spread):
    """float64 values whose bits differ only in the lowest ``spread`` (of both signs, with
    zeros): the packed keys replace those bits with the index, and the fix-up after the sort
    orders them.
    """
    base = rng.choice([1.0, -1.0, 3.5, -2.25e-300, 0.0], size=shape)
    bits = base.view(np.uint64) + rng.integers(0, 2**spread, shape).astype(np.uint64)
    return np.where(base == 0, base, bits.view(np.float64))


@pytest.mark.parametrize("n", (MERGE_MAX + 1, 255, 256, 257, 1024, 1025, 5000))
def test_packed_keys_fix_values_alike_in_the_index_bits(rng, n):
    """Rows past :data:`MERGE_MAX` sort by keys with their low bits replaced by the index:
    values alike in all but those bits (a few per row, both signs) are put in order after the
    sort, with int32 or int64 orders and float64 or float32 sorted rows.
    """
    for _ in range(3):
        values = rng.standard_normal((3, n))
        spots = rng.integers(0, n, (3, n // 20 + 2))
        values[:, : spots.shape[1]] = alike_in_low_bits(rng, (3, spots.shape[1]), 12)
        values[np.arange(3)[:, None], spots] = alike_in_low_bits(rng, spots.shape, 8)
        for index in (np.int32, np.int64):
            check(values, index)
        xs, order = np.empty(values.shape, np.float32), np.empty(values.shape, np.int32)
        argsort(values, xs, order)
        expected = np.argsort(values, axis=1, kind="stable")
        equal(order, expected.astype(np.int32))
        equal(xs, np.take_along_axis(values, expected, 1).astype(np.float32))


@pytest.mark.parametrize("n", (MERGE_MAX + 1, 1000, 4099))
def test_rows_alike_in_the_index_bits_sort_in_two(rng, n):
    """A row whose fix-up would move more than n values (all alike but in their low bits,
    shuffled, or sorted backwards) is sorted again in two (by its keys' low bits, then their
    high bits), beside rows that are not, in either order.
    """
    alike = alike_in_low_bits(rng, (2, n), 16)
    backwards = -np.sort(alike_in_low_bits(rng, (1, n), 6), axis=1)
    normal = rng.standard_normal((2, n))
    for values in (alike, backwards, np.vstack([normal[:1], alike, normal[1:]])):
        for index in (np.int32, np.int64):
            check(values, index)
        check(values.astype(np.float32))


def test_packed_keys_of_float32_and_constant_rows(rng):
    """Keys of float32 values (widened or not) have 29 low zero bits, and constant rows
    none that vary: their passes start at the lowest bit that varies, or there are none.
    """
    for n in (MERGE_MAX + 1, 300, 70000):
        single = rng.standard_normal((2, n)).astype(np.float32)
        check(single)
        check(single.astype(np.float64))
        check(np.full((2, n), -0.0))
        check(np.where(rng.random((2, n)) < 0.5, 0.0, -0.0))
        check(rng.choice(SPECIALS, size=(2, n)).astype(np.float32))
