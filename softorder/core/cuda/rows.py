"""GPU twins of :mod:`softorder.core.rows`: moving between original and sorted order, NaN rows.

Elementwise kernels use one thread per element of the ``(rows, n)`` array; a row with NaN
(sorted last, so ``r[n - 1]`` tells) gets NaN outputs and leaves other rows untouched.
"""

from __future__ import annotations

import math

from numba import cuda

from softorder.core.cuda import _launch
from softorder.core.cuda._launch import F1, F2, I2
from softorder.core.laplace import INF


@cuda.jit(device=True, inline="always")
def element(shape):
    """``(row, i, inside)`` of this thread for a (rows, n) elementwise launch."""
    idx = cuda.grid(1)
    n = shape[1]
    row = idx // n
    return row, idx - row * n, idx < shape[0] * n


@cuda.jit(device=True, inline="always")
def nan_row(xs, row):
    """A row with NaN: sorted rows keep NaN last."""
    last = xs[row, xs.shape[1] - 1]
    return last != last


@_launch.kernel(F2, I2, F2)
def _take_rows(values, order, out):
    row, i, inside = element(out.shape)
    if inside:
        out[row, i] = values[row, order[row, i]]


@_launch.kernel(F2, I2, F2, F2, "boolean")
def _gather(xs, order, values, out, finite):
    row, i, inside = element(out.shape)
    if inside:
        v = values[row, order[row, i]]
        out[row, i] = 0.0 if finite and abs(xs[row, i]) == INF else v


@_launch.kernel(F2, I2, F2, F2, "boolean")
def _scatter(xs, order, values, out, finite):
    row, i, inside = element(values.shape)
    if inside:
        v = values[row, i]
        if nan_row(xs, row):
            v = math.nan
        elif finite and abs(xs[row, i]) == INF:
            v = 0.0
        out[row, order[row, i]] = v


@_launch.kernel(F2, F2)
def _nan_rows(xs, out):
    idx = cuda.grid(1)
    m = out.shape[1]
    row = idx // m
    if idx < out.shape[0] * m and nan_row(xs, row):
        out[row, idx - row * m] = math.nan


@_launch.kernel(F2, F1)
def _nan_entries(xs, out):
    row = cuda.grid(1)
    if row < out.shape[0] and nan_row(xs, row):
        out[row] = math.nan


def take_rows(values, order, out) -> None:
    """``out[row, i] = values[row, order[row, i]]``: each row in sorted order."""
    _launch.for_each(_take_rows, out.size, values, order, out)


def gather_finite(xs, order, values, out) -> None:
    """``values`` (original order) -> ``out`` (sorted order), 0 at infinite entries of ``xs``."""
    _launch.for_each(_gather, out.size, xs, order, values, out, True)


def scatter(xs, order, values, out, finite: bool = False) -> None:
    """``values`` (sorted order) -> ``out`` (original order); NaN rows of ``xs`` give NaN, and
    with ``finite`` infinite entries give 0.
    """
    _launch.for_each(_scatter, values.size, xs, order, values, out, finite)


def nan_rows(xs, *outputs) -> None:
    """Write NaN over every row of each output (rows, ...) whose row of ``xs`` has NaN."""
    rows = xs.shape[0]
    for out in outputs:
        if out.ndim == 1:
            _launch.for_each(_nan_entries, rows, xs, out)
        else:
            flat = out.reshape(rows, out.size // max(rows, 1))
            _launch.for_each(_nan_rows, flat.size, xs, flat)
