"""Shape handling and validation, written once for every operation and every bridge.

An operation acts along one axis of ``x``; every other axis is a batch axis. :class:`Rows`
moves that axis last, flattens the batch to ``(rows, n)``, converts to float64, sorts each row
(NumPy's SIMD argsort, outside the kernels) and maps results and gradients back to the
caller's layout and dtype. The kernels only ever see C-contiguous float64 ``(rows, ...)`` arrays.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from softorder._engine.backend import NUMPY, backend_of, float_array

#: where the core axes of a result go, by kind: ``row`` (n), ``targets_row`` (m, n),
#: ``targets`` (m), ``none`` () and ``matrix`` (n, n).
KINDS = ("row", "targets_row", "targets", "none", "matrix")


_SMALLEST_ALPHA = float(np.finfo(np.float64).tiny)


def refuse_masked(value, name: str) -> None:
    """``TypeError`` for a :class:`numpy.ma.MaskedArray`: its mask would be silently lost."""
    if isinstance(value, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a numpy.ma.MaskedArray; softorder does not read masks (np.asarray would "
            f"silently drop it): fill the masked entries explicitly, e.g. {name}.filled(-np.inf) "
            "as padding for soft_topk(largest=True), or pass np.ma.getdata"
            f"({name}) to ignore the mask"
        )


def check_flag(value, name: str) -> bool:
    """``value`` as a bool, or ``TypeError`` naming ``name``: only ``True``/``False`` (or NumPy
    bools) are flags; a string such as ``"False"`` would otherwise count as true.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False); got {value!r}")


def alpha_batch_shape(alpha_shape: tuple, batch_ndim: int, axis: int) -> tuple:
    """The shape of an ``alpha`` argument lined up with the batch axes: an ``alpha`` with as
    many axes as ``x`` (NumPy's ``keepdims`` shape, e.g. ``x.std(axis, keepdims=True)``) loses
    the operation's ``axis`` (its length is 1); any other shape is already aligned.
    """
    if len(alpha_shape) == batch_ndim + 1:
        return alpha_shape[:axis] + alpha_shape[axis + 1 :]
    return alpha_shape


def check_alpha(
    alpha, batch_shape: tuple = (), axis: int | None = None
) -> tuple[np.ndarray, tuple]:
    """``alpha`` once per row as float64 ``(rows,)``, and the shape the caller gave it.

    ``alpha`` is a positive finite scalar, or an array of them broadcastable to
    ``batch_shape`` (one temperature per row). With ``axis`` (the operation's axis, counted
    from 0 in ``x``, which has ``len(batch_shape) + 1`` axes) ``alpha`` may also have ``x``'s
    number of axes with length 1 along ``axis`` (NumPy's ``keepdims`` shape). Anything else
    raises ``TypeError`` or ``ValueError`` naming alpha and the offending value.
    """
    # the common case first, fast: one valid scalar (np.ndarray exactly: not a masked array)
    value = math.nan
    if isinstance(alpha, float):
        value = alpha
    elif type(alpha) is np.ndarray and alpha.shape == () and alpha.dtype.kind in "iuf":
        value = float(alpha)
    rows = math.prod(batch_shape)
    if math.isfinite(value) and value >= _SMALLEST_ALPHA and rows:
        return np.full(rows, value), ()
    refuse_masked(alpha, "alpha")
    if isinstance(alpha, bool) or (
        not isinstance(alpha, numbers.Real) and np.asarray(alpha).dtype.kind not in "iuf"
    ):
        raise TypeError(f"alpha must be a positive real scalar or array; got {alpha!r}")
    arr = np.asarray(alpha, dtype=np.float64)
    nb = len(batch_shape)
    try:
        if axis is not None and arr.ndim == nb + 1:  # the keepdims shape: length 1 along axis
            if arr.shape[axis] != 1:
                raise ValueError
            full = np.broadcast_to(arr.reshape(alpha_batch_shape(arr.shape, nb, axis)), batch_shape)
        else:
            full = np.broadcast_to(arr, batch_shape)
    except ValueError:
        keepdims = batch_shape[:axis] + (1,) + batch_shape[axis:] if axis is not None else None
        raise ValueError(
            f"alpha of shape {arr.shape} does not broadcast to the batch shape {batch_shape}"
            + (f" or to the keepdims shape {keepdims} (one alpha per row)" if keepdims else "")
        ) from None
    bad = ~(np.isfinite(arr) & (arr > 0.0))
    if bad.any():
        raise ValueError(
            f"alpha must be positive and finite; got alpha={arr[bad].flat[0].item()!r}"
        )
    if (arr < _SMALLEST_ALPHA).any():
        raise ValueError(
            f"alpha must be at least {_SMALLEST_ALPHA:.3g} (1/alpha must be finite); "
            f"got alpha={arr[arr < _SMALLEST_ALPHA].flat[0].item()!r}"
        )
    return np.ascontiguousarray(full).reshape(-1), arr.shape


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
        shape = tuple(int(s) for s in shape)
        ndim = len(shape)
        if ndim == 0:
            raise ValueError(f"{name} must have at least one axis; got a scalar")
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
            raise TypeError(f"axis must be an integer; got {axis!r}")
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} is out of range for {name} with {ndim} dimensions")
        axis = int(axis) % ndim
        if shape[axis] == 0:
            raise ValueError(f"{name} has an empty axis {axis} (shape {shape}); need n >= 1")
        batch_shape = tuple(shape[:axis]) + tuple(shape[axis + 1 :])
        return cls(batch_shape, axis, ndim, int(shape[axis]))

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


@dataclass
class Rows:
    """An input viewed as sorted rows: ``xs[r] = sort(sign * x[r])``, ``order[r]`` its argsort."""

    xs: np.ndarray
    order: np.ndarray
    layout: Layout
    dtype: np.dtype
    sign: float
    backend: object = NUMPY  # where the arrays live (softorder._engine.backend)

    @classmethod
    def from_input(
        cls, x, axis: int = -1, name: str = "x", negate: bool = False, order=None
    ) -> Rows:
        """Validate and sort ``x``; with ``order`` (its saved argsort, from a forward pass)
        the sort is skipped and the rows are only gathered.
        """
        refuse_masked(x, name)
        backend = backend_of(x)
        arr, dtype = backend.float_input(x, name)
        layout = Layout.of(arr.shape, axis, name)
        # (np.moveaxis costs 2 us even when there is nothing to move)
        moved = arr if layout.axis == layout.ndim - 1 else backend.moveaxis(arr, layout.axis, -1)
        rows2d = backend.contiguous_f64(moved, negate).reshape(-1, layout.n)  # never written
        xs, order = backend.sort_rows(rows2d, order)
        return cls(xs, order, layout, dtype, -1.0 if negate else 1.0, backend)

    @property
    def batch_shape(self) -> tuple:
        return self.layout.batch_shape

    @property
    def rows(self) -> int:
        return self.xs.shape[0]

    @property
    def n(self) -> int:
        return self.xs.shape[1]

    def to_user(self, arr: np.ndarray, kind: str, dtype=None) -> np.ndarray:
        """A ``(rows, *core)`` kernel result in the caller's layout and dtype."""
        dst, ncore = self.layout._positions(kind)
        nb = len(self.batch_shape)
        shaped = arr.reshape(self.batch_shape + arr.shape[1:])
        source = list(range(nb, nb + ncore))
        moved = shaped if source == dst else self.backend.moveaxis(shaped, source, dst)
        return self.backend.cast(moved, self.dtype if dtype is None else dtype)

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
        refuse_masked(value, name)
        arr, _ = self.backend.float_input(value, name)
        dst, ncore = self.layout._positions(kind)
        nb = len(self.batch_shape)
        expected = self.layout.user_shape(kind, core_shape)
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


@dataclass
class Targets:
    """Per-row targets of an inversion (``k`` of top-k, ``q`` of quantile) as ``(rows, m)``."""

    values: np.ndarray  # the user's values broadcast to (rows, m)
    order: np.ndarray  # argsort of each row of values
    multi: bool  # True when the user gave several targets per row (an extra trailing axis)
    shape: tuple  # the user's argument shape, for reducing gradients back onto it

    @classmethod
    def parse(cls, value, rows: Rows, name: str, high: float, high_text: str) -> Targets:
        if type(value) in (int, float) and 0 < value < high:  # one valid scalar: 6 us less
            backend = rows.backend
            values = backend.from_host(np.full((rows.rows, 1), float(value)))
            return cls(values, backend.from_host(np.zeros((rows.rows, 1), np.int64)), False, ())
        refuse_masked(value, name)
        arr, _ = float_array(value, name)
        if arr.dtype.kind == "b":  # True would silently be 1
            raise TypeError(f"{name} must be a real number or array, not a bool; got {value!r}")
        nb = len(rows.batch_shape)
        multi = arr.ndim == nb + 1
        if arr.ndim > nb + 1:
            raise ValueError(
                f"{name} has {arr.ndim} dimensions; expected at most {nb + 1}: the batch shape "
                f"{rows.batch_shape} plus one optional trailing axis listing several {name} per row"
            )
        target_shape = rows.batch_shape + ((arr.shape[-1],) if multi else ())
        try:
            full = np.broadcast_to(arr, target_shape)
        except ValueError:
            hint = (
                f"; to ask for several {name} per row give {name} a trailing axis, "
                f"e.g. shape {(1,) * nb + arr.shape[-1:]}"
                if arr.ndim == nb
                else ""
            )
            raise ValueError(
                f"{name} of shape {arr.shape} does not broadcast to the batch shape "
                f"{rows.batch_shape}{hint}"
            ) from None
        if full.size and not np.all((full > 0) & (full < high)):
            bad = full[~((full > 0) & (full < high))].flat[0]
            raise ValueError(
                f"{name} must lie strictly between 0 and {high_text}; got {bad.item()}"
            )
        m = arr.shape[-1] if multi else 1
        values = np.ascontiguousarray(full, dtype=np.float64).reshape(rows.rows, m)
        order = np.argsort(values, axis=1)
        return cls(rows.backend.from_host(values), rows.backend.from_host(order), multi, arr.shape)

    @property
    def m(self) -> int:
        return self.values.shape[1]

    @staticmethod
    def count(value, layout: Layout) -> int:
        """How many targets per row ``value`` lists, from its shape alone."""
        shape = np.shape(value)
        return int(shape[-1]) if len(shape) == len(layout.batch_shape) + 1 else 1

    def grad_to_user(self, w_bar: np.ndarray, rows: Rows, dtype) -> np.ndarray:
        """Gradient per target ``(rows, m)`` -> gradient of the user's argument (its shape)."""
        shaped = w_bar.reshape(rows.batch_shape + ((self.m,) if self.multi else ()))
        backend = rows.backend
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
