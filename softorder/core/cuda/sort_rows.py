"""A per-row argsort on the device, in NumPy's order (ascending, NaN last), for device arrays
that come without a framework's sort (:mod:`softorder._engine.backends.numba_cuda`).

A bottom-up merge sort: pass ``p`` merges neighbouring sorted runs of width ``w = 2**p`` of
each row, with one kernel launch per pass (``ceil(log2 n)`` passes) and one thread per
element. A thread finds where its element lands in the merged run by a binary search in the
partner run (merge path): its position in its own run plus how many partner elements sort
before it. Elements are compared as ``(value, original index)``, a strict total order, so equal
values keep their original order (the sort is stable, as ``np.argsort(kind="stable")``) and
every destination is distinct. Passes ping-pong between two buffers of (value, index).

Work is O(n log^2 n) per row (a binary search per element per pass), against O(n log n) for
a radix or merge sort with cooperative tiles: ``torch.sort``, which the PyTorch bridge uses,
is faster. This sort is for inputs that only offer ``__cuda_array_interface__``.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from softorder.core.cuda import _launch
from softorder.core.cuda._launch import F2, I2
from softorder.core.cuda.rows import element


@cuda.jit(device=True, inline="always")
def before(a, ia, b, ib):
    """``(a, ia)`` sorts before ``(b, ib)``: ascending values, NaN last, ties by index."""
    a_nan = a != a
    b_nan = b != b
    if a_nan or b_nan:
        return ia < ib if a_nan and b_nan else b_nan
    if a != b:
        return a < b
    return ia < ib


@_launch.kernel(I2)
def _iota(index):
    row, i, inside = element(index.shape)
    if inside:
        index[row, i] = i


@_launch.kernel(F2, I2, F2, I2, "int64")
def _merge_pass(keys, index, out_keys, out_index, width):
    """Merge the runs of ``width`` sorted elements pairwise: ``(keys, index)`` -> ``out_*``."""
    row, i, inside = element(keys.shape)
    if inside:
        n = keys.shape[1]
        start = i - i % width
        if (i // width) % 2 == 0:  # a left run: the partner follows (maybe past the end)
            lo = start + width
            hi = min(lo + width, n)
            merged = start
        else:
            lo = start - width
            hi = start
            merged = lo
        first = lo
        v = keys[row, i]
        iv = index[row, i]
        while lo < hi:  # how many partner elements sort before (v, iv)
            mid = (lo + hi) // 2
            if before(keys[row, mid], index[row, mid], v, iv):
                lo = mid + 1
            else:
                hi = mid
        dest = merged + (i - start) + lo - first
        out_keys[row, dest] = v
        out_index[row, dest] = iv


def sort_rows(values, xs, order) -> None:
    """``order[r]`` = the stable argsort of ``values[r]`` (ascending, NaN last) and ``xs[r]``
    = ``values[r]`` in that order, for a (rows, n) float64 ``values`` (not written).
    """
    rows, n = values.shape
    if rows == 0 or n == 0:
        return
    passes = max(1, (n - 1).bit_length())  # ceil(log2 n); one pass copies when n = 1
    spare = (_launch.empty(values.shape), _launch.empty(values.shape, np.int64))
    # the last pass writes (xs, order), the one before it the spare pair, and so on
    targets = [(xs, order) if (passes - p) % 2 == 0 else spare for p in range(1, passes + 1)]
    source = (values, spare[1] if targets[0] is not spare else order)
    _launch.for_each(_iota, rows * n, source[1])
    width = 1
    for target in targets:
        _launch.for_each(_merge_pass, rows * n, *source, *target, width)
        source = target
        width *= 2
