"""A per-row argsort inside compiled code, in NumPy's order, for callers that cannot sort
outside numba: the JAX bridge's XLA FFI handlers (:mod:`softorder.bridges._jax_ffi`), which run
as C functions with no Python to call ``np.argsort`` from, and the host's packed sort for the
rows it leaves (:func:`softorder.core.rows.sort_rows_again`).

The NumPy API sorts outside the kernels (NumPy's SIMD sort is faster than a comparison sort in
``njit``). A handler has to sort its rows itself, and an XLA sort in the traced graph cost more
than :func:`sort_rows` does (figures in CHANGELOG.md). :func:`sort_rows` is an LSD radix sort
of the float's bits with the index packed in their low bits, or for short rows a merge sort of
(key, position) pairs; :func:`gather_rows` puts rows back in the sorted order of a saved
argsort (a backward pass), without sorting again.
:mod:`softorder.core.cuda.sort_rows` is the device's counterpart, with the same arguments.

Both give the order of ``np.argsort(values, axis=1, kind="stable")``: ascending, NaN last (all
NaN equal, whatever their sign or payload), ``-0.0 == 0.0``, ties in their original order.
"""

from __future__ import annotations

import numpy as np

from softorder.core import fast_exp

#: Rows of at most this many elements take a merge sort (runs of :data:`RUN` sorted by
#: insertion, then merged): the radix sort's fixed cost per row (its counts of 7 x 256 buckets
#: and a prefix sum of 256 per pass) dominates short rows. 160 is about where the two cross
#: for float64 rows (the measurements are in CHANGELOG.md).
MERGE_MAX = 160
#: The merge sort's runs sorted by insertion before the merges (the fastest length for rows
#: of about 100: CHANGELOG.md).
RUN = 4


if fast_exp._jit_enabled():
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from softorder.core._jit import internal_function

    def _c_arrays(arrays, kinds) -> bool:
        return all(
            isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype in kind
            for a, kind in zip(arrays, kinds, strict=True)
        )

    _FLOATS, _INDICES = (types.float32, types.float64), (types.int32, types.int64)

    @intrinsic
    def sort_rows(typingctx, values, xs, order):
        """Sort each row of ``values`` into ``xs``, stably, NaN last and ``-0.0 == 0.0``, and
        write its argsort into ``order``: NumPy's ``np.argsort(values, axis=1, kind="stable")``.

        Rows of more than :data:`MERGE_MAX` elements: an LSD radix sort of packed keys, each a
        float's bits as an integer in the same order (NaN above ``+inf``, ``-0.0 == 0.0``) with
        its low bits (as many as ``n - 1`` has) replaced by its index: 8 bytes moved per key
        and pass, and no pass on the index's bits (the keys come in index order, and the
        passes are stable) nor on bits that every key has alike (29 low bits of a float32,
        widened or not). The indices of the sorted keys are the argsort, but for values alike
        in all but the replaced bits, which come out in index order and are put in order by
        insertion; a row that needs more than ``n`` moves for it is sorted again in two, by the
        keys' low bits then by their high bits. Rows of at most :data:`MERGE_MAX` take a stable
        merge sort of (key, position) pairs, whose cost per row has no fixed part. Scratch: four
        int64 rows of n, allocated once per call, and the byte counts on the stack.

        Emitted in place (an intrinsic, its loops written in LLVM IR, one function per module and
        dtypes): compiled code that calls it compiles no numba function for it, which
        lengthened the JAX bridge's first call (CHANGELOG.md). Python cannot call it.

        Parameters
        ----------
        values : float64 or float32 C-contiguous array of shape (rows, n)
            The rows to sort; not written.
        xs : float64 or float32 C-contiguous array of shape (rows, n)
            Receives each row of ``values`` in ascending order.
        order : int32 or int64 C-contiguous array of shape (rows, n)
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
        if not _c_arrays((values, xs, order), (_FLOATS, _FLOATS, _INDICES)):
            return None  # numba then reports that no signature matches

        def codegen(context, builder, signature, args):
            arrays = [
                context.make_array(t)(context, builder, a)
                for t, a in zip(signature.args, args, strict=True)
            ]
            rows, n = cgutils.unpack_tuple(builder, arrays[0].shape)
            word = ir.IntType(64)
            size = builder.mul(builder.add(builder.mul(n, word(4)), word(1)), word(8))
            scratch = context.nrt.allocate(builder, size)  # MemoryError when it fails
            types_ = [context.get_data_type(t.dtype) for t in signature.args]
            function = _radix_function(builder.module, *types_)
            pointers = [a.data for a in arrays]
            builder.call(
                function, (*pointers, builder.bitcast(scratch, word.as_pointer()), rows, n)
            )
            context.nrt.free(builder, scratch)
            return context.get_dummy_value()

        return types.none(values, xs, order), codegen

    def _radix_function(module, value, x, index):
        """``void sort(value* values, x* xs, index* order, i64* scratch, i64 rows, i64 n)``
        in ``module`` (internal, defined on first use): :func:`sort_rows`'s loops.
        """
        word = ir.IntType(64)
        name = f"softorder_sort_rows_{value}_{x}_{index}"
        kind = ir.FunctionType(
            ir.VoidType(),
            (value.as_pointer(), x.as_pointer(), index.as_pointer(), word.as_pointer(), word, word),
        )
        function, new = internal_function(module, kind, name, 4)
        if not new:
            return function
        b = ir.IRBuilder(function.append_basic_block("entry"))
        values, xs, order, scratch, rows, n = function.args
        quarters = [b.gep(scratch, [b.mul(n, word(i))]) for i in range(4)]
        pointers = tuple(cgutils.alloca_once(b, word.as_pointer()) for _ in range(4))
        redo = cgutils.alloca_once(b, ir.IntType(1))
        with cgutils.for_range(b, rows) as row:
            start = b.mul(row.index, n)
            row_ = tuple(b.gep(p, [start]) for p in (values, xs, order)) + (value, x, index)
            b.store(ir.Constant(ir.IntType(1), 1), redo)  # cleared when the packed keys did
            with b.if_then(b.icmp_signed(">", n, word(MERGE_MAX))):
                _packed_sort(b, row_, n, quarters, redo)
            with b.if_then(b.load(redo)):
                _merge_row(b, row_, n, quarters, pointers)
        b.ret_void()
        return function

    def _merge_row(b, row, n, quarters, pointers):
        """One row by a merge sort of its keys and their positions (rows of at most
        :data:`MERGE_MAX`, or whose packed keys cannot hold two indices), then the argsort and
        the sorted values out.
        """
        word = ir.IntType(64)
        top = word(0x7FFFFFFFFFFFFFFF)
        row_values, row_xs, row_order, value, x, index = row
        keys, places = quarters[:2], quarters[2:]
        source_keys, source_places, target_keys, target_places = pointers

        def at(pointer, i):
            return b.gep(pointer, [i])

        with cgutils.for_range(b, n) as loop:
            v = b.load(at(row_values, loop.index))
            if value != ir.DoubleType():
                v = b.fpext(v, ir.DoubleType())
            zero = ir.Constant(ir.DoubleType(), 0.0)
            k = b.bitcast(b.select(b.fcmp_ordered("==", v, zero), zero, v), word)
            k = b.select(b.icmp_signed("<", k, word(0)), b.xor(k, top), k)
            k = b.select(b.fcmp_unordered("uno", v, v), top, k)  # NaN above +inf
            b.store(k, at(keys[0], loop.index))
            b.store(loop.index, at(places[0], loop.index))
        b.store(keys[0], source_keys)
        b.store(places[0], source_places)
        b.store(keys[1], target_keys)
        b.store(places[1], target_places)
        _merge_sort(b, n, source_keys, source_places, target_keys, target_places)
        sorted_places = b.load(source_places)
        with cgutils.for_range(b, n) as loop:
            j = b.load(at(sorted_places, loop.index))
            _put(b, row, loop.index, j, b.load(at(row_values, j)))

    def _put(b, row, at, j, v):
        """``order[at] = j`` and ``xs[at] = v`` (a value of ``values``), in their types."""
        _, row_xs, row_order, value, x, index = row
        word = ir.IntType(64)
        b.store(b.trunc(j, index) if index != word else j, b.gep(row_order, [at]))
        if value != x:
            v = b.fpext(v, x) if x == ir.DoubleType() else b.fptrunc(v, x)
        b.store(v, b.gep(row_xs, [at]))

    def _insertion_sort(b, keys, places, n):
        """Stable insertion sort of ``keys[:n]``, moving ``places`` with them."""
        word = ir.IntType(64)
        j = cgutils.alloca_once(b, word)
        with cgutils.for_range(b, b.sub(n, word(1))) as loop:
            i = b.add(loop.index, word(1))
            k, place = b.load(b.gep(keys, [i])), b.load(b.gep(places, [i]))
            b.store(b.sub(i, word(1)), j)
            head, check, body, done = (
                b.append_basic_block(f"insert.{name}") for name in ("head", "check", "body", "done")
            )
            b.branch(head)
            b.position_at_end(head)
            b.cbranch(b.icmp_signed(">=", b.load(j), word(0)), check, done)
            b.position_at_end(check)
            current = b.load(j)
            b.cbranch(b.icmp_signed(">", b.load(b.gep(keys, [current])), k), body, done)
            b.position_at_end(body)
            current = b.load(j)
            following = b.add(current, word(1))
            b.store(b.load(b.gep(keys, [current])), b.gep(keys, [following]))
            b.store(b.load(b.gep(places, [current])), b.gep(places, [following]))
            b.store(b.sub(current, word(1)), j)
            b.branch(head)
            b.position_at_end(done)
            following = b.add(b.load(j), word(1))
            b.store(k, b.gep(keys, [following]))
            b.store(place, b.gep(places, [following]))

    def _merge_sort(b, n, source_keys, source_places, target_keys, target_places):
        """Stable bottom-up merge sort of the ``n`` keys in ``*source_keys``, moving the places
        with them: insertion sorts of runs of :data:`RUN`, then merges of neighbouring runs
        (:func:`_merge`) from the source arrays into the target arrays, which then swap.
        """
        word = ir.IntType(64)
        keys, places = b.load(source_keys), b.load(source_places)
        with cgutils.for_range_slice(b, word(0), n, word(RUN)) as (start, _):
            length = b.sub(n, start)
            length = b.select(b.icmp_signed("<", length, word(RUN)), length, word(RUN))
            _insertion_sort(b, b.gep(keys, [start]), b.gep(places, [start]), length)
        width = cgutils.alloca_once_value(b, word(RUN))
        cursors = [cgutils.alloca_once(b, word) for _ in range(6)]
        head, body, done = (
            b.append_basic_block(f"merge.{name}") for name in ("head", "body", "done")
        )
        b.branch(head)
        b.position_at_end(head)
        w = b.load(width)
        b.cbranch(b.icmp_signed("<", w, n), body, done)
        b.position_at_end(body)
        keys, places = b.load(source_keys), b.load(source_places)
        new_keys, new_places = b.load(target_keys), b.load(target_places)

        def least(a, c):
            return b.select(b.icmp_signed("<", a, c), a, c)

        with cgutils.for_range_slice(b, word(0), n, b.add(w, w)) as (start, _):
            middle = least(b.add(start, w), n)
            end = least(b.add(middle, w), n)
            arrays = (keys, places, new_keys, new_places)
            _merge(b, arrays, cursors, start, middle, end)
        b.store(new_keys, source_keys)
        b.store(new_places, source_places)
        b.store(keys, target_keys)
        b.store(places, target_places)
        b.store(b.add(w, w), width)
        b.branch(head)
        b.position_at_end(done)

    def _merge(b, arrays, cursors, start, middle, end):
        """Merge the sorted runs ``[start, middle)`` and ``[middle, end)`` of ``keys`` (with
        their ``places``) into ``[start, end)`` of ``new_keys`` and ``new_places``, stably: on
        a tie the left run's key comes first.

        First from both ends at once, as many steps as the shorter run has keys: a step takes
        the least of the two heads and the greatest of the two tails (two independent chains
        of loads). After ``k`` such steps each end has taken ``k`` keys, at most ``k`` of a run,
        so neither end reads past a run, and the two ends have not met. What is left (the
        longer run's excess, with the rest of the shorter one) is merged from the front with
        bounds checks, in the same loop as a run's tail copy (less code to compile).
        ``cursors``: six int64 slots (allocas) for the positions.
        """
        word = ir.IntType(64)
        keys, places, new_keys, new_places = arrays
        i, j, ie, je, out, oe = cursors
        one = word(1)
        for pointer, value in zip(
            cursors,
            (start, middle, b.sub(middle, one), b.sub(end, one), start, b.sub(end, one)),
            strict=True,
        ):
            b.store(value, pointer)
        short = b.sub(middle, start)
        short = b.select(b.icmp_signed("<", b.sub(end, middle), short), b.sub(end, middle), short)

        def take(left, right, from_right, at):
            b.store(b.select(from_right, right[1], left[1]), b.gep(new_keys, [at]))
            place = b.select(from_right, right[0], left[0])
            b.store(b.load(b.gep(places, [place])), b.gep(new_places, [at]))

        def front_step(ends=None):
            left, right, o = b.load(i), b.load(j), b.load(out)
            # a key at a run's end is read (inside the scratch: index <= n) and not taken
            heads = [(k, b.load(b.gep(keys, [k]))) for k in (left, right)]
            from_right = b.icmp_signed("<", heads[1][1], heads[0][1])  # ties: the left run
            if ends is not None:
                from_right = b.or_(
                    b.icmp_signed(">=", left, ends[0]),
                    b.and_(b.icmp_signed("<", right, ends[1]), from_right),
                )
            take(*heads, from_right, o)
            step = b.zext(from_right, word)
            b.store(b.add(left, b.sub(one, step)), i)
            b.store(b.add(right, step), j)
            b.store(b.add(o, one), out)

        with cgutils.for_range(b, short):
            front_step()
            left, right, o = b.load(ie), b.load(je), b.load(oe)
            tails = [(k, b.load(b.gep(keys, [k]))) for k in (left, right)]
            from_left = b.icmp_signed(">", tails[0][1], tails[1][1])  # ties: the right run
            take(*tails, b.not_(from_left), o)
            step = b.zext(from_left, word)
            b.store(b.sub(left, step), ie)
            b.store(b.sub(right, b.sub(one, step)), je)
            b.store(b.sub(o, one), oe)
        left_end, right_end = b.add(b.load(ie), one), b.add(b.load(je), one)
        with cgutils.for_range(b, b.sub(b.add(b.load(oe), one), b.load(out))):
            front_step((left_end, right_end))

    #: The bytes a radix sort counts, from bit 8 or above: rows past :data:`MERGE_MAX` (at
    #: least 128) have 8 bits of index or more below their keys' bits.
    DIGITS = 7
    assert MERGE_MAX >= 128

    def _passes_function(module):
        """``i64* passes(i64* keys, i64* spare, i64 n, i64 shift)`` in ``module`` (internal,
        defined on first use, one for every caller in the module): a stable LSD radix sort of
        the unsigned ``keys`` on their bytes from bit ``shift`` (below 64, and at least 8: the
        bits below it are left in the order they came in), from ``keys`` into ``spare`` and
        back; it returns the one that holds them sorted. The bytes are counted in one pass; a
        byte that every key has alike is skipped.
        """
        word = ir.IntType(64)
        name = "softorder_sort_rows_passes"
        kind = ir.FunctionType(
            word.as_pointer(), (word.as_pointer(), word.as_pointer(), word, word)
        )
        function, new = internal_function(module, kind, name, 2)
        if not new:
            return function
        b = ir.IRBuilder(function.append_basic_block("entry"))
        first_keys, spare, n, shift = function.args
        byte = word(0xFF)
        counts = b.bitcast(b.alloca(ir.ArrayType(word, DIGITS * 256)), word.as_pointer())
        starts = b.bitcast(b.alloca(ir.ArrayType(word, 256)), word.as_pointer())
        source, target = (cgutils.alloca_once_value(b, p) for p in (first_keys, spare))
        total = cgutils.alloca_once(b, word)

        def digit_of(k, at):
            return b.and_(b.lshr(b.lshr(k, shift), at), byte)

        cgutils.memset(b, counts, word(DIGITS * 256 * 8), 0)
        with cgutils.for_range(b, n) as loop:
            k = b.load(b.gep(first_keys, [loop.index]))
            for digit in range(DIGITS):
                slot = b.gep(counts, [b.add(digit_of(k, word(8 * digit)), word(256 * digit))])
                b.store(b.add(b.load(slot), word(1)), slot)
        # the bytes that hold bits of the keys: a count known only at run time, which also
        # keeps LLVM from unrolling the passes (its compilation took half as long again)
        digits = b.lshr(b.sub(word(64 + 7), shift), word(3))
        with cgutils.for_range(b, digits) as digit:
            at = b.mul(digit.index, word(8))
            table = b.gep(counts, [b.mul(digit.index, word(256))])
            keys = b.load(source)
            moves = b.icmp_signed("!=", b.load(b.gep(table, [digit_of(b.load(keys), at)])), n)
            with b.if_then(moves):  # else one value of this byte: nothing would move
                # the byte's places in a table at a fixed place on the stack, not in the
                # counts at a digit's offset: the passes took twice as long with the latter
                # (on AMD EPYC), as with a digit shifted in two steps (bit + at is below 64)
                b.store(word(0), total)
                with cgutils.for_range(b, word(256)) as d:
                    c = b.load(b.gep(table, [d.index]))
                    b.store(b.load(total), b.gep(starts, [d.index]))
                    b.store(b.add(b.load(total), c), total)
                new_keys = b.load(target)
                bit = b.add(shift, at)
                with cgutils.for_range(b, n) as loop:
                    k = b.load(b.gep(keys, [loop.index]))
                    slot = b.gep(starts, [b.and_(b.lshr(k, bit), byte)])
                    j = b.load(slot)
                    b.store(b.add(j, word(1)), slot)
                    b.store(k, b.gep(new_keys, [j]))
                b.store(new_keys, source)
                b.store(keys, target)
        b.ret(b.load(source))
        return function

    def _unsigned_key(b, v):
        """The i64 whose unsigned order is the order of the double ``v``: NaN last (all NaN
        alike), ``-0.0 == 0.0``. Its low bits are those of ``v``'s magnitude, or of their
        negation: zero where ``v``'s are (a float32 widened has 29 of them).
        """
        word = ir.IntType(64)
        bits = b.bitcast(v, word)
        magnitude = b.and_(bits, word(0x7FFFFFFFFFFFFFFF))
        sign = word(-(2**63))
        k = b.select(
            b.icmp_signed("<", bits, word(0)), b.sub(sign, magnitude), b.or_(magnitude, sign)
        )
        return b.select(b.fcmp_unordered("uno", v, v), word(-1), k)

    def _sort_packed(b, n, bits, high, keys, spare, key_of):
        """Radix-sort ``key_of(i) | i`` (``key_of(i)``: an i64 that is zero in ``~high``, the
        low ``bits``) for i in ``range(n)``, written into ``keys``, by
        :func:`_passes_function`'s function from the lowest bit that varies over the row (at
        least ``bits``: a float32's key has 29 low zeros, and the bytes then start at bit 29).
        Returns the one of ``keys`` and ``spare`` that holds them sorted.
        """
        word = ir.IntType(64)
        ones, zeros = cgutils.alloca_once_value(b, word(0)), cgutils.alloca_once_value(b, high)
        with cgutils.for_range(b, n) as loop:
            k = key_of(loop.index)
            b.store(b.or_(b.load(ones), k), ones)
            b.store(b.and_(b.load(zeros), k), zeros)
            b.store(b.or_(k, loop.index), b.gep(keys, [loop.index]))
        varying = b.xor(b.load(ones), b.load(zeros))
        shift = b.cttz(varying, ir.Constant(ir.IntType(1), 0))
        shift = b.select(b.icmp_unsigned("<", shift, word(63)), shift, word(63))  # none vary
        passes = _passes_function(b.module)
        return b.call(passes, (keys, spare, n, shift))

    def _packed_sort(b, row, n, quarters, redo):
        """One row of more than :data:`MERGE_MAX` by packed keys: each value's
        :func:`_unsigned_key` with its low ``bits`` (those of ``n - 1``) replaced by its index,
        radix-sorted alone (8 bytes a move, not 16 with a position) on the bits above the
        index (the keys come in index order and the passes are stable), then the argsort
        (``key & low``) and the values out. Values alike in all but the replaced bits come out
        in index order, and insertion puts them in order.

        A row that needs more than ``n`` moves for it is sorted again in two: by its keys' low
        bits (packed above the index), then by their high bits stably (packed above the
        position in that order). A row too long for two indices in 64 bits keeps ``*redo``
        set, for :func:`_merge_row`.
        """
        word = ir.IntType(64)
        row_values = row[0]
        row_order, value, index = row[2], row[3], row[5]
        bits = b.sub(word(64), b.ctlz(b.sub(n, word(1)), ir.Constant(ir.IntType(1), 0)))
        low = b.sub(b.shl(word(1), bits), word(1))
        high = b.not_(low)

        def value_at(i):
            v = b.load(b.gep(row_values, [i]))
            return v, _unsigned_key(
                b, v if value == ir.DoubleType() else b.fpext(v, ir.DoubleType())
            )

        def index_at(keys, i):
            return b.and_(b.load(b.gep(keys, [i])), low)

        packed = _sort_packed(
            b, n, bits, high, quarters[0], quarters[1], lambda i: b.and_(value_at(i)[1], high)
        )
        i, p, moves, last = (cgutils.alloca_once_value(b, word(0)) for _ in range(4))
        blocks = ("head", "body", "next", "insert", "check", "shift", "place", "sorted")
        head, body, next_, insert, check, shift, place, sorted_ = (
            b.append_basic_block(f"packed.{name}") for name in blocks
        )
        again, done = b.append_basic_block("packed.again"), b.append_basic_block("packed.done")
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(b.icmp_signed("<", b.load(i), n), body, sorted_)
        b.position_at_end(body)
        at = b.load(i)
        j = index_at(packed, at)
        v, k = value_at(j)
        # out of order only after values of the same high bits (keys of 0 come first)
        b.cbranch(b.icmp_unsigned("<", k, b.load(last)), insert, next_)
        b.position_at_end(next_)
        _put(b, row, at, j, v)
        b.store(k, last)
        b.store(b.add(at, word(1)), i)
        b.branch(head)
        b.position_at_end(insert)
        b.store(at, p)
        b.branch(check)
        b.position_at_end(check)  # at p - 1 (there is one: the key before is above k)
        before = b.sub(b.load(p), word(1))
        j_before = b.load(b.gep(row_order, [before]))
        j_before = b.sext(j_before, word) if index != word else j_before
        b.cbranch(b.icmp_unsigned(">", value_at(j_before)[1], k), shift, place)
        b.position_at_end(shift)
        for array in (row_order, row[1]):
            b.store(b.load(b.gep(array, [before])), b.gep(array, [b.load(p)]))
        b.store(before, p)
        b.cbranch(b.icmp_signed(">", before, word(0)), check, place)
        b.position_at_end(place)
        _put(b, row, b.load(p), j, v)
        b.store(b.add(b.load(moves), b.sub(at, b.load(p))), moves)
        b.store(b.add(at, word(1)), i)
        b.cbranch(b.icmp_signed(">", b.load(moves), n), again, head)

        b.position_at_end(again)  # two sorts, when two indices fit in the bits of a key
        with b.if_then(b.icmp_unsigned("<=", bits, word(32))):
            by_low = _sort_packed(
                b,
                n,
                bits,
                b.shl(low, bits),
                quarters[0],
                quarters[1],
                lambda i: b.shl(b.and_(value_at(i)[1], low), bits),
            )
            by_both = _sort_packed(
                b,
                n,
                bits,
                high,
                quarters[2],
                quarters[3],
                lambda r: b.and_(value_at(index_at(by_low, r))[1], high),
            )
            with cgutils.for_range(b, n) as loop:
                j = index_at(by_low, index_at(by_both, loop.index))
                _put(b, row, loop.index, j, value_at(j)[0])
            b.store(ir.Constant(ir.IntType(1), 0), redo)
        b.branch(done)
        b.position_at_end(sorted_)
        b.store(ir.Constant(ir.IntType(1), 0), redo)
        b.branch(done)
        b.position_at_end(done)

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

else:  # pragma: no cover - NUMBA_DISABLE_JIT: Python functions

    def sort_rows(values, xs, order):
        """NumPy's stable argsort and sorted rows (NUMBA_DISABLE_JIT)."""
        order[...] = np.argsort(values, axis=1, kind="stable")
        xs[...] = np.take_along_axis(values, order, 1)

    def gather_rows(out, values, order):
        """``out[r, i] = values[r, order[r, i]]`` (NUMBA_DISABLE_JIT)."""
        out[...] = np.take_along_axis(values, order, 1)
