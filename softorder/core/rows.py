"""Moving between a row's original order and its sorted order, inside the kernels.

Every kernel works on rows sorted by NumPy's argsort outside numba (``order``); these helpers
gather values into sorted order and scatter results back, and find NaN rows.
"""

from __future__ import annotations

from numba import prange

from softorder.core._jit import helper, kernel
from softorder.core.laplace import INF


@kernel
def take_rows(values, order, out):
    """``out[row, i] = values[row, order[row, i]]``: each row in sorted order."""
    rows, n = values.shape
    for row in prange(rows):
        for i in range(n):
            out[row, i] = values[row, order[row, i]]


@helper
def gather_finite(r, order, values, out):
    """``out[i] = values[order[i]]`` (original order -> sorted order), 0 at infinite entries:
    tangents and cotangents of +-inf entries neither enter nor leave a computation.
    """
    for i in range(r.shape[0]):
        out[i] = values[order[i]] if abs(r[i]) != INF else 0.0


@helper
def gather(order, values, out):
    """``out[i] = values[order[i]]`` (original order -> sorted order)."""
    for i in range(order.shape[0]):
        out[i] = values[order[i]]


@helper
def scatter(order, values, out):
    """``out[order[i]] = values[i]`` (sorted order -> original order)."""
    for i in range(order.shape[0]):
        out[order[i]] = values[i]


@helper
def scatter_finite(r, order, values, out):
    """``out[order[i]] = values[i]`` (sorted order -> original order), 0 at infinite entries."""
    for i in range(r.shape[0]):
        out[order[i]] = values[i] if abs(r[i]) != INF else 0.0


@helper
def has_nan(r):
    """Sorted rows keep NaN last (NumPy's sort order), so one comparison finds it."""
    return r[r.shape[0] - 1] != r[r.shape[0] - 1]
