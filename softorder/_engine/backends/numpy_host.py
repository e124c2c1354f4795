"""Host arrays and the CPU kernels of :mod:`softorder.core`: the backend of the NumPy API, of
the JAX bridge on the CPU and of CPU tensors, and the host helpers every backend shares (the
dtype policy of :func:`float_array`, :func:`cast`, :func:`unbroadcast`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from softorder import core
from softorder.core import _jit
from softorder.core._jit import load_cached


def host_array(x, name: str) -> np.ndarray:
    """``np.asarray(x)``, or a ``ValueError`` naming the argument ``name`` for a ragged nested
    sequence (NumPy's words name no argument).

    Examples
    --------
    >>> host_array([[1, 2], [3]], "k")
    Traceback (most recent call last):
    ...
    ValueError: k must be a rectangular array of numbers: setting an array element with a ...
    """
    try:
        return np.asarray(x)
    except ValueError as error:
        raise ValueError(f"{name} must be a rectangular array of numbers: {error}") from None


def float_array(x, name: str) -> tuple[np.ndarray, np.dtype]:
    """``x`` as a real array and the floating dtype results are returned in.

    Integers and booleans give float64, float16 gives float16 (computed in float64).
    Complex, object and string arrays raise ``TypeError`` naming the argument.
    """
    arr = x if type(x) is np.ndarray else host_array(x, name)
    kind = arr.dtype.kind
    if kind == "f":  # the common case first
        return arr, arr.dtype
    if kind == "c":
        raise TypeError(f"{name} must be real; got a complex array of dtype {arr.dtype}")
    if kind not in "biuf":
        raise TypeError(f"{name} must be a numeric array; got dtype {arr.dtype}")
    out_dtype = arr.dtype if kind == "f" else np.dtype(np.float64)
    return arr, out_dtype


_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)
_F32_MAX = float(np.finfo(np.float32).max)
_I32 = np.dtype(np.int32)
#: From this many elements the host sorts by packed keys (:meth:`NumpyBackend.sort_rows`);
#: below it, the packed sort's three calls cost more than NumPy's argsort saves
PACKED_SORT_SIZE = 384


#: CPU seconds that compiling the packed sort takes (:func:`~softorder.core.rows.pack_sort_keys`
#: and :func:`~softorder.core.rows.unpack_sorted`, serial, with numba already started)
PACKED_COMPILE_SECONDS = 0.95


def argsort_loss(size: int, n: int) -> float:
    """Seconds that sorting ``size`` elements in rows of ``n`` by NumPy's argsort and
    :func:`~softorder.core.rows.take_rows` takes beyond the packed sort, on one thread: a fit
    of measured differences, per element about 20 ns in one row of 1e3, 50 in batches of
    rows of 1e3, 75 at n = 1e4, 120 at 1e5, 160 at 1e6 (within 1.5 times of each; batches
    of short rows lose more per element than one row, which stays in the fastest caches).
    """
    return size * (12.0 * math.log2(n) - (90.0 if size == n else 70.0)) * 1e-9


class PackedSort:
    """When :meth:`NumpyBackend.sort_rows` sorts rows of :data:`PACKED_SORT_SIZE` elements or
    more by packed keys, which is several times faster than NumPy's argsort but compiles two
    kernels (about a second) on its first use.

    Mode ``"auto"`` (the default) sorts by packed keys when their kernels are compiled in this
    process or can be loaded from numba's disk cache without compiling (looked up once), and
    otherwise by argsort, adding up the time that costs (:func:`argsort_loss`): once it
    reaches the time the kernels take to compile (:data:`PACKED_COMPILE_SECONDS`) it
    compiles them and sorts by packed keys from then on. A process that sorts little never
    pays for the compilation; one that sorts much loses at most about that much before it
    does. ``"packed"`` always sorts by packed keys (compiling them on first use),
    ``"argsort"`` never does (both give the same values and orders, bit for bit).
    :func:`softorder.precompile` compiles the kernels. Calls from several threads at once
    are safe: numba compiles or loads each kernel once, under its lock; a lost addition to
    the count only delays the switch.
    """

    MODES = ("auto", "packed", "argsort")

    def __init__(self):
        self.mode = "auto"
        self.reset()

    def reset(self) -> None:
        """Forget the time counted and whether the disk cache was looked at (tests)."""
        #: seconds the argsort path has lost so far (an estimate, :func:`argsort_loss`)
        self.lost = 0.0
        self._ready = False
        self._looked = False

    def set_mode(self, mode: str) -> str:
        """Set the mode (see the class), reset the count; returns the previous mode."""
        if mode not in self.MODES:
            raise ValueError(f"softorder: the packed sort's mode must be one of {self.MODES}")
        previous, self.mode = self.mode, mode
        self.reset()
        return previous

    def use(self, size: int, n: int) -> bool:
        """Whether to sort ``size`` elements in rows of ``n`` by packed keys now; counts the
        loss of the argsort when not.
        """
        if self._ready:
            return True
        if self.mode != "auto":
            if self.mode == "argsort":
                return False
            self.compile()
            return True
        if self._available():
            self._ready = True
            return True
        self.lost += argsort_loss(size, n)
        if self.lost < PACKED_COMPILE_SECONDS:
            return False
        self.compile()
        return True

    def _available(self) -> bool:
        """Whether the kernels are compiled in this process or, on the first look only, can
        be loaded from the disk cache.
        """
        kernels = _packed_kernels()
        for k, sig in kernels:
            # (an empty dict first: hashing the signature costs a microsecond)
            overloads = k.overloads
            if not overloads or sig not in overloads:
                break
        else:
            return True
        if self._looked:
            return False
        self._looked = True
        return all([load_cached(k, sig) for k, sig in kernels])  # (a list: load each)

    def compile(self) -> None:
        """Compile (or load) the kernels of the packed sort, for rows shorter than 2**31, and
        sort by them from now on in mode ``"auto"``.
        """
        for k, sig in _packed_kernels():
            k.compile(sig)
        self._ready = self.mode != "argsort"


@functools.cache
def _packed_kernels() -> tuple:
    """``(dispatcher, argument types)`` of the serial kernels of the packed sort, as
    :meth:`NumpyBackend.sort_rows` calls them for rows shorter than 2**31.
    """
    from numba import typeof

    keys, flags = typeof(np.empty((1, 1), np.int64)), typeof(np.empty(1, np.uint8))
    order, low = typeof(np.empty((1, 1), _I32)), typeof(1)
    kernels = (
        (core.pack_sort_keys.serial, (keys, low, keys, flags)),
        (core.unpack_sorted.serial, (keys, low, keys, order, flags, flags)),
    )
    return tuple((k if hasattr(k, "overloads") else _Interpreted(sig), sig) for k, sig in kernels)


class _Interpreted:
    """A kernel under NUMBA_DISABLE_JIT (its Python function): compiled, as far as
    :class:`PackedSort` is concerned.
    """

    def __init__(self, sig):
        self.overloads = {sig: None}

    def compile(self, sig):
        pass


#: The policy of every host sort in this process.
PACKED = PackedSort()


def index_dtype(n: int) -> np.dtype:
    """The dtype of the host's sort orders of rows of ``n``: int32 when every index fits."""
    return np.dtype(np.int32) if n < 2**31 else np.dtype(np.int64)


def cast(value, dtype) -> np.ndarray:
    """``value`` as a C-ordered array of ``dtype``; values beyond a narrow dtype's range become
    +-inf there (as the true result would), without a warning.
    """
    if type(value) is np.ndarray and value.dtype == dtype:
        if value.flags.c_contiguous:
            return value  # what np.asarray returns, without entering errstate
        return np.asarray(value, order="C")  # a copy, not a cast: no error state to set
    with np.errstate(over="ignore"):
        return np.asarray(value, dtype=dtype, order="C")


def unbroadcast(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``grad`` over the axes that broadcasting added to an argument of ``shape``."""
    if grad.shape == shape:  # nothing was broadcast (tuple equality: cheap)
        return grad
    extra = grad.ndim - len(shape)
    # One sum over every axis broadcast added (the leading ones and the length-1 ones): NumPy
    # then sums a contiguous run of values pairwise, as the JAX bridge's FFI handlers sum a
    # traced alpha's run of rows; two sums (the leading axes first) would round otherwise.
    axes = tuple(range(extra)) + tuple(
        extra + i for i, s in enumerate(shape) if s == 1 and grad.shape[extra + i] != 1
    )
    # Rows whose gradients overflow float64 with opposite signs sum to NaN, the honest answer
    # (documented in docs/gotchas.rst); NumPy's "invalid value" warning would only obscure it.
    with np.errstate(invalid="ignore"):
        return grad.sum(axis=axes, keepdims=True).reshape(shape) if axes else grad


def sum_over_rows(per_row: np.ndarray, batched: bool):
    """The sum of one argument's per-row gradients (``(rows,)`` or ``(rows, 1)``, C-ordered)
    over every row, with :func:`unbroadcast`'s bits and without its reshapes: NumPy's sum of
    the array (which runs over its flat data, as over the batch axes), ``inf - inf`` giving NaN
    without a warning. One row is ``0.0 +`` its value when it was summed over batch axes
    (``-0.0`` becomes ``0.0``), its value as it is when there were none.

    >>> sum_over_rows(np.array([1.0, 2.0, 3.0]), True)
    np.float64(6.0)
    >>> sum_over_rows(np.array([[-0.0]]), True), sum_over_rows(np.array([-0.0]), False)
    (np.float64(0.0), np.float64(-0.0))
    """
    if per_row.shape[0] == 1:
        value = per_row[(0,) * per_row.ndim]
        return value + 0.0 if batched else value
    with np.errstate(invalid="ignore"):
        return per_row.sum()


#: each kernel's serial dispatcher, by the kernel (:func:`serial_kernel`)
_SERIAL: dict = {}


def serial_kernel(kernel):
    """The dispatcher that ``kernel`` (one of :mod:`softorder.core`'s) calls for an input too
    small for its parallel variant: its ``serial`` attribute when that takes the same arguments
    (a kernel of :func:`softorder.core._jit.kernel`), else ``kernel`` itself (a Python
    function that picks among kernels, a test's stand-in). The wrapper's choice costs a small
    call about 1.5 us per kernel, a tenth of its dispatch.
    """
    serial = _SERIAL.get(kernel)
    if serial is None:
        serial = _serial_dispatcher(kernel)
        if len(_SERIAL) >= 256:
            _SERIAL.clear()
        _SERIAL[kernel] = serial
    return serial


def _serial_dispatcher(kernel):
    serial = getattr(kernel, "serial", None)
    wrapped = getattr(kernel, "__wrapped__", None)
    if (
        serial is None
        or wrapped is None
        or getattr(serial, "py_func", None) is not wrapped  # another function's dispatcher
    ):
        return kernel
    return serial


def runs_serially(shape) -> bool:
    """Whether :func:`softorder.core._jit.kernel` runs a kernel whose first argument has
    ``shape`` (rows, ...) on the calling thread whatever its parallel policy: fewer rows or
    elements than its thresholds.
    """
    rows = shape[0]
    if rows < _jit.MIN_PARALLEL_ROWS:
        return True
    size = rows
    for d in shape[1:]:
        size *= d
    return size < _jit.MIN_PARALLEL_ELEMENTS


#: the axes' orders of recent moves, by (ndim, source, destination) (NumpyBackend.moveaxis)
_MOVES: dict = {}
_MAX_MOVES = 256


class NumpyBackend:
    """Host arrays and the CPU kernels: the NumPy API, the JAX bridge and CPU tensors."""

    kernels = core

    def float_input(self, x, name: str):
        """``x`` as a real array of this backend and the dtype results are returned in."""
        if type(x) is np.ndarray and x.dtype.kind == "f":  # float_array's first case, inline
            return x, x.dtype
        return float_array(x, name)

    def moveaxis(self, a, source, destination):
        """``np.moveaxis(a, source, destination)``: the same view, by ``a.transpose`` of the
        axes' order, which np.moveaxis computes in Python (once per key, not per call).
        """
        if type(a) is not np.ndarray or not (
            (type(source) is int or type(source) is list)
            and (type(destination) is int or type(destination) is list)
        ):
            return np.moveaxis(a, source, destination)
        key = (
            a.ndim,
            source if type(source) is int else tuple(source),
            destination if type(destination) is int else tuple(destination),
        )
        order = _MOVES.get(key)
        if order is None:
            # (the shape of an empty array whose axis i has length i, moved: the order)
            order = np.moveaxis(np.empty(tuple(range(a.ndim))), source, destination).shape
            if len(_MOVES) >= _MAX_MOVES:
                _MOVES.clear()
            _MOVES[key] = order
        return a.transpose(order)

    def contiguous_f64(self, a, negate: bool = False):
        """An array or view (any shape) as a C-contiguous float64 array, negated on request;
        the rules never write it (no copy when it already is one).
        """
        if negate:
            if type(a) is np.ndarray and a.dtype is _F64 and a.flags.c_contiguous:
                # the same new C-ordered array (its output follows the input's order), without
                # the keywords' parsing: half of the call at n = 1e2
                return np.negative(a)
            return np.negative(a, dtype=np.float64, order="C")  # a new C-ordered array
        if type(a) is np.ndarray and a.dtype is _F64 and a.flags.c_contiguous:
            return a  # what np.ascontiguousarray returns, without its cost
        return np.ascontiguousarray(a, dtype=np.float64)

    def sort_rows(self, rows2d, order=None):
        """``(xs, order)``: each C-contiguous float64 row sorted ascending (NaN last) and its
        stable argsort (``np.argsort(kind="stable")``'s order); with ``order`` (a saved
        argsort) only the gather. The argsort is int32 for rows shorter than 2**31
        (:func:`index_dtype`), so every kernel compiles for one index dtype. Inputs of
        :data:`PACKED_SORT_SIZE` elements or more sort by packed keys when :data:`PACKED`
        says so (:class:`PackedSort`), by NumPy's argsort otherwise: the same result.
        """
        n = rows2d.shape[1]
        index = _I32 if n < 2**31 else index_dtype(n)
        xs = np.empty(rows2d.shape)
        if (
            order is not None
            or rows2d.size < PACKED_SORT_SIZE
            or (index is _I32 and not PACKED.use(rows2d.size, n))
        ):
            if order is None:
                order = rows2d.argsort(axis=1, kind="stable").astype(index, copy=False)
            else:
                order = np.ascontiguousarray(order, dtype=index).reshape(rows2d.shape)
            take = core.take_rows
            if runs_serially(rows2d.shape):
                take = serial_kernel(take)  # what the kernel's wrapper would choose
            take(rows2d, order, xs)  # faster than np.take_along_axis (CHANGELOG)
            return xs, order
        # one sort of 8-byte keys that carry each value's index (softorder.core.rows), in
        # the memory of xs: NumPy's argsort moves (value, index) pairs and is slower
        if not rows2d.flags.writeable:  # numba would compile the kernels again for it
            rows2d = rows2d.copy()
        low = (1 << max(rows2d.shape[1] - 1, 0).bit_length()) - 1  # the index bits
        bits, keys = rows2d.view(np.int64), xs.view(np.int64)
        exact = np.empty(rows2d.shape[0], np.uint8)
        core.pack_sort_keys(bits, low, keys, exact)
        keys.sort(axis=1)
        order = np.empty(rows2d.shape, index)
        redo = np.empty(rows2d.shape[0], np.uint8)
        if core.unpack_sorted(bits, low, keys, order, redo, exact):
            core.sort_rows_again(rows2d, xs, order, redo)  # values alike but in their low bits
        return xs, order

    def contiguous(self, a):
        return np.ascontiguousarray(a)

    def empty(self, shape, dtype=np.float64):
        return np.empty(shape, dtype)

    def zeros(self, shape):
        return np.zeros(shape)

    def full(self, shape, value: float):
        return np.full(shape, value, dtype=np.float64)

    def from_host(self, arr: np.ndarray):
        """A host array (validated arguments, targets) as this backend's array."""
        return np.asarray(arr, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)

    def tile_rows(self, row: np.ndarray, rows: int):
        """``rows`` copies of the host vector ``row`` as a (rows, len(row)) array."""
        return np.broadcast_to(row, (rows, row.shape[0])).copy()

    def broadcast_f64(self, a, shape):
        """``a`` broadcast to ``shape`` as a new C-contiguous float64 array."""
        return np.ascontiguousarray(np.broadcast_to(a, shape), dtype=np.float64)

    def cast(self, a, dtype):
        return cast(a, dtype)

    def to_result(self, value, dtype):
        """``value`` as a result of ``dtype``: a 0-d value becomes a scalar (NumPy's
        convention; device backends keep a 0-d device array).
        """
        if type(value) is np.ndarray and value.ndim == 0 and value.dtype == dtype:
            return value[()]  # what the cast returns, without its checks
        if type(value) is np.float64:  # a loss's sum or mean: the cast without its checks
            if dtype == _F64:
                return value
            if dtype == _F32 and not abs(value) > _F32_MAX:
                return np.float32(value)  # (within float32's range, or NaN: no overflow)
        return cast(value, dtype)[()]

    def unbroadcast(self, grad, shape):
        return unbroadcast(grad, shape)

    def negate_(self, a) -> None:
        np.negative(a, out=a)

    def scale(self, a, factor: float):
        """A new array ``a * factor``."""
        return a * factor

    def total(self, a):
        """The sum of all elements, as a 0-d array of this backend."""
        return a.sum()

    def row_dots(self, a, b):
        """``(a * b).sum(axis=1)`` of two (rows, n) arrays."""
        return (a * b).sum(axis=1)

    def add_product(self, out, a, b) -> None:
        """``out += a * b`` in place."""
        out += a * b


NUMPY = NumpyBackend()
