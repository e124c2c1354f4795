"""XLA FFI handlers of the JAX bridge: numba ``cfunc`` s that XLA calls in place, on the CPU.

The JAX bridge routes ``soft_rank``, ``soft_sort``, ``soft_topk`` and ``log_soft_topk`` here
when a call is traced for the CPU backend with a concrete ``alpha`` (and ``k``, one per row):
then nothing is left to validate when the computation runs, and a call costs its kernels,
without the Python, the GIL and the host copies of :func:`jax.pure_callback` (at n = 1e2 a
``jit(grad)`` of ``soft_rank`` took 250-300 us through ``pure_callback``, almost all of it
fixed cost; 13 us here).

Each handler is one C function of XLA's typed FFI (``api_version=1``,
``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``, see ``xla/ffi/api/c_api.h`` in
``jax.ffi.include_dir()``), written with numba; it never fails (it returns NULL), since
everything was validated when the call was traced. It sorts the rows itself
(:func:`sort_rows`: XLA's sort took 120 us for one row of 1e3, this one 12 us) and calls the
same serial kernels as the NumPy API on the same float64 rows and int32 orders (the very same
compilations, through their addresses: :func:`_native`), so its results are bitwise
those of the NumPy API when the rows have no ties (with ties, only the order of equal
elements can differ: this sort is stable, NumPy's is not, and a gradient then sums in
another order). The handlers are compiled on first use and cached on disk next to the
kernels (:func:`softorder.core.cache_dir`).

One handler per operation serves its forward and backward passes, told apart by their
number of operands. The operands, with the rows flattened over every leading axis (``vmap``
adds some, ``vmap_method="broadcast_all"``):

* forward: the input rows in the computing dtype (float32 or float64: widened to float64,
  exactly), ``alpha`` once per row in that dtype, int32 flags ``(negate, log)`` and for
  top-k ``k`` once per row; results: the output, the int32 argsort of each row, and the
  float64 or int64 residuals (the rank decays; the targets' anchors and offsets) as
  uint32 words, two per value, so that they survive without ``jax_enable_x64``;
* backward: the same input, ``alpha`` and flags, the argsort and residuals, and the
  cotangent; result: the gradient of the input.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import llvmlite.binding
import numpy as np
from numba import carray, types
from numba.core import cgutils, errors
from numba.core.ccallback import CFunc
from numba.extending import intrinsic

from softorder.core import _jit, lapsum, rank, sort, topk
from softorder.core._jit import _cache_classes, cache_dir, helper

rank_forward_work, rank_linear_work = rank.FORWARD_WORK, rank.LINEAR_WORK
topk_forward_work, topk_gradient_work = topk.FORWARD_WORK, topk.GRADIENT_WORK
sort_forward_work, sort_vjp_work = lapsum.SORT_TABLES, sort.VJP_WORK

#: XLA_FFI_DataType codes of the buffers the handlers read and write
F32, F64 = 11, 12
#: the XLA FFI API version the handlers are written against (xla/ffi/api/c_api.h)
API_MAJOR, API_MINOR = 0, 1
EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
METADATA = 1  # XLA_FFI_Extension_Metadata

_lock = threading.Lock()
_registered: dict = {}
_noted = _jit._noted  # one first-compilation note per process (softorder.precompile's
# progress output replaces it)
_log = logging.getLogger("softorder")


@intrinsic
def address(typingctx, value):
    """An integer address as a ``void*``."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return sig, codegen


@intrinsic
def float_bits(typingctx, value):
    """The bits of a float64 as an int64."""
    sig = types.int64(types.float64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.int64))

    return sig, codegen


_F1, _F2, _F3 = (types.Array(types.float64, d, "C") for d in (1, 2, 3))
_I2, _L2 = types.Array(types.int32, 2, "C"), types.Array(types.int64, 2, "C")
_W1 = types.Array(types.int64, 1, "C")  # the call frame as words

#: The compiled functions the handlers call, by symbol: (module, name, argument types), the
#: types the NumPy API's calls give the kernels (int32 orders), so both share one compilation.
NATIVE = {
    "softorder_ffi_rank_forward": (rank, "rank_forward", (_F2, _I2, _F1, _F2, _F2, _F3)),
    "softorder_ffi_rank_vjp": (rank, "rank_vjp", (_F2, _I2, _F1, _F2, _F2, _F2, _F1, _F3)),
    "softorder_ffi_topk_forward": (
        topk,
        "topk_forward",
        (_F2, _I2, _F1, _F2, _L2, types.boolean, _F3, _L2, _F2, _F3),
    ),
    "softorder_ffi_topk_vjp": (
        topk,
        "topk_vjp",
        (_F2, _I2, _F1, _L2, _F2, types.boolean, _F3, _F2, _F2, _F1, _F3),
    ),
    "softorder_ffi_sort_forward": (lapsum, "sort_kernel", (_F2, _F1, _F2, _L2, _F2, _F3)),
    "softorder_ffi_sort_vjp": (
        sort,
        "sort_vjp",
        (_F2, _I2, _F1, _L2, _F2, _F2, _F2, _F1, _F3),
    ),
    "softorder_ffi_sort_rows": (None, "sort_rows", (_F2, _F2, _I2)),
    # the frame helpers: through symbols too, so the handlers' compile is their own code
    "softorder_ffi_begin": (None, "begin", (types.int64,)),
    "softorder_ffi_flags": (None, "flags", (_W1, types.int64)),
    "softorder_ffi_buffer": (None, "buffer", (_W1, types.int64, types.int64)),
    "softorder_ffi_load": (
        None,
        "load",
        (_W1, types.int64, types.int64, types.int64, types.boolean),
    ),
    "softorder_ffi_store": (None, "store", (_W1, types.int64, _F2, types.boolean)),
    "softorder_ffi_gather_rows": (None, "gather_rows", (_F2, _I2)),
}


def _native(symbol: str):
    """Call the compiled function ``NATIVE[symbol]`` through the symbol that :func:`_link`
    registers, with numba's calling convention: its code is not linked into the handler.

    A handler that calls a kernel as numba usually does links the kernel's code in and LLVM
    optimises and compiles it once more: cold, that tripled the handlers' compile. Through the
    symbol, a handler's compile is its own code, and the kernels are the very compilations the
    NumPy API uses (disk cache included). The result is the compiled function's own (a new
    reference); its status is not checked, since nothing it does can fail on validated input.
    """
    module, name, arg_types = NATIVE[symbol]

    @intrinsic
    def call(typingctx, *args):
        if tuple(types.unliteral(a) for a in args) != arg_types:
            raise errors.TypingError(f"softorder: {symbol} takes {arg_types}; got {args}")
        dispatcher = getattr(module, name).serial if module is not None else globals()[name]
        restype = dispatcher.overloads[arg_types].signature.return_type

        def codegen(context, builder, signature, llargs):
            fnty = context.call_conv.get_function_type(restype, arg_types)
            fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            values = [
                context.cast(builder, v, t, u)
                for v, t, u in zip(
                    cgutils.unpack_tuple(builder, llargs[0], len(arg_types)),
                    signature.args[0].types,
                    arg_types,
                    strict=True,
                )
            ]
            _, result = context.call_conv.call_function(builder, fn, restype, arg_types, values)
            return result if restype != types.none else context.get_dummy_value()

        return restype(types.StarArgTuple.from_types(args)), codegen

    return call


_linked: set = set()


def _link(symbols) -> None:
    """Compile (or load from the disk cache) the functions behind ``symbols`` and register
    their addresses for the handlers' calls; before a handler is compiled or loaded.
    """
    for symbol in symbols:
        if symbol in _linked:
            continue
        module, name, arg_types = NATIVE[symbol]
        dispatcher = getattr(module, name).serial if module is not None else globals()[name]
        dispatcher.compile(arg_types)
        compiled = dispatcher.overloads[arg_types]
        address = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
        if not address:
            raise RuntimeError(f"softorder: no compiled code for {symbol}")
        llvmlite.binding.add_symbol(symbol, address)
        _linked.add(symbol)


@helper
def begin(frame_address):
    """The call frame as int64 words, and whether to compute now: False for XLA's metadata
    query (answered here: the API version) and for the stages before execution.
    """
    frame = carray(address(frame_address), 22, np.int64)
    ext = frame[1]
    while ext != 0:
        base = carray(address(ext), 4, np.int64)
        if (base[1] & 0xFFFFFFFF) == METADATA:
            md64 = carray(address(base[3]), 6, np.int64)
            md32 = carray(address(base[3]), 12, np.int32)
            md64[1] = 24  # XLA_FFI_Api_Version's struct_size
            md64[2] = 0
            md32[6] = API_MAJOR
            md32[7] = API_MINOR
            md32[8] = 0  # traits
            if md64[0] >= 48:
                md64[5] = 0  # XLA_FFI_UNKNOWN_TYPE_ID: no state
            return frame, False
        ext = base[2]
    return frame, (frame[4] & 0xFFFFFFFF) == EXECUTE


@helper
def buffer(frame, slot, i):
    """(dtype, data address, element count, last dimension) of argument or result i
    (``slot`` 9: the arguments, 14: the results).
    """
    b = carray(address(carray(address(frame[slot]), i + 1, np.int64)[i]), 6, np.int64)
    ndim = b[4]
    dims = carray(address(b[5]), ndim, np.int64)
    count = 1
    for d in range(ndim):
        count *= dims[d]
    return b[2] & 0xFFFFFFFF, b[3], count, dims[ndim - 1] if ndim > 0 else 1


@helper
def load(frame, i, rows, cols, negate):
    """Argument i (float32 or float64) as a new float64 (rows, cols) array, negated on
    request.
    """
    dtype, data, _, _ = buffer(frame, 9, i)
    out = np.empty((rows, cols))
    flat = out.reshape(rows * cols)
    if dtype == F32:
        src32 = carray(address(data), rows * cols, np.float32)
        for j in range(rows * cols):
            flat[j] = src32[j]
    else:
        src64 = carray(address(data), rows * cols, np.float64)
        for j in range(rows * cols):
            flat[j] = src64[j]
    if negate:
        for j in range(rows * cols):
            flat[j] = -flat[j]
    return out


@helper
def flags(frame, i):
    """Argument i: the int32 flags ``(negate, log)`` as booleans."""
    words = carray(address(buffer(frame, 9, i)[1]), 2, np.int32)
    return words[0] != 0, words[1] != 0


@helper
def store(frame, i, values, negate):
    """Write the float64 ``values`` (negated on request) into result i (float32 or float64)."""
    dtype, data, count, _ = buffer(frame, 14, i)
    flat = values.reshape(count)
    if negate:
        for j in range(count):
            flat[j] = -flat[j]
    if dtype == F32:
        dst32 = carray(address(data), count, np.float32)
        for j in range(count):
            dst32[j] = flat[j]
    else:
        dst64 = carray(address(data), count, np.float64)
        for j in range(count):
            dst64[j] = flat[j]


@helper
def sort_rows(values, xs, order):
    """Each row of ``values`` sorted into ``xs``, stably, NaN last (all NaN equal) and
    ``-0.0 == 0.0`` (NumPy's order); the argsort into ``order`` (int32).

    An LSD radix sort on the bytes of integer keys: a float's bits as a signed integer, with
    the magnitude bits of negative values flipped. Passes where every key has the same byte
    are skipped (the low bytes of float32 data); rows of at most 32 take an insertion sort.
    At n = 1e3 on fresh data it took a third of numba's merge sort, whose time depended on
    the branch predictor having seen the same data before.
    """
    rows, n = values.shape
    scratch = np.empty((4, n), np.int64)  # one allocation (each kind compiles once more)
    o, keys, keys2, order2 = scratch[0], scratch[1], scratch[2], scratch[3]
    counts = np.empty((8, 256), np.int64)
    for r in range(rows):
        row = values[r]
        for i in range(n):
            v = row[i]
            keys[i] = float_bits(0.0 if v == 0.0 else v)
            o[i] = i
        for i in range(n):
            k = keys[i]
            if row[i] != row[i]:
                keys[i] = 0x7FFFFFFFFFFFFFFF  # above +inf (0x7FF0000000000000)
            elif k < 0:
                keys[i] = k ^ 0x7FFFFFFFFFFFFFFF
        if n <= 32:
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
            src_k, src_o, dst_k, dst_o = keys, o, keys2, order2
            swapped = False
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
                swapped = not swapped
            if swapped:
                for i in range(n):
                    o[i] = order2[i]
        for i in range(n):
            order[r, i] = o[i]
            xs[r, i] = row[o[i]]


@helper
def gather_rows(values, order):
    """The rows sorted by their saved argsort."""
    rows, n = values.shape
    xs = np.empty((rows, n))
    for r in range(rows):
        for j in range(n):
            xs[r, j] = values[r, order[r, j]]
    return xs


_rank_forward = _native("softorder_ffi_rank_forward")
_rank_vjp = _native("softorder_ffi_rank_vjp")
_topk_forward = _native("softorder_ffi_topk_forward")
_topk_vjp = _native("softorder_ffi_topk_vjp")
_sort_forward = _native("softorder_ffi_sort_forward")
_sort_vjp = _native("softorder_ffi_sort_vjp")
_sort_rows = _native("softorder_ffi_sort_rows")
_begin = _native("softorder_ffi_begin")
_flags = _native("softorder_ffi_flags")
_buffer = _native("softorder_ffi_buffer")
_load = _native("softorder_ffi_load")
_store = _native("softorder_ffi_store")
_gather_rows = _native("softorder_ffi_gather_rows")


def rank_handler(frame_address):
    """Forward: x, alpha, flags -> ranks, order (int32), decays (float64 as uint32 words).
    Backward: x, alpha, flags, order, decays, cotangent -> gradient of x.
    """
    frame, run = _begin(frame_address)
    if not run:
        return 0
    negate, _ = _flags(frame, 2)
    _, _, count, n = _buffer(frame, 9, 0)
    rows = count // n
    values = _load(frame, 0, rows, n, negate)
    alpha = _load(frame, 1, rows, 1, False).reshape(rows)
    if frame[7] > 3:  # the backward pass: more arguments
        order = carray(address(_buffer(frame, 9, 3)[1]), (rows, n), np.int32)
        xs = _gather_rows(values, order)
        decay = carray(address(_buffer(frame, 9, 4)[1]), (rows, n), np.float64)
        v = _load(frame, 5, rows, n, False)
        x_bar = np.empty((rows, n))
        alpha_bar = np.empty(rows)
        work = np.empty((rows, rank_linear_work, n))
        _rank_vjp(xs, order, alpha, decay, v, x_bar, alpha_bar, work)
        _store(frame, 0, x_bar, negate)
        return 0
    order = carray(address(_buffer(frame, 14, 1)[1]), (rows, n), np.int32)
    xs = np.empty((rows, n))
    _sort_rows(values, xs, order)
    decay = carray(address(_buffer(frame, 14, 2)[1]), (rows, n), np.float64)
    out = np.empty((rows, n))
    work = np.empty((rows, rank_forward_work, n))
    _rank_forward(xs, order, alpha, out, decay, work)
    _store(frame, 0, out, False)
    return 0


def topk_handler(frame_address):
    """Forward: x, alpha, flags, k (one per row) -> memberships, order (int32), anchors and
    offsets (int64 and float64 as uint32 words).
    Backward: x, alpha, flags, order, anchors, offsets, cotangent -> gradient of x.
    """
    frame, run = _begin(frame_address)
    if not run:
        return 0
    negate, log = _flags(frame, 2)
    _, _, count, n = _buffer(frame, 9, 0)
    rows = count // n
    values = _load(frame, 0, rows, n, negate)
    alpha = _load(frame, 1, rows, 1, False).reshape(rows)
    if frame[7] > 4:  # the backward pass: more arguments
        order = carray(address(_buffer(frame, 9, 3)[1]), (rows, n), np.int32)
        xs = _gather_rows(values, order)
        anchor = carray(address(_buffer(frame, 9, 4)[1]), (rows, 1), np.int64)
        offset = carray(address(_buffer(frame, 9, 5)[1]), (rows, 1), np.float64)
        v = _load(frame, 6, rows, n, False).reshape(rows, 1, n)
        x_bar = np.empty((rows, n))
        w_bar = np.empty((rows, 1))
        alpha_bar = np.empty(rows)
        work = np.empty((rows, topk_gradient_work, n))
        _topk_vjp(xs, order, alpha, anchor, offset, log, v, x_bar, w_bar, alpha_bar, work)
        _store(frame, 0, x_bar, negate)
        return 0
    order = carray(address(_buffer(frame, 14, 1)[1]), (rows, n), np.int32)
    xs = np.empty((rows, n))
    _sort_rows(values, xs, order)
    w = _load(frame, 3, rows, 1, False)
    worder = np.empty((rows, 1), np.int64)
    for r in range(rows):
        worder[r, 0] = 0
    anchor = carray(address(_buffer(frame, 14, 2)[1]), (rows, 1), np.int64)
    offset = carray(address(_buffer(frame, 14, 3)[1]), (rows, 1), np.float64)
    out = np.empty((rows, n))
    work = np.empty((rows, topk_forward_work, n))
    _topk_forward(xs, order, alpha, w, worder, log, out.reshape(rows, 1, n), anchor, offset, work)
    _store(frame, 0, out, False)  # (rows, n) values: one compilation of store
    return 0


def sort_handler(frame_address):
    """Forward: x, alpha, flags -> sorted values, order (int32), anchors and offsets (int64
    and float64 as uint32 words).
    Backward: x, alpha, flags, order, anchors, offsets, cotangent -> gradient of x.
    Descending is the ascending sort of ``-x``, negated: the input, the result, the cotangent
    and the gradient are negated (exactly), as the NumPy API does.
    """
    frame, run = _begin(frame_address)
    if not run:
        return 0
    negate, _ = _flags(frame, 2)
    _, _, count, n = _buffer(frame, 9, 0)
    rows = count // n
    values = _load(frame, 0, rows, n, negate)
    alpha = _load(frame, 1, rows, 1, False).reshape(rows)
    if frame[7] > 3:  # the backward pass: more arguments
        order = carray(address(_buffer(frame, 9, 3)[1]), (rows, n), np.int32)
        xs = _gather_rows(values, order)
        anchor = carray(address(_buffer(frame, 9, 4)[1]), (rows, n), np.int64)
        offset = carray(address(_buffer(frame, 9, 5)[1]), (rows, n), np.float64)
        u = _load(frame, 6, rows, n, negate)
        alpha_bar = np.empty(rows)
        work = np.empty((rows, sort_vjp_work, n))
        # the gradient into u itself, as the NumPy API does (each row of u is read before
        # that row of the gradient is written)
        _sort_vjp(xs, order, alpha, anchor, offset, u, u, alpha_bar, work)
        _store(frame, 0, u, negate)
        return 0
    order = carray(address(_buffer(frame, 14, 1)[1]), (rows, n), np.int32)
    xs = np.empty((rows, n))
    _sort_rows(values, xs, order)
    anchor = carray(address(_buffer(frame, 14, 2)[1]), (rows, n), np.int64)
    offset = carray(address(_buffer(frame, 14, 3)[1]), (rows, n), np.float64)
    out = np.empty((rows, n))
    work = np.empty((rows, sort_forward_work, n))
    _sort_forward(xs, alpha, out, anchor, offset, work)
    _store(frame, 0, out, negate)
    return 0


#: one C function per operation: its forward and backward passes (told apart by their
#: number of arguments), so that one compilation serves both
_HANDLERS = {"rank": rank_handler, "topk": topk_handler, "sort": sort_handler}
#: the compiled functions each handler calls (:func:`_link`)
_FRAME = tuple(f"softorder_ffi_{name}" for name in ("begin", "flags", "buffer", "load", "store"))
_CALLS = {
    "rank": (
        ("softorder_ffi_rank_forward", "softorder_ffi_rank_vjp", "softorder_ffi_sort_rows")
        + _FRAME
        + ("softorder_ffi_gather_rows",)
    ),
    "topk": (
        ("softorder_ffi_topk_forward", "softorder_ffi_topk_vjp", "softorder_ffi_sort_rows")
        + _FRAME
        + ("softorder_ffi_gather_rows",)
    ),
    "sort": (
        ("softorder_ffi_sort_forward", "softorder_ffi_sort_vjp", "softorder_ffi_sort_rows")
        + _FRAME
        + ("softorder_ffi_gather_rows",)
    ),
}


def _compile(name: str):
    """The numba C function of handler ``name``, loaded from the disk cache or compiled."""
    _link(_CALLS[name])
    fn = _HANDLERS[name]
    handler = CFunc(
        fn,
        ((types.int64,), types.int64),  # XLA_FFI_Error* (NULL: success)(XLA_FFI_CallFrame*)
        locals={},
        options={"nogil": True, "error_model": "numpy", "fastmath": False},
    )
    if cache_dir() is not None:
        handler._cache = _cache_classes()["serial"](fn)
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
    """The FFI target name of handler ``name`` (``"rank"``, ``"topk"`` or ``"sort"``),
    registered with XLA for the CPU on first use (compiling or loading the handler).
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
