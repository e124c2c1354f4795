"""A per-row argsort inside compiled code, in NumPy's order, for callers that cannot sort
outside numba: the JAX bridge's XLA FFI handlers (:mod:`softorder.bridges._jax_ffi`), which run
as C functions with no Python to call ``np.argsort`` from.

The NumPy API sorts outside the kernels (NumPy's SIMD sort is faster than a comparison sort in
``njit``). A handler has to sort its rows itself, and an XLA sort in the traced graph cost more
than :func:`sort_rows` does (figures in CHANGELOG.md). :func:`sort_rows` is an LSD radix sort
on the float's bits; :func:`gather_rows` puts rows back in the sorted order of a saved argsort
(a backward pass), without sorting again. :mod:`softorder.core.cuda.sort_rows` is the device's
counterpart, with the same arguments.

Both give the order of ``np.argsort(values, axis=1, kind="stable")``: ascending, NaN last (all
NaN equal, whatever their sign or payload), ``-0.0 == 0.0``, ties in their original order.
"""

from __future__ import annotations

import numpy as np

from softorder.core import fast_exp
from softorder.core._jit import helper
from softorder.core.fast_exp import float_bits
from softorder.core.lapsum import empty

#: Rows of at most this many elements take an insertion sort: fewer instructions than the
#: radix sort's eight counting passes.
INSERTION_MAX = 32


@helper
def sort_rows(values, xs, order):
    """Sort each row of ``values`` into ``xs``, stably, NaN last and ``-0.0 == 0.0``, and write
    its argsort into ``order``: NumPy's ``np.argsort(values, axis=1, kind="stable")``.

    An LSD radix sort on the bytes of integer keys: a float's bits as a signed integer (after
    ``-0.0 -> 0.0``), with the magnitude bits of negative values flipped and every NaN above
    ``+inf``. The eight byte counts are taken in one pass; a byte pass where every key has the
    same byte is skipped (the low bytes of float32 data widened to float64). Rows of at most
    :data:`INSERTION_MAX` elements take an insertion sort on the same keys. Scratch: four
    int64 rows of n, allocated once per call.

    A compiled helper: kernels and C functions call it (the JAX handlers by symbol), Python
    cannot (no wrapper is compiled for it, which would lengthen a first call).

    Parameters
    ----------
    values : float64 or float32 array of shape (rows, n)
        The rows to sort; not written.
    xs : float array of shape (rows, n)
        Receives each row of ``values`` in ascending order.
    order : int32 or int64 array of shape (rows, n)
        Receives each row's argsort: ``xs[r, i] == values[r, order[r, i]]``.

    Examples
    --------
    >>> import numba, numpy as np
    >>> from softorder.core.sort_rows import sort_rows
    >>> @numba.njit
    ... def argsort(values, xs, order):
    ...     sort_rows(values, xs, order)
    >>> values = np.array([[2.0, np.nan, -0.0, 1.0, 0.0, -np.inf]])
    >>> xs, order = np.empty_like(values), np.empty(values.shape, np.int32)
    >>> argsort(values, xs, order)
    >>> order
    array([[5, 2, 4, 3, 0, 1]], dtype=int32)
    >>> xs
    array([[-inf,  -0.,   0.,   1.,   2.,  nan]])
    >>> bool((order == np.argsort(values, axis=1, kind="stable")).all())
    True
    """
    rows, n = values.shape
    scratch = empty((4, n), np.int64)  # one allocation
    o, keys, keys2, order2 = scratch[0], scratch[1], scratch[2], scratch[3]
    counts = empty((8, 256), np.int64)
    for r in range(rows):
        row = values[r]
        for i in range(n):
            v = row[i]
            k = float_bits(0.0 if v == 0.0 else v)  # as int64
            if v != v:
                k = 0x7FFFFFFFFFFFFFFF  # above +inf (0x7FF0000000000000)
            elif k < 0:
                k ^= 0x7FFFFFFFFFFFFFFF
            keys[i] = k
            o[i] = i
        src_o = o  # the argsort, once sorted
        if n <= INSERTION_MAX:
            for i in range(1, n):
                k, oi = keys[i], o[i]
                j = i - 1
                while j >= 0 and keys[j] > k:
                    keys[j + 1] = keys[j]
                    o[j + 1] = o[j]
                    j -= 1
                keys[j + 1] = k
                o[j + 1] = oi
        else:
            for b in range(8):
                for d in range(256):
                    counts[b, d] = 0
            for i in range(n):
                k = keys[i]
                for b in range(7):
                    counts[b, (k >> (8 * b)) & 0xFF] += 1
                counts[7, ((k >> 56) & 0xFF) ^ 0x80] += 1
            src_k, dst_k, dst_o = keys, keys2, order2
            for b in range(8):
                shift = 8 * b
                flip = 0x80 if b == 7 else 0
                if counts[b, ((src_k[0] >> shift) & 0xFF) ^ flip] == n:
                    continue  # one value of this byte: the pass would move nothing
                total = 0
                for d in range(256):
                    c = counts[b, d]
                    counts[b, d] = total
                    total += c
                for i in range(n):
                    k = src_k[i]
                    d = ((k >> shift) & 0xFF) ^ flip
                    j = counts[b, d]
                    counts[b, d] = j + 1
                    dst_k[j] = k
                    dst_o[j] = src_o[i]
                src_k, src_o, dst_k, dst_o = dst_k, dst_o, src_k, src_o
        for i in range(n):
            j = src_o[i]
            order[r, i] = j
            xs[r, i] = row[j]


if fast_exp._jit_enabled():
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def gather_rows(typingctx, out, values, order):
        """Each row of ``values`` in the order of its argsort ``order``, into ``out``:
        ``out[r, i] = values[r, order[r, i]]`` (C-contiguous ``(rows, n)`` arrays; ``order``
        int32 or int64, as :func:`sort_rows` wrote it).

        Emitted in place (an intrinsic): compiled code that calls it compiles no function of
        its own for it. :func:`softorder.core.rows.take_rows` is the kernel that Python calls.

        Examples
        --------
        >>> import numba, numpy as np
        >>> from softorder.core.sort_rows import gather_rows
        >>> @numba.njit
        ... def take(out, values, order):
        ...     gather_rows(out, values, order)
        >>> values, out = np.array([[3.0, 1.0, 2.0]]), np.empty((1, 3))
        >>> take(out, values, np.array([[1, 2, 0]], np.int32))
        >>> out
        array([[1., 2., 3.]])
        """
        arrays = (out, values, order)
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
            return None  # numba then reports that no signature matches

        def codegen(context, builder, signature, args):
            target, source, indices = (
                context.make_array(t)(context, builder, a)
                for t, a in zip(signature.args, args, strict=True)
            )
            rows, n = cgutils.unpack_tuple(builder, source.shape)
            with cgutils.for_range(builder, rows) as row:
                start = builder.mul(row.index, n)
                with cgutils.for_range(builder, n) as column:
                    at = builder.add(start, column.index)
                    index = builder.load(builder.gep(indices.data, [at]))
                    index = context.cast(builder, index, signature.args[2].dtype, types.intp)
                    value = builder.load(builder.gep(source.data, [builder.add(start, index)]))
                    builder.store(value, builder.gep(target.data, [at]))
            return context.get_dummy_value()

        return types.none(out, values, order), codegen

else:  # pragma: no cover - NUMBA_DISABLE_JIT: a Python function

    def gather_rows(out, values, order):
        """``out[r, i] = values[r, order[r, i]]`` (NUMBA_DISABLE_JIT)."""
        out[...] = np.take_along_axis(values, order, 1)
