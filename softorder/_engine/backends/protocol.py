"""The interface every backend implements: what the rules (:mod:`softorder._engine.rules`) and
the shape handling (:mod:`softorder._engine.layout`) call on a call's arrays.

A backend owns where the arrays of a call live (host memory, a GPU) and which kernels run on
them (``kernels``: :mod:`softorder.core`, or its GPU twin :mod:`softorder.core.cuda` under the
same names). Arrays below are "this backend's arrays" unless said to be host arrays; the rules
never write an array a backend returns from ``contiguous_f64``, ``moveaxis`` or
``from_host``, and every other returned array is new (the rules may write it).

The implementations: :class:`~softorder._engine.backends.numpy_host.NumpyBackend`,
:class:`~softorder._engine.backends.numba_cuda.NumbaDeviceBackend` and the PyTorch bridge's
:class:`~softorder.bridges._torch_device.TorchDeviceBackend`;
``tests/test_backend_protocol.py`` checks that each has every member, with these parameters.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Backend(Protocol):
    """Where a call's arrays live and which kernels run on them."""

    @property
    def kernels(self) -> Any:
        """The kernels, under the names of :mod:`softorder.core` (a module or a namespace)."""
        ...

    def float_input(self, x, name: str) -> tuple[Any, Any]:
        """``x`` as a real array of this backend and the dtype results are returned in;
        ``TypeError`` naming ``name`` for complex or non-numeric input.
        """
        ...

    def moveaxis(self, a, source, destination) -> Any:
        """``a`` with axes moved, as :func:`numpy.moveaxis` (a view where possible)."""
        ...

    def contiguous_f64(self, a, negate: bool = False) -> Any:
        """``a`` as a C-contiguous float64 array, negated on request (no copy when it is one)."""
        ...

    def sort_rows(self, rows2d, order=None) -> tuple[Any, Any]:
        """``(xs, order)``: each row of ``rows2d`` sorted ascending (NaN last) and its int64
        argsort; with ``order`` (a saved argsort) only the gather.
        """
        ...

    def contiguous(self, a) -> Any:
        """``a`` as a C-contiguous array of its dtype."""
        ...

    def empty(self, shape, dtype=np.float64) -> Any:
        """A new uninitialised array."""
        ...

    def zeros(self, shape) -> Any:
        """A new float64 array of zeros."""
        ...

    def full(self, shape, value: float) -> Any:
        """A new float64 array filled with ``value``."""
        ...

    def from_host(self, arr: np.ndarray) -> Any:
        """A host array (validated arguments, targets) as this backend's array."""
        ...

    def tile_rows(self, row: np.ndarray, rows: int) -> Any:
        """``rows`` copies of the host vector ``row`` as a (rows, len(row)) array."""
        ...

    def broadcast_f64(self, a, shape) -> Any:
        """``a`` broadcast to ``shape`` as a new C-contiguous float64 array."""
        ...

    def cast(self, a, dtype) -> Any:
        """``a`` as a C-contiguous array of ``dtype`` (values beyond its range become +-inf)."""
        ...

    def to_result(self, value, dtype) -> Any:
        """``value`` as a result of ``dtype`` (NumPy makes a 0-d value a scalar)."""
        ...

    def unbroadcast(self, grad, shape) -> Any:
        """``grad`` summed over the axes that broadcasting added to an argument of ``shape``."""
        ...

    def negate_(self, a) -> None:
        """``a = -a`` in place."""
        ...

    def scale(self, a, factor: float) -> Any:
        """A new array ``a * factor``."""
        ...

    def total(self, a) -> Any:
        """The sum of all elements, as a 0-d array of this backend."""
        ...

    def row_dots(self, a, b) -> Any:
        """``(a * b).sum(axis=1)`` of two (rows, n) arrays."""
        ...

    def add_product(self, out, a, b) -> None:
        """``out += a * b`` in place."""
        ...


def members() -> list[str]:
    """The names of :class:`Backend`'s members, in declaration order."""
    return [name for name in vars(Backend) if not name.startswith("_")]
