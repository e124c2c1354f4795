"""XLA FFI handlers of the JAX bridge: numba ``cfunc`` s that XLA calls in place, on the CPU.

The JAX bridge routes ``soft_rank``, ``soft_sort``, ``soft_topk``, ``log_soft_topk`` and
``soft_quantile`` here when a call is traced for the CPU backend with a concrete ``k`` (one
per row) or a few concrete ``q`` per row, and ``topk_cross_entropy`` and
``permutation_cross_entropy`` with a concrete ``p_k``: those are validated then, so a call
costs its kernels, without the Python, the GIL and the host copies of a callback (figures in
CHANGELOG.md). The losses' labels and target ranks, and ``alpha`` (a learnable temperature),
are data that may be traced in a training step: the handlers check them as they read them,
and return an XLA error (INVALID_ARGUMENT, with the NumPy API's message: :func:`fail`) for a
bad one; a traced ``alpha``'s gradient is summed by the backward pass (:func:`_alpha_sums`).

Each handler is one C function of XLA's typed FFI (``api_version=1``,
``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``, ``xla/ffi/api/c_api.h`` in
``jax.ffi.include_dir()``) that returns NULL (success) but for those errors. It reads XLA's
call frame and buffers through intrinsics (code emitted in place), sorts the rows itself
(:mod:`softorder.core.sort_rows`, faster than XLA's sort) and calls the NumPy API's serial
kernels by symbol (:data:`KERNELS`: the very same compilations) on the same float64 rows and
int32 orders, so its results are bitwise the NumPy API's when the rows have no ties (with
ties, this sort is stable, NumPy's is not, and a gradient may sum in another order). A handler
is one numba compilation, cached on disk next to the kernels (:func:`softorder.core.cache_dir`).

One handler per operation serves its forward and backward passes, told apart by their number
of operands. The rows are flattened over every leading axis (``vmap`` adds some,
``vmap_method="broadcast_all"``):

* forward: the input rows in the computing dtype (float32 or float64: widened to float64,
  exactly), ``alpha`` once per row in that dtype, int32 flags ``(negate, log)`` and for
  top-k ``k`` once per row; results: the output, the int32 argsort of each row, and the
  float64 or int64 residuals (the rank decays; the targets' anchors and offsets) as
  uint32 words, two per value, so that they survive without ``jax_enable_x64``;
* backward: the same input, ``alpha`` and flags, the argsort and residuals, and the
  cotangent; result: the gradient of the input; with one more argument after the cotangent
  (int32 ``(group, summed)``: a traced ``alpha``, one value per run of ``group`` rows), a
  second result: the gradient of alpha, one value per run.

The losses' handlers take one value per row (the loss; its cotangent) and every forward
argument again in the backward pass (the labels or target ranks, ``P_K``), which they check
again: they are the same values, and a handler must not read a bad one.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.ccallback import CFunc
from numba.extending import intrinsic
from numba.np.arrayobj import np_cfarray

from softorder._engine.checks import SMALLEST_ALPHA
from softorder.core import _jit, lapsum, permutation, rank, sort, topk, topk_loss
from softorder.core._jit import (
    SymbolCalls,
    cache_classes,
    cache_dir,
    helper,
    inner_helper,
    internal_function,
)
from softorder.core.lapsum import empty
from softorder.core.sort_rows import gather_rows, sort_rows

F32 = 11  # XLA_FFI_DataType of float32 (the handlers' other buffers are float64, 12)
S64 = 5  # XLA_FFI_DataType of int64 (labels and target ranks are int32, 4, or int64)
INVALID_ARGUMENT = 3  # XLA_FFI_Error_Code of a bad value (labels, target ranks)
#: the XLA FFI API version the handlers are written against (xla/ffi/api/c_api.h)
API_MAJOR, API_MINOR = 0, 1
EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
METADATA = 1  # XLA_FFI_Extension_Metadata

#: the bits of float64 +inf, and of the smallest alpha taken, as int64 (positive floats
#: order as their bits)
INFINITY_BITS = int(np.array(np.inf).view(np.int64))
SMALLEST_ALPHA_BITS = int(np.array(SMALLEST_ALPHA).view(np.int64))

_lock = threading.Lock()
_registered: dict = {}
_noted = _jit._noted  # one first-compilation note per process
_log = logging.getLogger("softorder")


# The handlers reach XLA's call frame and buffers through the intrinsics below: a numba function
# (``carray``, a helper) would cost a compilation of its own on a first call, however small.


def _pointer(context, builder, address, dtype):
    return builder.inttoptr(address, context.get_data_type(dtype).as_pointer())


@intrinsic
def peek(typingctx, address, index, kind):
    """Element ``index`` of the ``kind`` values (``np.int32`` or ``np.int64``) at ``address``."""
    dtype = kind.instance_type

    def codegen(context, builder, signature, args):
        return builder.load(builder.gep(_pointer(context, builder, args[0], dtype), [args[1]]))

    return dtype(types.int64, types.int64, kind), codegen


@intrinsic
def array_at(typingctx, address, shape, kind):
    """The C-contiguous ``kind`` array of ``shape`` (a tuple) at ``address`` (not owned)."""
    array_type = types.Array(kind.instance_type, len(shape), "C")

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], context.get_value_type(types.voidptr))
        inner = array_type(types.voidptr, signature.args[1])
        return np_cfarray(context, builder, inner, (pointer, args[1]))

    return array_type(types.int64, shape, kind), codegen


@intrinsic
def buffer(typingctx, frame, slot, i):
    """(data address, dtype) of argument or result ``i`` (``slot``: :data:`ARGS` or
    :data:`RESULTS`): the data and the XLA_FFI_DataType code of its XLA_FFI_Buffer.
    """

    def codegen(context, builder, signature, args):
        word = ir.IntType(64)
        frame = builder.inttoptr(args[0], word.as_pointer())
        buffers = builder.inttoptr(builder.load(builder.gep(frame, [args[1]])), word.as_pointer())
        found = builder.load(builder.gep(buffers, [args[2]]))
        fields = builder.inttoptr(found, word.as_pointer())
        dtype = builder.and_(builder.load(builder.gep(fields, [word(2)])), word(0xFFFFFFFF))
        address = builder.load(builder.gep(fields, [word(3)]))
        return context.make_tuple(builder, signature.return_type, (address, dtype))

    return types.UniTuple(types.int64, 2)(types.int64, types.int64, types.int64), codegen


def _copy(context, builder, array, address, code, negate, widen: bool):
    """Copy the float32 or float64 values (``code``: the XLA_FFI_DataType) at ``address`` into
    the float64 C-contiguous ``array`` (``widen``), or back, negated on request: a call of one
    function per direction in the handler's module (:func:`_copy_function`), not its loops
    emitted again at each call: they were a third of a handler's compilation (CHANGELOG.md).
    """
    function = _copy_function(builder.module, widen)
    raw = builder.inttoptr(address, ir.IntType(8).as_pointer())
    doubles = builder.bitcast(array.data, ir.IntType(8).as_pointer())
    builder.call(function, (doubles, raw, array.nitems, code, negate))
    return context.get_dummy_value()


def _copy_function(module, widen: bool):
    """``void copy(i8* noalias float64s, i8* noalias raw, i64 count, i64 code, i1 negate)``
    in ``module`` (defined on first use, internal, never inlined): the loops of :func:`_copy`.
    The two buffers never overlap (one is the handler's own array, the other XLA's buffer).
    Negation flips the sign bit (what ``fneg`` is, NaN included), as an exclusive or with a
    mask set once, so that the loop has no branch on ``negate`` to duplicate it.
    """
    word, byte = ir.IntType(64), ir.IntType(8).as_pointer()
    kind = ir.FunctionType(ir.VoidType(), (byte, byte, word, word, ir.IntType(1)))
    name = f"softorder_{'widen' if widen else 'narrow'}"
    function, new = internal_function(module, kind, name, 2)
    if not new:
        return function
    builder = ir.IRBuilder(function.append_basic_block("entry"))
    doubles, raw, count, code, negate = function.args
    sign = builder.shl(builder.zext(negate, word), word(63))  # the sign bit, or 0
    is32 = builder.icmp_signed("==", code, ir.Constant(code.type, F32))
    with builder.if_else(is32) as (single, double):
        for branch, precision in ((single, ir.FloatType()), (double, None)):
            with branch:
                narrow = builder.bitcast(raw, (precision or ir.DoubleType()).as_pointer())
                wide = builder.bitcast(doubles, word.as_pointer())
                with cgutils.for_range(builder, count) as loop:
                    if widen:
                        value = builder.load(builder.gep(narrow, [loop.index]))
                        if precision is not None:
                            value = builder.fpext(value, ir.DoubleType())
                        bits = builder.xor(builder.bitcast(value, word), sign)
                        builder.store(bits, builder.gep(wide, [loop.index]))
                    else:
                        bits = builder.xor(builder.load(builder.gep(wide, [loop.index])), sign)
                        value = builder.bitcast(bits, ir.DoubleType())
                        if precision is not None:
                            value = builder.fptrunc(value, precision)
                        builder.store(value, builder.gep(narrow, [loop.index]))
    builder.ret_void()
    return function


@intrinsic
def widen(typingctx, out, address, dtype, negate):
    """Fill the float64 C-contiguous ``out`` with the values at ``address`` (:func:`_copy`)."""

    def codegen(context, builder, signature, args):
        out = context.make_array(signature.args[0])(context, builder, args[0])
        return _copy(context, builder, out, args[1], args[2], args[3], widen=True)

    return types.none(out, types.int64, types.int64, types.boolean), codegen


@intrinsic
def narrow(typingctx, address, dtype, values, negate):
    """Write the float64 C-contiguous ``values`` at ``address`` (:func:`_copy`)."""

    def codegen(context, builder, signature, args):
        values = context.make_array(signature.args[2])(context, builder, args[2])
        return _copy(context, builder, values, args[0], args[1], args[3], widen=False)

    return types.none(types.int64, types.int64, values, types.boolean), codegen


#: words of XLA_FFI_Api (xla/ffi/api/c_api.h): ``XLA_FFI_Error_Create`` follows struct_size,
#: extension_start, api_version (3 words) and internal_api
API, ERROR_CREATE = 2, 6
#: bytes of a handler's error message, its terminating NUL included
MESSAGE_BYTES = 512


@intrinsic(prefer_literal=True)
def fail(typingctx, frame, *pieces):
    """The ``XLA_FFI_Error*`` (as int64) of an INVALID_ARGUMENT error whose message is
    ``pieces`` (string constants, integers written in decimal and floats written as C's
    ``%.17g`` writes them, which tells every float64 apart) one after the other: what a
    handler returns for a bad value that only the run can see (a traced label or alpha). XLA
    copies the message (``XLA_FFI_Error_Create``); the process goes on and JAX raises
    :class:`jax.errors.JaxRuntimeError` with it.
    """
    strings = [p.literal_value for p in pieces if isinstance(p, types.StringLiteral)]
    if not all(isinstance(p, (types.StringLiteral, types.Integer, types.Float)) for p in pieces):
        raise TypeError(f"softorder: fail takes strings, integers and floats; got {pieces}")
    if sum(len(t.encode()) for t in strings) + 25 * (len(pieces) - len(strings)) >= MESSAGE_BYTES:
        raise ValueError("softorder: a handler's error message is too long")

    def codegen(context, builder, signature, args):
        word, byte = ir.IntType(64), ir.IntType(8)
        text = cgutils.alloca_once(builder, ir.ArrayType(byte, MESSAGE_BYTES))
        start = builder.bitcast(text, byte.as_pointer())
        put_int = _put_int_function(builder.module)
        position = word(0)
        for piece, value in zip(pieces, cgutils.unpack_tuple(builder, args[1]), strict=True):
            if isinstance(piece, types.StringLiteral):
                data = piece.literal_value.encode()
                constant = cgutils.make_bytearray(data)
                found = cgutils.global_constant(builder.module, "softorder_message", constant)
                source = builder.bitcast(found, byte.as_pointer())
                cgutils.raw_memcpy(
                    builder, builder.gep(start, [position]), source, word(len(data)), 1
                )
                position = builder.add(position, word(len(data)))
            elif isinstance(piece, types.Float):  # (at most 24 characters, and the NUL)
                number = context.cast(builder, value, piece, types.float64)
                at = builder.gep(start, [position])
                written = cgutils.snprintf(builder, at, word(25), "%.17g", number)
                position = builder.add(position, builder.sext(written, word))
            else:
                number = context.cast(builder, value, types.unliteral(piece), types.int64)
                position = builder.call(put_int, (start, position, number))
        builder.store(byte(0), builder.gep(start, [position]))
        # XLA_FFI_Error_Create_Args: struct_size (up to errc's end: 28), extension_start,
        # message, errc
        kind = ir.LiteralStructType((word, byte.as_pointer(), byte.as_pointer(), ir.IntType(32)))
        create_args = cgutils.alloca_once(builder, kind)
        for index, field in enumerate(
            (
                word(28),
                ir.Constant(byte.as_pointer(), None),
                start,
                ir.IntType(32)(INVALID_ARGUMENT),
            )
        ):
            builder.store(field, cgutils.gep_inbounds(builder, create_args, 0, index))
        frame_words = builder.inttoptr(args[0], word.as_pointer())
        api = builder.inttoptr(
            builder.load(builder.gep(frame_words, [word(API)])), word.as_pointer()
        )
        create_type = ir.FunctionType(byte.as_pointer(), (kind.as_pointer(),))
        address = builder.load(builder.gep(api, [word(ERROR_CREATE)]))
        error = builder.call(builder.inttoptr(address, create_type.as_pointer()), (create_args,))
        return builder.ptrtoint(error, word)

    return types.int64(frame, types.StarArgTuple.from_types(pieces)), codegen


def _put_int_function(module):
    """``i64 put_int(i8* text, i64 position, i64 value)`` in ``module`` (defined on first use,
    internal): ``value`` in decimal at ``text + position``; the position after it.
    """
    word, byte = ir.IntType(64), ir.IntType(8)
    kind = ir.FunctionType(word, (byte.as_pointer(), word, word))
    function, new = internal_function(module, kind, "softorder_put_int", 0)
    if not new:
        return function
    builder = ir.IRBuilder(function.append_basic_block("entry"))
    text, position, value = function.args
    digits = builder.alloca(ir.ArrayType(byte, 20))
    first = builder.bitcast(digits, byte.as_pointer())
    at = builder.alloca(word)
    count = builder.alloca(word)
    rest = builder.alloca(word)
    builder.store(position, at)
    builder.store(word(0), count)
    negative = builder.icmp_signed("<", value, word(0))
    with builder.if_then(negative):
        builder.store(byte(ord("-")), builder.gep(text, [position]))
        builder.store(builder.add(position, word(1)), at)
    # the magnitude as unsigned (-INT64_MIN wraps to 2**63, which is right as unsigned)
    builder.store(builder.select(negative, builder.sub(word(0), value), value), rest)
    split, copy, done = (function.append_basic_block(n) for n in ("split", "copy", "done"))
    builder.branch(split)
    builder.position_at_end(split)  # the digits, last first
    number, n = builder.load(rest), builder.load(count)
    digit = builder.trunc(builder.urem(number, word(10)), byte)
    builder.store(builder.add(digit, byte(ord("0"))), builder.gep(first, [n]))
    builder.store(builder.add(n, word(1)), count)
    builder.store(builder.udiv(number, word(10)), rest)
    builder.cbranch(builder.icmp_unsigned("!=", builder.load(rest), word(0)), split, copy)
    builder.position_at_end(copy)  # then in order
    n = builder.sub(builder.load(count), word(1))
    builder.store(n, count)
    here = builder.load(at)
    builder.store(builder.load(builder.gep(first, [n])), builder.gep(text, [here]))
    builder.store(builder.add(here, word(1)), at)
    builder.cbranch(builder.icmp_unsigned("!=", n, word(0)), copy, done)
    builder.position_at_end(done)
    builder.ret(builder.load(at))
    return function


#: the C symbol through which the permutation loss's handler hands the rows its ladder VJP
#: left to the general kernel (:func:`rows_left`, :func:`_rows_left`)
ROWS_LEFT = "softorder_permutation_loss_rows_left"


@intrinsic
def rows_left(typingctx, xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar):
    """Call :data:`ROWS_LEFT` with the arrays' data and ``xs``'s shape: the rows of the
    permutation loss's backward pass that :func:`~softorder.core.permutation._ladder_vjp_rows`
    left (far ties, boundaries out of order: rare), by the general kernel, through Python
    (:func:`_rows_left`). The general kernel is compiled when a row first needs it, as in the
    NumPy API, not with the handler (whose first compilation it would lengthen several times:
    CHANGELOG.md). Returns 0, or 1 when the call failed (logged).
    """
    arrays = (xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar)

    def codegen(context, builder, signature, args):
        word = ir.IntType(64)
        made = [
            context.make_array(t)(context, builder, a) for t, a in zip(arrays, args, strict=True)
        ]
        pointers = [builder.ptrtoint(array.data, word) for array in made]
        shape = cgutils.unpack_tuple(builder, made[0].shape, 2)
        kind = ir.FunctionType(word, [word] * (len(arrays) + 2))
        function = cgutils.get_or_insert_function(builder.module, kind, ROWS_LEFT)
        return builder.call(function, (*pointers, *shape))

    return types.int64(*arrays), codegen


def _rows_left(xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar, rows, n) -> int:
    """:data:`ROWS_LEFT`: :func:`~softorder.core.permutation.ladder_vjp_left_rows` on the
    handler's arrays (addresses; float64 but for the int32 order, target ranks and anchors).
    """
    try:
        double, int32 = ctypes.c_double, ctypes.c_int32

        def at(address, kind, shape):
            return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(kind)), shape)

        full, bounds = (rows, n), (rows, n - 1)
        permutation.ladder_vjp_left_rows(
            at(xs, double, full),
            at(order, int32, full),
            at(alpha, double, (rows,)),
            at(target, int32, full),
            at(anchor, int32, bounds),
            at(offset, double, bounds),
            at(cot, double, (rows,)),
            at(x_bar, double, full),
            at(alpha_bar, double, (rows,)),
        )
    except BaseException:  # (nothing may leave a C callback)
        _log.exception("softorder: the permutation loss's general VJP failed in its handler")
        return 1
    return 0


_rows_left_callback = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int64] * 11)(_rows_left)


def _link_rows_left() -> None:
    """Register :data:`ROWS_LEFT` (before the permutation loss's handler loads or compiles)."""
    import llvmlite.binding

    address = ctypes.cast(_rows_left_callback, ctypes.c_void_p).value
    llvmlite.binding.add_symbol(ROWS_LEFT, address)


_F1, _F2, _F3 = (types.Array(types.float64, d, "C") for d in (1, 2, 3))
_I2, _L2 = types.Array(types.int32, 2, "C"), types.Array(types.int64, 2, "C")
_L1, _B = types.Array(types.int64, 1, "C"), types.boolean

#: words of XLA_FFI_CallFrame (xla/ffi/api/c_api.h): the stage, the argument count and the
#: arguments' and results' arrays of XLA_FFI_Buffer pointers
STAGE, ARG_COUNT, ARGS, RESULTS = 4, 7, 9, 14


@intrinsic
def begin(typingctx, frame):
    """(whether to compute now, rows, n): False for XLA's metadata query (answered here: the
    API version) and for the stages before execution; the rows and their length n, from the
    shape of the first argument.
    """

    def codegen(context, builder, signature, args):
        word, half = ir.IntType(64), ir.IntType(32)

        def at(address, index, kind=word):  # the address of a struct's word
            index = word(index) if isinstance(index, int) else index
            return builder.gep(builder.inttoptr(address, kind.as_pointer()), [index])

        def field(address, index):
            return builder.load(at(address, index))

        run = cgutils.alloca_once_value(builder, cgutils.false_bit)
        rows, n = (
            cgutils.alloca_once_value(builder, word(0)),
            cgutils.alloca_once_value(builder, word(0)),
        )
        ext = cgutils.alloca_once_value(builder, field(args[0], 1))
        head, body, frame, end = (
            builder.append_basic_block(f"begin.{name}") for name in ("head", "body", "frame", "end")
        )
        builder.branch(head)
        builder.position_at_end(head)  # the extensions: a linked list
        builder.cbranch(builder.icmp_unsigned("!=", builder.load(ext), word(0)), body, frame)
        builder.position_at_end(body)
        current = builder.load(ext)
        kind = builder.and_(field(current, 1), word(0xFFFFFFFF))
        with builder.if_then(builder.icmp_unsigned("==", kind, word(METADATA))):
            md = field(current, 3)
            builder.store(word(24), at(md, 1))  # XLA_FFI_Api_Version's struct_size
            builder.store(word(0), at(md, 2))
            builder.store(half(API_MAJOR), at(md, 6, half))
            builder.store(half(API_MINOR), at(md, 7, half))
            builder.store(half(0), at(md, 8, half))  # traits
            with builder.if_then(builder.icmp_signed(">=", field(md, 0), word(48))):
                builder.store(word(0), at(md, 5))  # XLA_FFI_UNKNOWN_TYPE_ID: no state
            builder.branch(end)
        builder.store(field(current, 2), ext)
        builder.branch(head)
        builder.position_at_end(frame)
        stage = builder.and_(field(args[0], STAGE), word(0xFFFFFFFF))
        with builder.if_then(builder.icmp_unsigned("==", stage, word(EXECUTE))):
            x = field(field(args[0], ARGS), 0)  # its XLA_FFI_Buffer
            ndim, dims = field(x, 4), field(x, 5)
            count = cgutils.alloca_once_value(builder, word(1))
            with cgutils.for_range(builder, ndim) as loop:
                builder.store(builder.mul(builder.load(count), field(dims, loop.index)), count)
            builder.store(word(1), n)
            with builder.if_then(builder.icmp_signed(">", ndim, word(0))):
                builder.store(field(dims, builder.sub(ndim, word(1))), n)
            builder.store(cgutils.true_bit, run)
            builder.store(builder.sdiv(builder.load(count), builder.load(n)), rows)
        builder.branch(end)
        builder.position_at_end(end)
        values = (builder.load(run), builder.load(rows), builder.load(n))
        return context.make_tuple(builder, signature.return_type, values)

    return types.Tuple((types.boolean, types.int64, types.int64))(types.int64), codegen


# The helpers every handler calls, compiled once (and cached) for all of them and called by
# symbol: inlined, they tripled each handler's first compilation (CHANGELOG.md).


@inner_helper
def _pairwise_sum(a, start, count, stack, partial):
    """``a[start:start + count]`` (float64) summed as NumPy's ``sum`` sums a C-contiguous
    float64 array, to the bit: ``0.0 +`` its pairwise sum (``pairwise_sum`` in NumPy's
    ``loops_utils.h.src``: fewer than 8 values one after the other; up to 128 over eight
    accumulators, ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``, then the rest one
    after the other; more split at ``count // 2`` rounded down to a multiple of 8), its
    recursion run on ``stack`` (int64 (128, 2): ``(start, count)`` of a range to sum, or
    ``(0, -1)`` to add the two sums on top of ``partial``, float64 (64,)).
    """
    top, sums = 1, 0
    stack[0, 0], stack[0, 1] = start, count
    while top > 0:
        top -= 1
        s, m = stack[top, 0], stack[top, 1]
        if m < 0:
            sums -= 1
            partial[sums - 1] = partial[sums - 1] + partial[sums]
        elif m < 8:
            res = 0.0
            for i in range(m):
                res += a[s + i]
            partial[sums] = res
            sums += 1
        elif m <= 128:
            r0, r1, r2, r3 = a[s], a[s + 1], a[s + 2], a[s + 3]
            r4, r5, r6, r7 = a[s + 4], a[s + 5], a[s + 6], a[s + 7]
            i = 8
            while i < m - m % 8:
                r0 += a[s + i]
                r1 += a[s + i + 1]
                r2 += a[s + i + 2]
                r3 += a[s + i + 3]
                r4 += a[s + i + 4]
                r5 += a[s + i + 5]
                r6 += a[s + i + 6]
                r7 += a[s + i + 7]
                i += 8
            res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
            for j in range(i, m):
                res += a[s + j]
            partial[sums] = res
            sums += 1
        else:  # the left half, then the right one, then their sum (popped in that order)
            half = m // 2
            half -= half % 8
            stack[top, 0], stack[top, 1] = 0, -1
            stack[top + 1, 0], stack[top + 1, 1] = s + half, m - half
            stack[top + 2, 0], stack[top + 2, 1] = s, half
            top += 3
    return 0.0 + partial[0]


@helper
def alpha_error(frame, alpha) -> int:
    """0 when every row's ``alpha`` (float64) is positive, finite and at least
    :data:`~softorder._engine.checks.SMALLEST_ALPHA`, else the error (:func:`fail`) naming
    the first that is not, with the NumPy API's words. Tested on the bits: XLA's threads
    compare subnormal numbers as zero.
    """
    address = alpha.ctypes.data  # (peeked: a view of alpha's bits compiles slowly)
    for r in range(alpha.shape[0]):
        bits = peek(address, r, np.int64)
        if not (0 < bits < INFINITY_BITS):  # (negative: the sign bit; NaN: above)
            return fail(frame, "softorder: alpha must be positive and finite; got alpha=", alpha[r])
        if bits < SMALLEST_ALPHA_BITS:  # (SMALLEST_ALPHA written as the NumPy API does)
            return fail(
                frame,
                "softorder: alpha must be at least 2.23e-308 ",
                "(1/alpha must be finite); got alpha=",
                alpha[r],
            )
    return 0


@helper
def alpha_sums(alpha_bar, group, summed, out) -> None:
    """``out[g]``: the float64 sum of ``alpha_bar`` (per row) over rows ``g group`` to
    ``(g + 1) group - 1``, as the NumPy API sums a gradient of alpha over the rows it was
    broadcast to (:func:`_pairwise_sum`); a run of one row is ``0.0 +`` its value when
    ``summed`` (NumPy's sum over a broadcast axis of length 1) and its value as it is
    otherwise.
    """
    stack = empty((128, 2), np.int64)
    partial = empty((64,), np.float64)
    for g in range(out.shape[0]):
        if group == 1 and not summed:
            out[g] = alpha_bar[g]
        else:
            out[g] = _pairwise_sum(alpha_bar, g * group, group, stack, partial)


#: The kernels the handlers call by symbol (:class:`~softorder.core._jit.SymbolCalls`): the very
#: compilations of the NumPy API's calls (same argument types: int32 orders), not linked in
KERNELS = {
    "rank_forward": (rank.rank_forward.serial, (_F2, _I2, _F1, _F2, _F2, _F3)),
    "rank_vjp": (rank.rank_vjp.serial, (_F2, _I2, _F1, _F2, _F2, _F2, _F1, _F3)),
    "topk_forward": (
        topk.topk_forward.serial,
        (_F2, _I2, _F1, _F2, _L2, types.boolean, _F3, _L2, _F2, _F3),
    ),
    "topk_vjp": (
        topk.topk_vjp.serial,
        (_F2, _I2, _F1, _L2, _F2, types.boolean, _F3, _F2, _F2, _F1, _F3),
    ),
    "sort_forward": (lapsum.sort_kernel.serial, (_F2, _F1, _F2, _L2, _F2, _F3)),
    "sort_vjp": (sort.sort_vjp.serial, (_F2, _I2, _F1, _L2, _F2, _F2, _F2, _F1, _F3)),
    "quantile_forward": (lapsum.inverse_kernel.serial, (_F2, _F1, _F2, _L2, _F2, _L2, _F2, _F3)),
    "quantile_vjp": (  # (redo_only False: ties' helper linked with the handler, _compile)
        sort.few_inverse_vjp.serial,
        (_F2, _I2, _F1, _L2, _F2, _L2, _F2, _F2, _F2, _F1, _F3, _F3, _B),
    ),
    # (the NumPy API's CPU kernels of the losses: top-k cross-entropy's with its targets
    # 1..K and their order from the caller; the permutation loss's ladder kernels, int32
    # anchors; the rows they leave go to the general kernel through rows_left)
    "topk_loss_forward": (
        topk_loss._loss_forward.serial,
        (_F2, _I2, _F1, _L1, _F2, _B, _F1, _F1, _L2, _F2, _F3, _F1, _L1),
    ),
    "topk_loss_vjp": (
        topk_loss._loss_vjp.serial,
        (_F2, _I2, _F1, _L1, _F2, _B, _F1, _L2, _F2, _F1, _F2, _F1, _F3, _L1, _F3),
    ),
    "permutation_loss_forward": (
        permutation._ladder_forward_rows.serial,
        (_F2, _I2, _F1, _I2, _F1, _I2, _F2, _F3),
    ),
    "permutation_loss_vjp": (  # (redo_only False: rows it leaves go to rows_left)
        permutation._ladder_vjp_rows.serial,
        (_F2, _I2, _F1, _I2, _I2, _F2, _F1, _F2, _F1, _F3, _B),
    ),
}
#: the helper every handler calls by symbol
SHARED = {"alpha_error": (alpha_error, (types.int64, _F1))}
_calls = SymbolCalls(**KERNELS, **SHARED)
_alpha_error = _calls.alpha_error

#: :func:`alpha_sums`, which the handlers call once a traced alpha's gradient asks for it
#: (:func:`link_alpha_sums`): compiled with the handlers, it lengthened every first call, for a
#: gradient that only a learnable alpha has
ALPHA_SUMS = _jit.CallOnDemand(alpha_sums, types.none, float64=(_F1, types.int64, _B, _F1))
_call_alpha_sums = ALPHA_SUMS.call


def link_alpha_sums() -> None:
    """Compile (or load) :func:`alpha_sums` for the handlers (:data:`ALPHA_SUMS`): the JAX
    bridge calls this when it traces a backward pass that asks for a traced alpha's gradient,
    before any handler can run it.

    Examples
    --------
    >>> from softorder.bridges import _jax_ffi
    >>> _jax_ffi.link_alpha_sums()
    >>> _jax_ffi.ALPHA_SUMS.linked("float64")
    True
    """
    ALPHA_SUMS.link("float64")


_rank_forward, _rank_vjp = _calls.rank_forward, _calls.rank_vjp
_topk_forward, _topk_vjp = _calls.topk_forward, _calls.topk_vjp
_sort_forward, _sort_vjp = _calls.sort_forward, _calls.sort_vjp
_quantile_forward, _quantile_vjp = _calls.quantile_forward, _calls.quantile_vjp
_topk_loss_forward, _topk_loss_vjp = _calls.topk_loss_forward, _calls.topk_loss_vjp
_permutation_loss_forward = _calls.permutation_loss_forward
_permutation_loss_vjp = _calls.permutation_loss_vjp


@inner_helper
def _input_rows(frame, rows, n, negate):
    """The input's rows (argument 0, negated on request), ``alpha`` per row (argument 1),
    widened to float64, and 0, or the error to return for an alpha the NumPy API refuses (a
    traced one is known only now; a concrete one was checked when the call was traced).
    """
    values = empty((rows, n), np.float64)
    widen(values, *buffer(frame, ARGS, 0), negate)
    alpha = empty((rows,), np.float64)
    widen(alpha, *buffer(frame, ARGS, 1), False)
    return values, alpha, _alpha_error(frame, alpha)


@inner_helper
def _alpha_sums(frame, alpha_bar, rows, index):
    """A backward pass asked for alpha's gradient (with argument ``index``, after the
    cotangent: int32 ``(group, summed)``): ``alpha_bar`` summed over each run of ``group``
    rows (:func:`alpha_sums`) into result 1, each sum complete in float64 before it is
    rounded once to its dtype (rows whose gradients cancel lose nothing to a rounding).
    Returns 0, or the error to return.
    """
    if peek(frame, ARG_COUNT, np.int64) <= index:
        return 0
    info = buffer(frame, ARGS, index)[0]
    group = np.int64(peek(info, 0, np.int32))
    out = empty((rows // group,), np.float64)
    linked, _ = _call_alpha_sums(alpha_bar, group, peek(info, 1, np.int32) != 0, out)
    if not linked:  # (the bridge links it when it traces the call: never)
        return fail(frame, "softorder: the JAX bridge's alpha_sums is not linked")
    narrow(*buffer(frame, RESULTS, 1), out, False)
    return 0


@inner_helper
def _saved_rows(frame, values, rows, n, width, first, anchor_kind):
    """A backward pass's rows and residuals (arguments ``first`` to ``first + 2``): the
    forward pass's argsort (int32), the input in its sorted order, and each row's ``width``
    anchors (``anchor_kind``) and offsets.
    """
    order = array_at(buffer(frame, ARGS, first)[0], (rows, n), np.int32)
    xs = empty((rows, n), np.float64)
    gather_rows(xs, values, order)
    anchor = array_at(buffer(frame, ARGS, first + 1)[0], (rows, width), anchor_kind)
    offset = array_at(buffer(frame, ARGS, first + 2)[0], (rows, width), np.float64)
    return order, xs, anchor, offset


@inner_helper
def _sorted_rows(frame, values, rows, n):
    """A forward pass's argsort of each row (into result 1, int32) and the rows sorted."""
    order = array_at(buffer(frame, RESULTS, 1)[0], (rows, n), np.int32)
    xs = empty((rows, n), np.float64)
    sort_rows(values, xs, order)
    return order, xs


@inner_helper
def _target_results(frame, rows, width, anchor_kind):
    """A forward pass's results 2 and 3: each row's ``width`` anchors (``anchor_kind``) and
    offsets, which the backward pass reads back (:func:`_saved_rows`).
    """
    anchor = array_at(buffer(frame, RESULTS, 2)[0], (rows, width), anchor_kind)
    offset = array_at(buffer(frame, RESULTS, 3)[0], (rows, width), np.float64)
    return anchor, offset


@inner_helper
def _loss_gradients(frame, rows, n, index):
    """A loss's backward pass: its cotangent per row (argument ``index``, widened) and the
    gradients to fill, of the input (rows, n) and of ``alpha`` per row.
    """
    cot = empty((rows,), np.float64)
    widen(cot, *buffer(frame, ARGS, index), False)
    return cot, empty((rows, n), np.float64), empty((rows,), np.float64)


def rank_handler(frame):
    """Forward: x, alpha, flags -> ranks, order (int32), decays (float64 as uint32 words).
    Backward: x, alpha, flags, order, decays, cotangent -> gradient of x.
    """
    run, rows, n = begin(frame)
    if not run:
        return 0
    negate = peek(buffer(frame, ARGS, 2)[0], 0, np.int32) != 0
    values, alpha, error = _input_rows(frame, rows, n, negate)
    if error:
        return error
    if peek(frame, ARG_COUNT, np.int64) > 3:  # the backward pass: more arguments
        order = array_at(buffer(frame, ARGS, 3)[0], (rows, n), np.int32)
        xs = empty((rows, n), np.float64)
        gather_rows(xs, values, order)
        decay = array_at(buffer(frame, ARGS, 4)[0], (rows, n), np.float64)
        v = empty((rows, n), np.float64)
        widen(v, *buffer(frame, ARGS, 5), False)
        x_bar = empty((rows, n), np.float64)
        alpha_bar = empty((rows,), np.float64)
        work = empty((rows, rank.LINEAR_WORK, n), np.float64)
        _rank_vjp(xs, order, alpha, decay, v, x_bar, alpha_bar, work)
        narrow(*buffer(frame, RESULTS, 0), x_bar, negate)
        return _alpha_sums(frame, alpha_bar, rows, 6)
    order, xs = _sorted_rows(frame, values, rows, n)
    decay = array_at(buffer(frame, RESULTS, 2)[0], (rows, n), np.float64)
    out = empty((rows, n), np.float64)
    work = empty((rows, rank.FORWARD_WORK, n), np.float64)
    _rank_forward(xs, order, alpha, out, decay, work)
    narrow(*buffer(frame, RESULTS, 0), out, False)
    return 0


def topk_handler(frame):
    """Forward: x, alpha, flags, k (one per row) -> memberships, order (int32), anchors and
    offsets (int64 and float64 as uint32 words).
    Backward: x, alpha, flags, order, anchors, offsets, cotangent -> gradient of x.
    """
    run, rows, n = begin(frame)
    if not run:
        return 0
    flags = buffer(frame, ARGS, 2)[0]
    negate, log = peek(flags, 0, np.int32) != 0, peek(flags, 1, np.int32) != 0
    values, alpha, error = _input_rows(frame, rows, n, negate)
    if error:
        return error
    if peek(frame, ARG_COUNT, np.int64) > 4:  # the backward pass: more arguments
        order, xs, anchor, offset = _saved_rows(frame, values, rows, n, 1, 3, np.int64)
        v = empty((rows, 1, n), np.float64)
        widen(v, *buffer(frame, ARGS, 6), False)
        x_bar = empty((rows, n), np.float64)
        w_bar = empty((rows, 1), np.float64)
        alpha_bar = empty((rows,), np.float64)
        work = empty((rows, topk.VJP_WORK, n), np.float64)
        _topk_vjp(xs, order, alpha, anchor, offset, log, v, x_bar, w_bar, alpha_bar, work)
        narrow(*buffer(frame, RESULTS, 0), x_bar, negate)
        return _alpha_sums(frame, alpha_bar, rows, 7)
    order, xs = _sorted_rows(frame, values, rows, n)
    w = empty((rows, 1), np.float64)
    widen(w, *buffer(frame, ARGS, 3), False)
    worder = empty((rows, 1), np.int64)
    for r in range(rows):
        worder[r, 0] = 0
    anchor, offset = _target_results(frame, rows, 1, np.int64)
    out = empty((rows, 1, n), np.float64)
    work = empty((rows, topk.FORWARD_WORK, n), np.float64)
    _topk_forward(xs, order, alpha, w, worder, log, out, anchor, offset, work)
    narrow(*buffer(frame, RESULTS, 0), out, False)
    return 0


def sort_handler(frame):
    """Forward: x, alpha, flags -> sorted values, order (int32), anchors and offsets (int64
    and float64 as uint32 words).
    Backward: x, alpha, flags, order, anchors, offsets, cotangent -> gradient of x.
    Descending is the ascending sort of ``-x``, negated: the input, the result, the cotangent
    and the gradient are negated (exactly), as the NumPy API does.
    """
    run, rows, n = begin(frame)
    if not run:
        return 0
    negate = peek(buffer(frame, ARGS, 2)[0], 0, np.int32) != 0
    values, alpha, error = _input_rows(frame, rows, n, negate)
    if error:
        return error
    if peek(frame, ARG_COUNT, np.int64) > 3:  # the backward pass: more arguments
        order, xs, anchor, offset = _saved_rows(frame, values, rows, n, n, 3, np.int64)
        u = empty((rows, n), np.float64)
        widen(u, *buffer(frame, ARGS, 6), negate)
        alpha_bar = empty((rows,), np.float64)
        work = empty((rows, sort.SORT_VJP_WORK, n), np.float64)
        # the gradient into u itself, as the NumPy API does (each row of u is read before
        # that row of the gradient is written)
        _sort_vjp(xs, order, alpha, anchor, offset, u, u, alpha_bar, work)
        narrow(*buffer(frame, RESULTS, 0), u, negate)
        return _alpha_sums(frame, alpha_bar, rows, 7)
    order, xs = _sorted_rows(frame, values, rows, n)
    anchor, offset = _target_results(frame, rows, n, np.int64)
    out = empty((rows, n), np.float64)
    work = empty((rows, lapsum.SORT_TABLES, n), np.float64)
    _sort_forward(xs, alpha, out, anchor, offset, work)
    if negate:
        # the NumPy API negates the result by multiplying it by -1, which leaves a NaN's
        # sign as it is; narrow flips every sign bit, so a NaN's is flipped once before
        for r in range(rows):
            for i in range(n):
                if out[r, i] != out[r, i]:
                    out[r, i] = -out[r, i]
    narrow(*buffer(frame, RESULTS, 0), out, negate)
    return 0


def quantile_handler(frame):
    """Forward: x, alpha, flags (with ``m``, the targets per row, third), q and the argsort
    of each row's q (int32, both (rows, m)) -> quantiles (rows, m), order (int32), anchors
    and offsets (int64 and float64 as uint32 words).
    Backward: x, alpha, flags, order, anchors, offsets, cotangent -> gradient of x.
    Only few targets per row (:func:`softorder.core.sort.few_targets`), whose gradient the
    NumPy API computes with :func:`~softorder.core.sort.few_inverse_vjp`.
    """
    run, rows, n = begin(frame)
    if not run:
        return 0
    m = np.int64(peek(buffer(frame, ARGS, 2)[0], 2, np.int32))
    values, alpha, error = _input_rows(frame, rows, n, False)
    if error:
        return error
    if peek(frame, ARG_COUNT, np.int64) > 5:  # the backward pass: more arguments
        order, xs, anchor, offset = _saved_rows(frame, values, rows, n, m, 3, np.int64)
        u = empty((rows, m), np.float64)
        widen(u, *buffer(frame, ARGS, 6), False)
        x_bar = empty((rows, n), np.float64)
        w_bar = empty((rows, m), np.float64)  # (q is a constant here: its gradient goes)
        alpha_bar = empty((rows,), np.float64)
        work = empty((rows, sort.FEW_VJP_WORK, n), np.float64)
        no_order = empty((rows, 0), np.int64)  # (the CPU kernel reads no targets' order)
        no_work = empty((rows, 0, m), np.float64)
        args = (xs, order, alpha, anchor, offset, no_order, u, x_bar, w_bar, alpha_bar)
        if _quantile_vjp(*args, work, no_work, False):  # (never: linked by _compile)
            return fail(frame, "softorder: soft_quantile's gradient needs its tie search")
        narrow(*buffer(frame, RESULTS, 0), x_bar, False)
        return _alpha_sums(frame, alpha_bar, rows, 7)
    order, xs = _sorted_rows(frame, values, rows, n)
    w = empty((rows, m), np.float64)
    widen(w, *buffer(frame, ARGS, 3), False)
    w_order = empty((rows, m), np.int64)
    q_order = buffer(frame, ARGS, 4)[0]
    scale = np.float64(n)
    for r in range(rows):
        for j in range(m):
            w[r, j] = w[r, j] * scale  # the targets q n, as the NumPy API scales them
            w_order[r, j] = peek(q_order, r * m + j, np.int32)
    anchor, offset = _target_results(frame, rows, m, np.int64)
    out = empty((rows, m), np.float64)
    work = empty((rows, lapsum.TABLES, n), np.float64)
    _quantile_forward(xs, alpha, w, w_order, out, anchor, offset, work)
    narrow(*buffer(frame, RESULTS, 0), out, False)
    return 0


def topk_loss_handler(frame):
    """Forward: logits, alpha, flags ``(split_top1, K)``, labels (one per row, int32 or
    int64), log P_K (rows, K) and P_K(1) (rows, 1) (float64 as uint32 words) -> losses
    (rows,), order (int32), anchors and offsets (int64 and float64 as uint32 words).
    Backward: the same arguments, order, anchors, offsets, cotangent -> gradient of the logits.
    The kernels see ``-logits``, as the NumPy API gives them. A label outside ``[0, n - 1]``
    (traced: known only now) is an error that names it, as the NumPy API's.
    """
    run, rows, n = begin(frame)
    if not run:
        return 0
    flags = buffer(frame, ARGS, 2)[0]
    split, K = peek(flags, 0, np.int32) != 0, np.int64(peek(flags, 1, np.int32))
    address, code = buffer(frame, ARGS, 3)
    labels = empty((rows,), np.int64)
    for r in range(rows):
        if code == S64:
            label = peek(address, r, np.int64)
        else:
            label = np.int64(peek(address, r, np.int32))
        if label < 0 or label >= n:
            return fail(frame, "softorder: labels must lie in [0, ", n - 1, "]; got ", label)
        labels[r] = label
    values, alpha, error = _input_rows(frame, rows, n, True)
    if error:
        return error
    log_pk = array_at(buffer(frame, ARGS, 4)[0], (rows, K), np.float64)
    pk1 = array_at(buffer(frame, ARGS, 5)[0], (rows,), np.float64)
    worder = empty((K,), np.int64)
    for j in range(K):
        worder[j] = j
    if peek(frame, ARG_COUNT, np.int64) > 6:  # the backward pass: more arguments
        order, xs, anchor, offset = _saved_rows(frame, values, rows, n, K, 6, np.int64)
        cot, x_bar, alpha_bar = _loss_gradients(frame, rows, n, 9)
        work = empty((rows, topk_loss.CPU_GRADIENT_WORK, n), np.float64)
        kwork = empty((rows, 9, K), np.float64)
        loss = (xs, order, alpha, labels, log_pk, split, pk1)
        _topk_loss_vjp(*loss, anchor, offset, cot, x_bar, alpha_bar, work, worder, kwork)
        narrow(*buffer(frame, RESULTS, 0), x_bar, True)
        return _alpha_sums(frame, alpha_bar, rows, 10)
    order, xs = _sorted_rows(frame, values, rows, n)
    w = empty((K,), np.float64)  # the targets 1..K
    for j in range(K):
        w[j] = j + 1.0
    anchor, offset = _target_results(frame, rows, K, np.int64)
    out = empty((rows,), np.float64)
    work = empty((rows, topk_loss.FORWARD_WORK, n), np.float64)
    _topk_loss_forward(
        xs, order, alpha, labels, log_pk, split, pk1, out, anchor, offset, work, w, worder
    )
    narrow(*buffer(frame, RESULTS, 0), out, False)
    return 0


def permutation_loss_handler(frame):
    """Forward: x, alpha, flags ``(negate,)``, target ranks (rows, n; int32 or int64) ->
    losses (rows,), order (int32), anchors (int32) and offsets (float64 as uint32 words), of
    the n - 1 boundaries.
    Backward: the same arguments, order, anchors, offsets, cotangent -> gradient of x.
    The NumPy API's ladder kernels; the rows their VJP leaves (a far tie, boundaries out of
    order) take the general kernel, through Python (:func:`rows_left`). Target ranks outside
    ``[1, n]``, or a row that is not a permutation of them (traced: known only now), are an
    error that names them, as the NumPy API's.
    """
    run, rows, n = begin(frame)
    if not run:
        return 0
    negate = peek(buffer(frame, ARGS, 2)[0], 0, np.int32) != 0
    address, code = buffer(frame, ARGS, 3)
    target = empty((rows, n), np.int32)
    for r in range(rows):
        for i in range(n):
            if code == S64:
                rank = peek(address, r * n + i, np.int64)
            else:
                rank = np.int64(peek(address, r * n + i, np.int32))
            if rank < 1 or rank > n:
                return fail(frame, "softorder: target_ranks must lie in [1, ", n, "]; got ", rank)
            target[r, i] = rank
    values, alpha, error = _input_rows(frame, rows, n, negate)
    if error:
        return error
    m = n - 1
    if peek(frame, ARG_COUNT, np.int64) > 4:  # the backward pass: more arguments
        order, xs, anchor, offset = _saved_rows(frame, values, rows, n, m, 4, np.int32)
        cot, x_bar, alpha_bar = _loss_gradients(frame, rows, n, 7)
        work = empty((rows, permutation.LADDER_VJP_WORK, n), np.float64)
        args = (xs, order, alpha, target, anchor, offset, cot, x_bar, alpha_bar)
        if _permutation_loss_vjp(*args, work, False) and rows_left(*args) != 0:
            return fail(frame, "softorder: permutation_cross_entropy's gradient failed (logged)")
        narrow(*buffer(frame, RESULTS, 0), x_bar, negate)
        return _alpha_sums(frame, alpha_bar, rows, 8)
    order, xs = _sorted_rows(frame, values, rows, n)
    anchor, offset = _target_results(frame, rows, m, np.int32)
    out = empty((rows,), np.float64)
    work = empty((rows, permutation.LADDER_FORWARD_WORK, n), np.float64)
    repeated = _permutation_loss_forward(xs, order, alpha, target, out, anchor, offset, work)
    for r in range(rows):
        # a row whose ranks repeat has a NaN loss (and so has a row with NaN, whose ranks the
        # kernel did not read): the NumPy API's check of such rows, naming the first
        if repeated == 0 and out[r] == out[r]:
            continue
        count = empty((n + 1,), np.int64)
        for v in range(n + 1):
            count[v] = 0
        for i in range(n):
            count[target[r, i]] += 1
        for v in range(1, n + 1):
            if count[v] > 1:
                return fail(
                    frame,
                    "softorder: target_ranks must be a permutation of 1..",
                    n,
                    " along the last axis (each rank once); row ",
                    r,
                    " (of the rows in order, every batch axis flattened) repeats rank ",
                    v,
                )
    narrow(*buffer(frame, RESULTS, 0), out, False)
    return 0


#: one C function per operation: its forward and backward passes (told apart by their
#: number of arguments), so that one compilation serves both
_HANDLERS = {
    "rank": rank_handler,
    "topk": topk_handler,
    "sort": sort_handler,
    "quantile": quantile_handler,
    "topk_loss": topk_loss_handler,
    "permutation_loss": permutation_loss_handler,
}
#: the kernels each handler calls by symbol (:data:`KERNELS`)
_HANDLER_KERNELS = {
    name: tuple(k for k in KERNELS if k.rsplit("_", 1)[0] == name) for name in _HANDLERS
}


def _compile(name: str):
    """The numba C function of handler ``name``, loaded from the disk cache or compiled."""
    for kernel in _HANDLER_KERNELS[name]:
        # linked first: numba runs no ``reload_init`` for a C function loaded from the cache
        _jit.link_symbol(*KERNELS[kernel])
    for shared in SHARED.values():
        _jit.link_symbol(*shared)
    if name == "permutation_loss":
        _link_rows_left()
    if name == "quantile":  # (a handler cannot hand a row back to Python to link it)
        sort.TIE_SEARCH.link("float64")
    fn = _HANDLERS[name]
    handler = CFunc(
        fn,
        ((types.int64,), types.int64),  # XLA_FFI_Error* (NULL: success)(XLA_FFI_CallFrame*)
        locals={},
        options={"nogil": True, "error_model": "numpy", "fastmath": False},
    )
    if cache_dir() is not None:
        handler._cache = cache_classes()["serial"](fn)
    context = handler._targetdescr.target_context
    if not _noted[0] and handler._cache.load_overload(handler._sig, context) is None:
        _noted[0] = True
        _log.warning(
            "softorder: compiling the JAX bridge's XLA FFI handlers on first use (seconds, "
            "once: cached in %s); softorder.precompile(apis=['jax']) compiles them ahead",
            cache_dir(),
        )
    handler.compile()
    return handler


def target(name: str) -> str:
    """The FFI target name of handler ``name`` (``"rank"``, ``"topk"``, ``"sort"`` or
    ``"quantile"``), registered with XLA for the CPU on first use (compiling or loading it).
    """
    full = f"softorder_{name}"
    if full in _registered:
        return full
    with _lock:
        if full not in _registered:
            import jax

            handler = _compile(name)
            pointer = ctypes.cast(handler.address, ctypes.c_void_p).value
            capsule = jax.ffi.pycapsule(ctypes.CFUNCTYPE(ctypes.c_void_p)(pointer))
            jax.ffi.register_ffi_target(full, capsule, platform="cpu", api_version=1)
            _registered[full] = handler  # keeps the compiled code alive
    return full
