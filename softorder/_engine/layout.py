"""Shape handling, written once for every operation and every bridge (the validation of the
other arguments: :mod:`softorder._engine.checks`).

An operation acts along one axis of ``x``; every other axis is a batch axis. :class:`Rows`
moves that axis last, flattens the batch to ``(rows, n)``, converts to float64, sorts each row
(by NumPy, outside the kernels: ``NumpyBackend.sort_rows``) and maps results and gradients
back to the caller's layout and dtype. The kernels only ever see C-contiguous float64
``(rows, ...)`` arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from softorder._engine.backend import NUMPY, backend_of
from softorder._engine.backend import _lookups as _backend_lookups
from softorder._engine.backends.numpy_host import PACKED_SORT_SIZE, sum_over_rows
from softorder._engine.backends.protocol import Backend
from softorder._engine.checks import check_axis, check_targets, refuse_masked

_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)
_I32 = np.dtype(np.int32)
_F32_MAX = float(np.finfo(np.float32).max)


def _refuse_extended(dtype: np.dtype, name: str) -> None:
    """``TypeError`` for an input wider than float64 (``np.longdouble``): the kernels would
    round it to float64, merging values that differ only beyond float64 into ties, and return
    float64 precision in a dtype that promises more.
    """
    raise TypeError(
        f"softorder computes in float64 and does not take {name} of dtype {dtype} (its values "
        f"would be rounded to float64); pass {name}.astype(np.float64) if that is acceptable"
    )


def _refuse_framework_values(x, name: str) -> None:
    """``TypeError`` pointing to the bridge for what the NumPy API cannot convert: a PyTorch
    tensor that requires grad (PyTorch's own error advises ``x.detach()``, which would silently
    cut the gradient) or a JAX tracer (inside ``jit``, ``grad``, ``vmap``).
    """
    module = type(x).__module__
    if module.startswith("torch") and getattr(x, "requires_grad", False):
        raise TypeError(
            f"{name} is a torch.Tensor that requires grad: softorder's NumPy API cannot "
            "differentiate it; use softorder.bridges.torch (the same operations as PyTorch "
            f"operations), or pass {name}.detach() for values only"
        ) from None  # (PyTorch's advice, in the context, is the wrong one here)
    if module.startswith("jax") and "Tracer" in type(x).__name__:
        raise TypeError(
            f"{name} is a JAX tracer (inside jit, grad or vmap): softorder's NumPy API "
            "cannot trace it; use softorder.bridges.jax (the same operations as JAX functions)"
        ) from None


#: where the core axes of a result go, by kind: ``row`` (n), ``targets_row`` (m, n),
#: ``targets`` (m), ``none`` () and ``matrix`` (n, n).
KINDS = ("row", "targets_row", "targets", "none", "matrix")


@dataclass(frozen=True)
class Layout:
    """Where an operation's axis and batch axes are, from the input's shape alone.

    The bridges use it to declare result and residual shapes before any data exists.
    """

    batch_shape: tuple
    axis: int  # non-negative
    ndim: int
    n: int

    @classmethod
    def of(cls, shape: tuple, axis, name: str = "x") -> Layout:
        # a layout depends on these three only and is immutable: small calls reuse one
        key = (shape, axis, name) if type(shape) is tuple and type(axis) is int else None
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = cls._of(shape, axis, name)
            if key is not None:
                if len(_LAYOUTS) >= _MAX_LAYOUTS:
                    _LAYOUTS.clear()
                _LAYOUTS[key] = layout
        return layout

    @classmethod
    def _of(cls, shape: tuple, axis, name: str) -> Layout:
        shape = tuple(int(s) for s in shape)
        axis = check_axis(axis, shape, name) % len(shape)
        batch_shape = tuple(shape[:axis]) + tuple(shape[axis + 1 :])
        return cls(batch_shape, axis, len(shape), int(shape[axis]))

    def _positions(self, kind: str) -> tuple[list[int], int]:
        nb = len(self.batch_shape)
        if kind == "row":
            return [self.axis], 1
        if kind == "targets_row":
            return [self.axis, self.axis + 1], 2
        if kind == "targets":
            return [self.axis], 1
        if kind == "matrix":
            return [nb, nb + 1], 2
        if kind == "none":
            return [], 0
        raise ValueError(f"unknown result kind {kind!r}; expected one of {KINDS}")

    def user_shape(self, kind: str, core_shape: tuple) -> tuple:
        """The caller-facing shape of a result of ``kind`` with core axes ``core_shape``."""
        dst, ncore = self._positions(kind)
        shape = list(self.batch_shape)
        for position, size in sorted(zip(dst, core_shape, strict=True)):  # as np.moveaxis does
            shape.insert(position, int(size))
        return tuple(shape)


#: the layouts of recent calls, by (shape, axis, name) (see :meth:`Layout.of`)
_LAYOUTS: dict = {}
_MAX_LAYOUTS = 256


class Rows:
    """An input viewed as sorted rows: ``xs[r] = sort(sign * x[r])``, ``order[r]`` its argsort.

    ``batch_shape`` (the layout's), ``rows`` and ``n`` (``xs.shape``) are plain attributes,
    not properties: a small call reads them a few dozen times.
    """

    __slots__ = ("xs", "order", "layout", "dtype", "sign", "backend", "batch_shape", "rows", "n")

    def __init__(
        self,
        xs: np.ndarray,
        order: np.ndarray,
        layout: Layout,
        dtype: np.dtype,
        sign: float,
        backend: Backend = NUMPY,  # where the arrays live (softorder._engine.backend)
    ) -> None:
        self.xs, self.order, self.layout, self.dtype, self.sign = xs, order, layout, dtype, sign
        self.backend = backend
        self.batch_shape = layout.batch_shape
        self.rows, self.n = xs.shape

    @classmethod
    def from_input(
        cls, x, axis: int = -1, name: str = "x", negate: bool = False, order=None
    ) -> Rows:
        """Validate and sort ``x``; with ``order`` (its saved argsort, from a forward pass)
        the sort is skipped and the rows are only gathered.
        """
        if type(x) is np.ndarray and x.dtype.kind == "f" and not _backend_lookups:
            # the common case, a floating host array: what refuse_masked, backend_of and
            # float_input give it, without their calls (each counts at n = 1e2)
            backend, arr, dtype = NUMPY, x, x.dtype
            layout = _LAYOUTS.get((x.shape, axis, name)) if type(axis) is int else None
            if layout is None:
                layout = Layout.of(x.shape, axis, name)
            if (
                dtype is _F64
                and order is None
                and x.size < PACKED_SORT_SIZE
                and layout.axis == layout.ndim - 1
                and x.flags.c_contiguous
            ):  # a small float64 input, its rows as they are: sorted without the general path
                rows2d = (np.negative(x) if negate else x).reshape(-1, layout.n)
                xs, order = NUMPY.sort_rows(rows2d)
                return cls(xs, order, layout, dtype, -1.0 if negate else 1.0, NUMPY)
        else:
            refuse_masked(x, name)
            backend = backend_of(x)
            try:
                arr, dtype = backend.float_input(x, name)
            except (RuntimeError, TypeError):
                _refuse_framework_values(x, name)
                raise
            layout = Layout.of(arr.shape, axis, name)
        if dtype is not _F64 and dtype is not _F32 and dtype.itemsize > 8:
            _refuse_extended(dtype, name)
        if (
            arr.dtype is _F64  # (not dtype: an integer input's arr is not converted yet)
            and backend is NUMPY
            and layout.axis == layout.ndim - 1
            and arr.flags.c_contiguous
        ):  # already the rows the kernels read, or their negation: contiguous_f64's arrays
            rows2d = (np.negative(arr) if negate else arr).reshape(-1, layout.n)
        else:
            # (np.moveaxis is not free even when there is nothing to move)
            last = layout.axis == layout.ndim - 1
            moved = arr if last else backend.moveaxis(arr, layout.axis, -1)
            rows2d = backend.contiguous_f64(moved, negate).reshape(-1, layout.n)  # never written
        xs, order = backend.sort_rows(rows2d, order)
        return cls(xs, order, layout, dtype, -1.0 if negate else 1.0, backend)

    def to_user(self, arr: np.ndarray, kind: str, dtype=None) -> np.ndarray:
        """A ``(rows, *core)`` kernel result in the caller's layout and dtype."""
        layout = self.layout
        if dtype is None:
            dtype = self.dtype
        nb = layout.ndim - 1
        if kind == "row" and layout.axis == nb:  # the common case: the axis is already last
            if type(arr) is np.ndarray:
                # (one row: its first row is the view the reshape gives, for less)
                shaped = arr[0] if nb == 0 else arr.reshape(self.batch_shape + arr.shape[1:])
                if (shaped.dtype is dtype or shaped.dtype == dtype) and shaped.flags.c_contiguous:
                    return shaped  # what the cast returns (the kernels write C-ordered rows)
                return self.backend.cast(shaped, dtype)
            moved = arr.reshape(layout.batch_shape + arr.shape[1:])
        else:
            shaped = arr.reshape(layout.batch_shape + arr.shape[1:])
            dst, ncore = layout._positions(kind)
            source = list(range(nb, nb + ncore))
            moved = shaped if source == dst else self.backend.moveaxis(shaped, source, dst)
        return self.backend.cast(moved, dtype)

    def to_core(self, value, kind: str, core_shape: tuple, name: str) -> np.ndarray:
        """A cotangent or tangent given in the caller's layout, as ``(rows, *core_shape)``
        float64; ``ValueError`` when its shape is not the shape of the result it belongs to.
        """
        return self.to_core_owned(value, kind, core_shape, name)[0]

    def to_core_owned(
        self, value, kind: str, core_shape: tuple, name: str
    ) -> tuple[np.ndarray, bool]:
        """:meth:`to_core`, and whether the result is a host array of softorder's own (a
        conversion or copy, sharing no memory with ``value``): a kernel that reads each row of
        it before writing its output row may then write that output into it (one array of n
        float64 less at the peak of a float32 VJP).
        """
        layout = self.layout
        nb = len(layout.batch_shape)
        if kind == "row" and layout.axis == nb:  # the common case: the axis is already last
            expected = layout.batch_shape + core_shape
            if (
                type(value) is np.ndarray
                and value.dtype is _F64
                and value.flags.c_contiguous
                and self.backend is NUMPY
            ):  # already what the host kernels read: used as it is, never written (not owned)
                if value.shape != expected:
                    raise ValueError(f"{name} must have shape {expected}; got {value.shape}")
                return value.reshape((self.rows,) + core_shape), False
            refuse_masked(value, name)
            arr, _ = self.backend.float_input(value, name)
            if tuple(arr.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}; got {tuple(arr.shape)}")
            moved = arr
        else:
            refuse_masked(value, name)
            arr, _ = self.backend.float_input(value, name)
            dst, ncore = layout._positions(kind)
            expected = layout.user_shape(kind, core_shape)
            if tuple(arr.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}; got {tuple(arr.shape)}")
            source = list(range(nb, nb + ncore))
            moved = arr if source == dst else self.backend.moveaxis(arr, dst, source)
        core = self.backend.contiguous_f64(moved)
        owned = (
            type(core) is np.ndarray
            and core is not arr
            and core.flags.writeable
            and not np.may_share_memory(core, arr)
        )
        return core.reshape((self.rows,) + core_shape), owned

    def grad_to_user(self, rbar: np.ndarray) -> np.ndarray:
        """Gradient in the sorted-row variable ``r = sign * x`` -> gradient in ``x``."""
        if self.sign < 0:
            self.backend.negate_(rbar)  # rbar is the kernels' own output
        return self.to_user(rbar, "row")

    def tangent_to_core(self, x_dot, name: str = "x tangent") -> np.ndarray:
        """Tangent of ``x`` in the caller's layout -> tangent of ``r = sign * x`` as (rows, n)."""
        return self.backend.scale(self.to_core(x_dot, "row", (self.n,), name), self.sign)


#: the NumPy scalar types of a target (``k``, ``q``) and the dtypes of 0-d arrays that
#: :meth:`Targets.parse` takes as a Python float: check_targets's float64 value (and its
#: comparisons with ``high``, which convert them to float64; a narrower float would be
#: compared in its own dtype)
_NUMPY_TARGETS = frozenset(
    (np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
)
_NUMPY_DTYPES = frozenset(np.dtype(t) for t in _NUMPY_TARGETS)


class Targets:
    """Per-row targets of an inversion (``k`` of top-k, ``q`` of quantile) as ``(rows, m)``.

    ``values``: the user's values broadcast to (rows, m); ``order``: the argsort of each row
    of them; ``multi``: whether the user gave several targets per row (an extra trailing
    axis); ``shape``: the user's argument shape, for reducing gradients back onto it; ``m``
    (an attribute: it is read several times a call) the number of targets per row.
    """

    __slots__ = ("values", "order", "multi", "shape", "m")

    def __init__(self, values: np.ndarray, order: np.ndarray, multi: bool, shape: tuple) -> None:
        self.values, self.order, self.multi, self.shape = values, order, multi, shape
        self.m = values.shape[1]

    @classmethod
    def parse(cls, value, rows: Rows, name: str, high: float, high_text: str) -> Targets:
        scalar = value
        if type(value) in _NUMPY_TARGETS or (
            type(value) is np.ndarray and value.shape == () and value.dtype in _NUMPY_DTYPES
        ):  # one NumPy number: check_targets's float64 value, compared with high as it does
            scalar = float(value)
        if type(scalar) in (int, float) and 0 < scalar < high:  # one valid scalar: fast
            values = np.empty((rows.rows, 1))  # (np.full's Python wrapper costs twice as much)
            values.fill(float(scalar))
            order = np.zeros((rows.rows, 1), _I64)
            backend = rows.backend
            if backend is not NUMPY:
                values, order = backend.from_host(values), backend.from_host(order)
            return cls(values, order, False, ())
        values, multi, shape = check_targets(value, rows.batch_shape, name, high, high_text)
        if values.shape[1] == 1:  # the argsort of one target per row, without sorting
            order = np.zeros(values.shape, np.intp)
        else:
            order = values.argsort(axis=1)
        backend = rows.backend
        if backend is NUMPY:  # from_host's arrays, without its call where they already are
            if not values.flags.c_contiguous:  # (targets given as a strided array, kept)
                values = np.ascontiguousarray(values)
            return cls(values, order, multi, shape)
        return cls(backend.from_host(values), backend.from_host(order), multi, shape)

    @staticmethod
    def count(value, layout: Layout) -> int:
        """How many targets per row ``value`` lists, from its shape alone."""
        shape = np.shape(value)
        return int(shape[-1]) if len(shape) == len(layout.batch_shape) + 1 else 1

    def grad_to_user(self, w_bar: np.ndarray, rows: Rows, dtype) -> np.ndarray:
        """Gradient per target ``(rows, m)`` -> gradient of the user's argument (its shape)."""
        backend = rows.backend
        if not self.shape and rows.batch_shape and backend is NUMPY:  # one target, every row
            # (sum_over_rows: unbroadcast's sum without its reshapes; the cast's error state
            # only outside float32's range, within which the sum rounds as the cast does)
            total = sum_over_rows(w_bar, True)
            if dtype is _F64 or dtype is _F32 and abs(total) <= _F32_MAX:
                return np.array(total, dtype)
            return backend.cast(total, dtype).reshape(())
        if not self.shape and dtype is _F32 and backend is NUMPY and w_bar.shape == (1, 1):
            # one row, one target, float32: the general path's cast of the value as a 0-d
            # array, without the cast's error state within float32's range
            value = w_bar[0, 0]
            if abs(value) <= _F32_MAX:
                return np.array(value, _F32)
        return self._grad_to_user_general(w_bar, rows, dtype)

    def _grad_to_user_general(self, w_bar: np.ndarray, rows: Rows, dtype) -> np.ndarray:
        """:meth:`grad_to_user` for any targets and backend: the per-row gradients summed over
        the axes the argument was broadcast along, in ``dtype``.
        """
        backend = rows.backend
        shaped = w_bar.reshape(rows.batch_shape + ((self.m,) if self.multi else ()))
        if tuple(shaped.shape) == self.shape:  # nothing was broadcast
            return backend.cast(shaped, dtype)
        return backend.cast(backend.unbroadcast(shaped, self.shape), dtype).reshape(self.shape)

    def tangent_to_core(self, value, rows: Rows, name: str) -> np.ndarray:
        """Tangent of the user's argument -> ``(rows, m)`` float64."""
        arr, _ = rows.backend.float_input(value, name)
        if tuple(arr.shape) != self.shape:
            raise ValueError(f"{name} must have shape {self.shape}; got {tuple(arr.shape)}")
        target_shape = rows.batch_shape + ((self.m,) if self.multi else ())
        return rows.backend.broadcast_f64(arr, target_shape).reshape(rows.rows, self.m)


#: axes after the batch axes that each array argument other than the input has; ``None``: one
#: when it lists several targets per row (``k`` and ``q`` with ``batch_ndim + 1`` axes)
_TRAILING_AXES = {"alpha": 0, "labels": 0, "p_k": 1, "target_ranks": 1, "k": None, "q": None}
#: array arguments whose batch axes are the input's exactly (never broadcast)
BATCH_SHAPED = frozenset(("labels", "target_ranks"))


def several_per_row(name: str, value, batch_ndim: int) -> bool:
    """Whether the targets ``value`` of argument ``name`` (``k`` or ``q``) list several per row
    of an input with ``batch_ndim`` batch axes: a trailing axis beyond them, as
    :func:`~softorder._engine.checks.check_targets` reads it. False for other arguments and
    for a ragged ``value`` (which the checks refuse).

    Examples
    --------
    >>> several_per_row("q", [0.25, 0.75], 0), several_per_row("q", [0.25, 0.75], 1)
    (True, False)
    >>> several_per_row("alpha", [0.5, 1.0], 0)
    False
    """
    if _TRAILING_AXES.get(name, 0) is not None:
        return False
    try:
        return np.ndim(value) == batch_ndim + 1
    except ValueError:  # ragged
        return False


def trailing_axes(name: str, value, batch_ndim: int) -> int:
    """How many axes of ``value``, argument ``name`` of an input with ``batch_ndim`` batch
    axes, follow those batch axes: ``p_k``'s and ``target_ranks``' one, the one of ``k`` or
    ``q`` listing several per row (:func:`several_per_row`), and ``alpha``'s in its keepdims
    shape (the row axis, of length 1); none for the others.

    Examples
    --------
    >>> trailing_axes("q", [[0.25, 0.75]], 1), trailing_axes("q", [0.25, 0.75], 1)
    (1, 0)
    >>> trailing_axes("alpha", [[0.5], [1.0]], 1), trailing_axes("alpha", [0.5, 1.0], 1)
    (1, 0)
    """
    trailing = _TRAILING_AXES.get(name, 0)
    if trailing is None:
        return 1 if several_per_row(name, value, batch_ndim) else 0
    if name == "alpha" and np.ndim(value) == batch_ndim + 1:
        return 1
    return trailing


def row_aligned(name: str, value, batch_shape: tuple) -> bool:
    """Whether ``value`` of argument ``name`` lists one entry per row of the batch
    ``batch_shape`` (its leading axes are those batch axes, its own trailing axes after them)
    rather than one for every row: how a caller that splits a batch into groups of rows (dask's
    chunks) tells the arguments to split with them. False for the input's other arguments, for
    no batch axes, and for a ragged ``value`` (which the checks refuse).

    Examples
    --------
    >>> row_aligned("alpha", [0.5, 1.0], (2,)), row_aligned("alpha", 0.5, (2,))
    (True, False)
    >>> row_aligned("p_k", [0.5, 0.5], (2,)), row_aligned("p_k", [[0.5, 0.5]] * 2, (2,))
    (False, True)
    """
    if name not in _TRAILING_AXES or not batch_shape:
        return False
    try:
        shape = np.shape(value)
    except ValueError:  # ragged
        return False
    nb = len(batch_shape)
    return len(shape) >= nb + (_TRAILING_AXES[name] or 0) and shape[:nb] == tuple(batch_shape)


def axes_after_leading(name: str, ndim: int, batch_ndim: int) -> int:
    """Unit axes to insert after new leading batch axes (a framework's ``vmap``) in the
    argument ``name`` of ``ndim`` dimensions (without those axes), so that it still lines up
    with the input's ``batch_ndim`` batch axes under NumPy's right-aligned broadcasting.

    Examples
    --------
    >>> axes_after_leading("alpha", 0, 2)  # a scalar alpha, batch (B, R) -> shape (V, 1, 1)
    2
    >>> axes_after_leading("k", 2, 1), axes_after_leading("k", 1, 1)  # several k / one per row
    (0, 0)
    """
    trailing = _TRAILING_AXES.get(name, 0)
    if trailing is None:
        trailing = 1 if ndim == batch_ndim + 1 else 0
    return max(batch_ndim + trailing - ndim, 0)
