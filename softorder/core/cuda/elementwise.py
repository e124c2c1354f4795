"""Elementwise kernels on flat device arrays, one thread per element: the layout work of the
numba device backend (:mod:`softorder._engine.backends.numba_cuda`). Launch them with
:func:`softorder.core.cuda._launch.for_each`.
"""

from __future__ import annotations

from numba import cuda

from softorder.core.cuda import _launch
from softorder.core.cuda._launch import F1


@_launch.kernel(F1, "int64", "UniTuple(int64, 2)", "UniTuple(int64, 2)", F1, "boolean")
def gather(memory, offset, shape, strides, out, negate):
    """``out[j]`` = element ``j`` (C order) of the walk ``(shape, strides)`` over ``memory``
    from ``offset``, converted to ``out``'s dtype and negated on request. numba compiles it
    for each dtype pair and each number of axes.
    """
    j = cuda.grid(1)
    if j < out.shape[0]:
        k = offset
        rest = j
        for d in range(len(shape) - 1, -1, -1):
            k += (rest % shape[d]) * strides[d]
            rest //= shape[d]
        out[j] = memory[k]
        if negate:
            out[j] = -out[j]


@_launch.kernel(F1, "float64", F1)
def scale(a, factor, out):
    """``out = a * factor``."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] * factor


@_launch.kernel(F1, F1, F1)
def multiply(a, b, out):
    """``out = a * b``."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] * b[i]


@_launch.kernel(F1, F1, F1)
def add_product(out, a, b):
    """``out += a * b``."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] += a[i] * b[i]
