"""Moving between a row's original order and its sorted order, inside the kernels.

Every kernel works on rows sorted outside numba by NumPy (``order``); these helpers gather
values into sorted order and scatter results back, and find NaN rows.

The host sorts by :func:`pack_sort_keys`, NumPy's ``np.sort`` of the packed keys, and
:func:`unpack_sorted`: each float64's bits as an integer of the same order, its low bits
replaced by the element's index, so that one sort of 8-byte integers (NumPy's SIMD sort)
gives both the sorted values and the argsort, which ``np.argsort`` computes by moving
(value, index) pairs. Values that differ only in the replaced bits are put in order after
the sort. Widened float32 values have none (their low 29 bits are alike), so rows of fewer
than 2**29 of them are never reordered. Rows where many values differ only there (float64
values within a few units in the last place of each other) are sorted a second time
(:func:`sort_rows_again`): about twice the cost of ``np.argsort`` for those rows, against
about half of it for all others.
"""

from __future__ import annotations

from numba import prange

from softorder.core import fast_exp
from softorder.core._jit import helper, kernel
from softorder.core.laplace import INF
from softorder.core.sort_rows import sort_rows

#: the bits of a float64 but its sign, those of +inf, and the key of every NaN (above +inf's)
_MAGNITUDE = 0x7FFFFFFFFFFFFFFF
_INF_BITS = 0x7FF0000000000000
_NAN_KEY = 0x7FFFFFFFFFFFFFFF
#: the bits of -0.0 as int64 (its key is 0.0's) and the sign bit alone
_NEGATIVE_ZERO = -(2**63)
#: moves by insertion that :func:`unpack_sorted` allows a row beyond its length: a short row
#: is put in order whatever its values (reversing 12 values takes 66 moves)
INSERTION_SLACK = 64
#: how many elements ahead the loops that read or write a row by its order ask for the
#: element they will reach (:func:`prefetch`), in rows of at least :data:`PREFETCH_FROM`
#: (shorter rows stay in the caches, where the extra instructions cost a few percent)
AHEAD = 32
PREFETCH_FROM = 1 << 15


if fast_exp._jit_enabled():
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, array, index):
        """Ask the CPU for ``array[index]`` (a 1-D array; ``index`` within it) ahead of a
        read or write there: ``llvm.prefetch``, which changes no value. The loops that follow
        a row's order read or write one random place per element, and a row larger than the
        caches waits on each; asked for :data:`AHEAD` elements early, they overlap.

        Examples
        --------
        >>> import numba, numpy as np
        >>> from softorder.core.rows import prefetch
        >>> @numba.njit
        ... def gathered_sum(values, order):
        ...     total = 0.0
        ...     for i in range(order.shape[0]):
        ...         prefetch(values, order[min(i + 2, order.shape[0] - 1)])
        ...         total += values[order[i]]
        ...     return total
        >>> gathered_sum(np.arange(10.0)[::2], np.array([4, 0, 3]))  # a strided row
        14.0
        """
        if not (isinstance(array, types.Array) and array.ndim == 1):
            return None

        def codegen(context, builder, signature, args):
            kind_of_array = signature.args[0]
            array = context.make_array(kind_of_array)(context, builder, args[0])
            index = context.cast(builder, args[1], signature.args[1], types.intp)
            byte = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            kind = ir.FunctionType(ir.VoidType(), (byte, i32, i32, i32))
            function = cgutils.get_or_insert_function(builder.module, kind, "llvm.prefetch.p0i8")
            # (the element's address by the array's strides: a row need not be contiguous)
            item = cgutils.get_item_pointer(context, builder, kind_of_array, array, [index])
            address = builder.bitcast(item, byte)
            # a write, kept in every cache level (locality 3), of data
            builder.call(function, (address, i32(1), i32(3), i32(1)))
            return context.get_dummy_value()

        return types.none(array, index), codegen

else:  # pragma: no cover - NUMBA_DISABLE_JIT

    def prefetch(array, index):
        """Nothing (NUMBA_DISABLE_JIT)."""


@helper
def sort_key(bits):
    """The int64 whose order is the order of the float64 whose bits (as int64) are ``bits``:
    NumPy's sort order, NaN last (every NaN alike) and ``-0.0`` equal to ``0.0``. The
    magnitude's bits grow with the magnitude, so a negative float's key is its magnitude's
    negation (whose trailing zeros, such as a widened float32's, stay zeros).
    """
    magnitude = bits & _MAGNITUDE
    if magnitude > _INF_BITS:
        return _NAN_KEY
    return magnitude if bits >= 0 else -magnitude


@kernel
def pack_sort_keys(bits, low, keys, exact):
    """``keys[row, i]``: :func:`sort_key` of ``bits[row, i]`` (a float64's bits as int64)
    with its bits in ``low`` (``2**b - 1`` for rows of at most ``2**b``) replaced by ``i``.
    Sorted as integers, the keys order each row's values, ties by their index, except values
    that differ only in the replaced bits (:func:`unpack_sorted` orders those).
    ``exact[row]`` is 1 when the row's keys hold its values whole: none has a bit in
    ``low``, none is NaN or ``-0.0`` (a widened float32 has 29 low zero bits). Takes int64
    views of float64 arrays: a view inside the kernel lengthened its first compilation by
    half.

    Examples
    --------
    >>> import numpy as np
    >>> from softorder import core
    >>> values = np.array([[2.0, -1.0, 0.5, -0.0]])
    >>> keys, exact = np.empty_like(values).view(np.int64), np.empty(1, np.uint8)
    >>> core.pack_sort_keys(values.view(np.int64), 3, keys, exact)  # rows of 4: two index bits
    >>> (np.sort(keys, axis=1) & 3).tolist()  # the indices in sorted order
    [[1, 3, 2, 0]]
    >>> int(exact[0])  # (-0.0 has the key of 0.0)
    0
    """
    rows, n = bits.shape
    high = ~low
    for row in prange(rows):
        b = bits[row]
        k = keys[row]
        lost = 0
        for i in range(n):
            v = b[i]
            k[i] = (sort_key(v) & high) | i
            # (integer ors, no branch: the loop stays as fast as without the check)
            lost |= (v & low) | ((v & _MAGNITUDE) > _INF_BITS) | (v == _NEGATIVE_ZERO)
        exact[row] = lost == 0


@kernel
def unpack_sorted(bits, low, keys, order, redo, exact):
    """From the keys of :func:`pack_sort_keys` sorted along each row: the argsort into
    ``order`` (int32 or int64) and the sorted values' bits into ``keys``: NumPy's
    ``np.argsort(values, axis=1, kind="stable")`` and the values in its order (``keys`` is
    an int64 view of the float64 result). The rows whose keys hold their values whole
    (``exact``, :func:`pack_sort_keys`) take them from the keys, with no read of ``bits``
    at the sorted indices (a random read per element, the most of this kernel's time at
    large n). In the others, values whose keys differ only in the replaced bits
    meet after the sort in the order of their indices; insertion puts them in order. A row
    that needs more than ``n +`` :data:`INSERTION_SLACK` moves for it (many values alike in
    all but their lowest bits) gets ``redo[row] = 1`` and unfinished rows of ``keys`` and
    ``order``, for :func:`sort_rows_again`. Returns how many rows did.

    Examples
    --------
    >>> import numpy as np
    >>> from softorder import core
    >>> values = np.array([[2.0, -1.0, np.nan, 0.5]])
    >>> bits = values.view(np.int64)
    >>> xs, exact = np.empty_like(values), np.empty(1, np.uint8)
    >>> core.pack_sort_keys(bits, 3, xs.view(np.int64), exact)
    >>> xs.view(np.int64).sort(axis=1)
    >>> order, redo = np.empty(values.shape, np.int32), np.empty(1, np.uint8)
    >>> core.unpack_sorted(bits, 3, xs.view(np.int64), order, redo, exact)
    0
    >>> order.tolist(), xs.tolist()
    ([[1, 3, 0, 2]], [[-1.0, 0.5, 2.0, nan]])
    """
    rows, n = bits.shape
    high = ~low
    unfinished = 0
    for row in prange(rows):
        b = bits[row]
        s = keys[row]
        o = order[row]
        redo[row] = 0
        if exact[row]:
            for i in range(n):
                key = s[i]
                o[i] = key & low
                magnitude = key & high  # (sort_key's inverse: a negative key is -magnitude)
                s[i] = magnitude if magnitude >= 0 else -magnitude | _NEGATIVE_ZERO
            continue
        moves = 0
        last = 0
        ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
        for i in range(n):
            if ahead:  # (a condition the loop does not change: LLVM splits it)
                prefetch(b, s[i + ahead if i + ahead < n else n - 1] & low)
            j = s[i] & low
            v = b[j]
            key = sort_key(v)
            if i > 0 and key < last:  # a value of the same high bits as the one before
                p = i
                while p > 0 and sort_key(s[p - 1]) > key:
                    s[p] = s[p - 1]
                    o[p] = o[p - 1]
                    p -= 1
                s[p] = v
                o[p] = j
                moves += i - p
                if moves > n + INSERTION_SLACK:
                    redo[row] = 1
                    unfinished += 1
                    break
            else:
                s[i] = v
                o[i] = j
                last = key
    return unfinished


@kernel
def sort_rows_again(values, xs, order, redo):
    """The rows that :func:`unpack_sorted` left (``redo[row]`` set), each sorted again by
    :func:`~softorder.core.sort_rows.sort_rows`, the JAX handlers' stable sort (a radix sort
    of the same packed keys, which sorts such rows by their low bits first). A kernel of its
    own, compiled when a row first needs it.

    Examples
    --------
    >>> import numpy as np
    >>> from softorder import core
    >>> values = np.array([[3.0, 1.0, 2.0], [0.0, 0.0, 0.0]])
    >>> xs, order = np.zeros_like(values), np.zeros(values.shape, np.int32)
    >>> core.sort_rows_again(values, xs, order, np.array([1, 0], np.uint8))  # row 0 only
    >>> order.tolist(), xs.tolist()
    ([[1, 2, 0], [0, 0, 0]], [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    """
    rows, n = values.shape
    for row in prange(rows):
        if redo[row]:
            sort_rows(values[row : row + 1], xs[row : row + 1], order[row : row + 1])


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
    n = r.shape[0]
    ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
    for i in range(n):
        if ahead:  # (a condition the loop does not change: LLVM splits it)
            prefetch(values, order[i + ahead if i + ahead < n else n - 1])
        out[i] = values[order[i]] if abs(r[i]) != INF else 0.0


@helper
def gather(order, values, out):
    """``out[i] = values[order[i]]`` (original order -> sorted order)."""
    n = order.shape[0]
    ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
    for i in range(n):
        if ahead:  # (a condition the loop does not change: LLVM splits it)
            prefetch(values, order[i + ahead if i + ahead < n else n - 1])
        out[i] = values[order[i]]


@helper
def scatter(order, values, out):
    """``out[order[i]] = values[i]`` (sorted order -> original order)."""
    n = order.shape[0]
    for i in range(n):
        out[order[i]] = values[i]


@helper
def scatter_finite(r, order, values, out):
    """``out[order[i]] = values[i]`` (sorted order -> original order), 0 at infinite entries."""
    n = r.shape[0]
    for i in range(n):
        out[order[i]] = values[i] if abs(r[i]) != INF else 0.0


@helper
def has_nan(r):
    """Sorted rows keep NaN last (NumPy's sort order), so one comparison finds it."""
    return r[r.shape[0] - 1] != r[r.shape[0] - 1]
