"""XLA FFI handlers of the JAX bridge: numba ``cfunc`` s that XLA calls in place, on the CPU.

The JAX bridge routes ``soft_rank``, ``soft_topk`` and ``log_soft_topk`` here when a call is
traced for the CPU backend with a concrete ``alpha`` (and ``k``), one target per row: then
nothing is left to validate when the computation runs, and a call costs XLA's own sort of the
rows plus the kernels, without the Python, the GIL and the host copies of
:func:`jax.pure_callback` (at n = 1e2 a ``jit(grad)`` of ``soft_rank`` took 300 us through
``pure_callback``, most of it fixed cost).

Each handler is one C function of XLA's typed FFI (``api_version=1``,
``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``, see ``xla/ffi/api/c_api.h`` in
``jax.ffi.include_dir()``), written with numba and calling the same serial kernels as the
NumPy API on the same float64 rows, so its results are bitwise those of the NumPy API when
the rows have no ties (with ties, only the order of equal elements can differ: XLA's sort is
stable, NumPy's is not, and a gradient then sums in another order). The handlers are
compiled on first use and cached on disk next to the kernels (:func:`softorder.core.cache_dir`).

The operands, all with the rows flattened over every leading axis (``vmap`` adds some):

* ``xs``: the rows sorted ascending (NaN last), in the computing dtype (float32 or float64:
  the kernels get them widened to float64, exactly);
* ``order``: int32, the argsort of each row;
* ``alpha``: one value per row, in the computing dtype;
* float64 residuals (the rank decays, the top-k targets' anchors and offsets) pass between
  the forward and backward handlers as uint32 words, two per value, so that they survive
  without ``jax_enable_x64``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import numba
import numpy as np
from numba import carray, types
from numba.core.ccallback import CFunc
from numba.extending import intrinsic

from softorder.core import rank, topk
from softorder.core._jit import _cache_classes, cache_dir

rank_forward, rank_vjp = rank.rank_forward.serial, rank.rank_vjp.serial
topk_forward, topk_vjp = topk.topk_forward.serial, topk.topk_vjp.serial
rank_forward_work, rank_linear_work = rank.FORWARD_WORK, rank.LINEAR_WORK
topk_forward_work, topk_gradient_work = topk.FORWARD_WORK, topk.GRADIENT_WORK


#: XLA_FFI_DataType codes of the buffers the handlers read and write
F32, F64 = 11, 12
#: the XLA FFI API version the handlers are written against (xla/ffi/api/c_api.h)
API_MAJOR, API_MINOR = 0, 1
EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
METADATA = 1  # XLA_FFI_Extension_Metadata

_lock = threading.Lock()
_registered: dict = {}
_noted = [False]  # the first-compilation note was logged
_log = logging.getLogger("softorder")


njit = functools.partial(numba.njit, nogil=True, error_model="numpy", fastmath=False)


@intrinsic
def address(typingctx, value):
    """An integer address as a ``void*``."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return sig, codegen


@njit
def words(p, count):
    """``count`` int64 words at address ``p``."""
    return carray(address(p), count, np.int64)


@njit
def metadata(frame):
    """Answer XLA's metadata query (the API version) if this call is one; True if so."""
    ext = frame[1]
    while ext != 0:
        base = words(ext, 4)
        if (base[1] & 0xFFFFFFFF) == METADATA:
            md = base[3]
            size = words(md, 1)[0]
            md64 = words(md, 6)
            md32 = carray(address(md), 12, np.int32)
            md64[1] = 24  # XLA_FFI_Api_Version's struct_size
            md64[2] = 0
            md32[6] = API_MAJOR
            md32[7] = API_MINOR
            md32[8] = 0  # traits
            if size >= 48:
                md64[5] = 0  # XLA_FFI_UNKNOWN_TYPE_ID: no state
            return True
        ext = base[2]
    return False


@njit
def buffer(frame, slot, i):
    """(dtype, data address, element count, last dimension) of argument or result i
    (``slot`` 9: the arguments, 14: the results).
    """
    b = words(words(frame[slot], i + 1)[i], 6)
    rank_ = b[4]
    dims = words(b[5], rank_) if rank_ > 0 else words(b[5], 0)
    count = 1
    for d in range(rank_):
        count *= dims[d]
    last = dims[rank_ - 1] if rank_ > 0 else 1
    return b[2] & 0xFFFFFFFF, b[3], count, last


@njit
def load(frame, i, rows, cols):
    """Argument i (float32 or float64) as a new float64 (rows, cols) array."""
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
    return out


@njit
def load_order(frame, i, rows, cols):
    """Argument i (int32) as a new int64 (rows, cols) array."""
    _, data, _, _ = buffer(frame, 9, i)
    src = carray(address(data), rows * cols, np.int32)
    out = np.empty((rows, cols), np.int64)
    flat = out.reshape(rows * cols)
    for j in range(rows * cols):
        flat[j] = src[j]
    return out


@njit
def f64_words(frame, slot, i, rows, cols):
    """Argument or result i (uint32 words) viewed as a float64 (rows, cols) array."""
    _, data, _, _ = buffer(frame, slot, i)
    return carray(address(data), (rows, cols), np.float64)


@njit
def i64_words(frame, slot, i, rows, cols):
    """Argument or result i (uint32 words) viewed as an int64 (rows, cols) array."""
    _, data, _, _ = buffer(frame, slot, i)
    return carray(address(data), (rows, cols), np.int64)


@njit
def store(frame, i, values):
    """Write the float64 ``values`` into result i (float32 or float64)."""
    dtype, data, count, _ = buffer(frame, 14, i)
    flat = values.reshape(count)
    if dtype == F32:
        dst32 = carray(address(data), count, np.float32)
        for j in range(count):
            dst32[j] = flat[j]
    else:
        dst64 = carray(address(data), count, np.float64)
        for j in range(count):
            dst64[j] = flat[j]


@njit
def shape(frame):
    """(rows, n) of the sorted rows, argument 0."""
    _, _, count, n = buffer(frame, 9, 0)
    return (count // n if n else 0), n


@njit
def is_execution(frame):
    """False for XLA's metadata query (answered) and for the stages before execution."""
    return not metadata(frame) and (frame[4] & 0xFFFFFFFF) == EXECUTE


@njit
def negated(values, negate):
    if negate:
        for r in range(values.shape[0]):
            for i in range(values.shape[1]):
                values[r, i] = -values[r, i]
    return values


@njit
def rows_of(frame, negate):
    """The input (argument 0) as float64 rows, negated on request: ``(rows2d, n)``."""
    rows, n = shape(frame)
    return negated(load(frame, 0, rows, n), negate)


@njit
def sort_keys(row, keys):
    """Integer keys in the order of the float64 ``row``, NaN last (all NaN equal) and
    ``-0.0 == 0.0`` as NumPy compares them: the float's bits, as a signed integer, with the
    magnitude bits of negative values flipped.
    """
    bits = keys.view(np.float64)
    for i in range(row.shape[0]):
        v = row[i]
        if v != v:
            v = np.inf  # then moved past +inf below
        elif v == 0.0:
            v = 0.0
        bits[i] = v
    for i in range(row.shape[0]):
        k = keys[i]
        keys[i] = k ^ 0x7FFFFFFFFFFFFFFF if k < 0 else k
    for i in range(row.shape[0]):
        if row[i] != row[i]:
            keys[i] = 0x7FFFFFFFFFFFFFFF  # above +inf (0x7FF0000000000000)


@njit
def argsort_row(row, order, keys, keys2, order2, counts):
    """Stable argsort of one float64 row into ``order`` (NaN last), by an LSD radix sort on
    bytes of :func:`sort_keys` (passes where every key has the same byte are skipped: the
    low bytes of float32 data), insertion sort for short rows. About 3x faster than numba's
    merge sort at n = 1e3 on fresh data, and its time does not depend on branch prediction.
    """
    n = row.shape[0]
    sort_keys(row, keys)
    for i in range(n):
        order[i] = i
    if n <= 32:
        for i in range(1, n):
            k, o = keys[i], order[i]
            j = i - 1
            while j >= 0 and keys[j] > k:
                keys[j + 1] = keys[j]
                order[j + 1] = order[j]
                j -= 1
            keys[j + 1] = k
            order[j + 1] = o
        return
    counts[:, :] = 0
    for i in range(n):
        k = keys[i]
        for b in range(7):
            counts[b, (k >> (8 * b)) & 0xFF] += 1
        counts[7, ((k >> 56) & 0xFF) ^ 0x80] += 1
    src_k, src_o, dst_k, dst_o = keys, order, keys2, order2
    swapped = False
    for b in range(8):
        shift = 8 * b
        flip = 0x80 if b == 7 else 0
        if counts[b, ((src_k[0] >> shift) & 0xFF) ^ flip] == n:
            continue  # one value of this byte: the pass would not move anything
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
            order[i] = order2[i]


@njit
def sort_rows(values, order_out):
    """Sort each row (NaN last, stable), writing its argsort also into ``order_out`` (int32)."""
    rows, n = values.shape
    xs = np.empty((rows, n))
    order = np.empty((rows, n), np.int64)
    keys = np.empty(n, np.int64)
    keys2 = np.empty(n, np.int64)
    order2 = np.empty(n, np.int64)
    counts = np.empty((8, 256), np.int64)
    for r in range(rows):
        o = order[r]
        argsort_row(values[r], o, keys, keys2, order2, counts)
        for i in range(n):
            order_out[r, i] = o[i]
            xs[r, i] = values[r, o[i]]
    return xs, order


@njit
def gather_rows(values, frame, i):
    """The rows sorted by their saved argsort (argument i, int32)."""
    rows, n = values.shape
    order = load_order(frame, i, rows, n)
    xs = np.empty((rows, n))
    for r in range(rows):
        for j in range(n):
            xs[r, j] = values[r, order[r, j]]
    return xs, order


@njit
def flags(frame):
    """(negate, log) from argument 2."""
    f = load_order(frame, 2, 1, 2)
    return f[0, 0] != 0, f[0, 1] != 0


def rank_fwd(frame_address):
    """x, alpha, flags -> ranks, order (int32), decays (float64 as uint32 words)."""
    frame = words(frame_address, 22)
    if not is_execution(frame):
        return 0
    negate, _ = flags(frame)
    values = rows_of(frame, negate)
    rows, n = values.shape
    xs, order = sort_rows(values, carray(address(buffer(frame, 14, 1)[1]), (rows, n), np.int32))
    alpha = load(frame, 1, rows, 1).reshape(rows)
    out = np.empty((rows, n))
    decay = f64_words(frame, 14, 2, rows, n)
    work = np.empty((rows, rank_forward_work, max(n, 1)))
    rank_forward(xs, order, alpha, out, decay, work)
    store(frame, 0, out)
    return 0


def rank_bwd(frame_address):
    """x, alpha, flags, order, decays, cotangent -> gradient of x."""
    frame = words(frame_address, 22)
    if not is_execution(frame):
        return 0
    negate, _ = flags(frame)
    values = rows_of(frame, negate)
    rows, n = values.shape
    xs, order = gather_rows(values, frame, 3)
    alpha = load(frame, 1, rows, 1).reshape(rows)
    decay = f64_words(frame, 9, 4, rows, n)
    v = load(frame, 5, rows, n)
    x_bar = np.empty((rows, n))
    alpha_bar = np.empty(rows)
    work = np.empty((rows, rank_linear_work, max(n, 1)))
    rank_vjp(xs, order, alpha, decay, v, x_bar, alpha_bar, work)
    store(frame, 0, negated(x_bar, negate))
    return 0


def topk_fwd(frame_address):
    """x, alpha, flags, k (one per row) -> memberships, order (int32), anchors, offsets."""
    frame = words(frame_address, 22)
    if not is_execution(frame):
        return 0
    negate, log = flags(frame)
    values = rows_of(frame, negate)
    rows, n = values.shape
    xs, order = sort_rows(values, carray(address(buffer(frame, 14, 1)[1]), (rows, n), np.int32))
    alpha = load(frame, 1, rows, 1).reshape(rows)
    w = load(frame, 3, rows, 1)
    worder = np.zeros((rows, 1), np.int64)
    out = np.empty((rows, 1, n))
    anchor = i64_words(frame, 14, 2, rows, 1)
    offset = f64_words(frame, 14, 3, rows, 1)
    work = np.empty((rows, topk_forward_work, max(n, 1)))
    topk_forward(xs, order, alpha, w, worder, log, out, anchor, offset, work)
    store(frame, 0, out)
    return 0


def topk_bwd(frame_address):
    """x, alpha, flags, order, anchors, offsets, cotangent -> gradient of x."""
    frame = words(frame_address, 22)
    if not is_execution(frame):
        return 0
    negate, log = flags(frame)
    values = rows_of(frame, negate)
    rows, n = values.shape
    xs, order = gather_rows(values, frame, 3)
    alpha = load(frame, 1, rows, 1).reshape(rows)
    anchor = i64_words(frame, 9, 4, rows, 1)
    offset = f64_words(frame, 9, 5, rows, 1)
    v = load(frame, 6, rows, n).reshape(rows, 1, n)
    x_bar = np.empty((rows, n))
    w_bar = np.empty((rows, 1))
    alpha_bar = np.empty(rows)
    work = np.empty((rows, topk_gradient_work, max(n, 1)))
    topk_vjp(xs, order, alpha, anchor, offset, log, v, x_bar, w_bar, alpha_bar, work)
    store(frame, 0, negated(x_bar, negate))
    return 0


_HANDLERS = {
    "rank_fwd": rank_fwd,
    "rank_bwd": rank_bwd,
    "topk_fwd": topk_fwd,
    "topk_bwd": topk_bwd,
}


def _compile(name: str):
    """The numba C function of handler ``name``, loaded from the disk cache or compiled."""
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
    """The FFI target name of handler ``name`` (``"rank_fwd"``, ...), registered with XLA
    for the CPU on first use (compiling or loading the handler).
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
