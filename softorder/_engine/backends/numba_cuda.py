"""Device arrays of any framework as a backend of the rules (:mod:`softorder._engine.backend`).

Anything with ``__cuda_array_interface__`` (numba device arrays, CuPy arrays, JAX GPU arrays;
not PyTorch tensors, which the torch bridge's own backend takes) goes through the same rules
as the NumPy API: the layout by the kernels of :mod:`softorder.core.cuda.elementwise`, the
sort by :mod:`softorder.core.cuda.sort_rows`, the mathematics by the kernels of
:mod:`softorder.core.cuda`. Results are numba device arrays (:class:`DeviceArray`) of the
input's dtype, C-contiguous in the caller's layout.

* Moving axes copies nothing: :meth:`NumbaDeviceBackend.moveaxis` gives a
  :class:`StridedView` (a walk over the array's memory), which reshapes in C order without a
  copy (numba's ``DeviceNDArray.reshape`` raises for a permuted view, and reads an F-ordered
  array in memory order); ``contiguous_f64`` and ``cast`` materialise it with one gather kernel.
* Host round trips: the small arguments the rules validate on the host (``alpha``, ``k``,
  ``q``, labels, ``p_k``), as for every backend, and the gradients of ``alpha``, ``k`` and
  ``q`` when they must be summed over broadcast axes (:meth:`NumbaDeviceBackend.unbroadcast`:
  a few values per row at most).

Kernels launch on the stream of :func:`softorder.core.cuda.on_stream` (the default stream
otherwise). :func:`softorder._engine.backend.backend_of` imports this module and registers
:func:`lookup` the first time it sees a device array; importing it registers nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import numpy as np
from numba import cuda

from softorder._engine.backends import numpy_host
from softorder.core.cuda import _launch, elementwise, scan
from softorder.core.cuda.rows import take_rows
from softorder.core.cuda.sort_rows import sort_rows as argsort_rows

if _launch.SIMULATOR:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _Base
else:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray as _Base


class DeviceArray(_Base):
    """A numba device array (numba's stand-in under the simulator), as this backend allocates
    and returns them.
    """

    if _launch.SIMULATOR:

        def reshape(self, *shape) -> DeviceArray:
            """A reshaped view of the same class, as ``DeviceNDArray.reshape`` gives."""
            return DeviceArray(self._ary.reshape(*shape))


def _wrap(a) -> DeviceArray:
    """The device array ``a`` (same memory) as a :class:`DeviceArray`."""
    if isinstance(a, DeviceArray):
        return a
    if _launch.SIMULATOR:
        return DeviceArray(a._ary)
    return DeviceArray(a.shape, a.strides, a.dtype, stream=a.stream, gpu_data=a.gpu_data)


def is_device_array(x) -> bool:
    """``x`` lives on the device: a numba device array, or has ``__cuda_array_interface__``."""
    if isinstance(x, _Base):
        return True
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:  # a sharded JAX array raises ValueError: not one device array
        return False


@dataclasses.dataclass(frozen=True)
class StridedView:
    """Device memory seen as an array of ``shape``: the C-order walk of ``walk_shape`` with
    ``walk_strides`` (in elements) over the 1-D device array ``memory``, from ``offset``.

    Moving axes and broadcasting change the walk; :meth:`reshape` changes only ``shape`` (the
    same elements in the same C order), so it never copies.
    """

    memory: object  # a 1-D device array; None when the view is empty
    offset: int
    walk_shape: tuple
    walk_strides: tuple
    shape: tuple
    dtype: np.dtype

    @classmethod
    def of(cls, a) -> StridedView:
        """A device array, or a view (made strided again by a copy once reshaped)."""
        if isinstance(a, StridedView):
            return a if a.shape == a.walk_shape else cls.of(_materialise(a, a.dtype))
        a = _launch.as_device(a)
        shape = tuple(int(s) for s in a.shape)
        dtype = np.dtype(a.dtype)
        if a.size == 0:
            return cls(None, 0, shape, (0,) * len(shape), shape, dtype)
        if a.is_c_contiguous():
            return cls(a.reshape(a.size), 0, shape, _c_strides(shape), shape, dtype)
        if any(s % dtype.itemsize for s in a.strides):
            raise ValueError(f"strides {a.strides} are not multiples of the item size")
        strides = tuple(s // dtype.itemsize for s in a.strides)
        low = sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
        span = sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True)) + 1
        return cls(_memory(a, low, span), -low, shape, strides, shape, dtype)

    @property
    def ndim(self) -> int:
        """Number of axes of ``shape``."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    def reshape(self, *shape) -> StridedView:
        """The same elements in C order as ``shape`` (NumPy's reading: one -1 inferred)."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        # NumPy checks and resolves the shape on a zero-stride stand-in (nothing allocated)
        placeholder = np.broadcast_to(np.empty((), np.int8), (self.size,))
        return dataclasses.replace(self, shape=placeholder.reshape(shape).shape)

    def moveaxis(self, source, destination) -> StridedView:
        """``np.moveaxis`` of a strided view: its walk permuted."""
        # NumPy's axis handling, on a zero-size array whose shape lists the axes
        axes = np.moveaxis(np.empty(tuple(range(self.ndim))), source, destination).shape
        shape = tuple(self.shape[a] for a in axes)
        strides = tuple(self.walk_strides[a] for a in axes)
        return dataclasses.replace(self, walk_shape=shape, walk_strides=strides, shape=shape)

    def broadcast_to(self, shape) -> StridedView:
        """``np.broadcast_to`` of a strided view: stride 0 along the repeated axes."""
        shape = tuple(int(s) for s in shape)
        extra = len(shape) - self.ndim
        kept = shape[extra:] if extra >= 0 else None
        if kept is None or any(s not in (1, t) for s, t in zip(self.shape, kept, strict=True)):
            raise ValueError(f"cannot broadcast shape {self.shape} to {shape}")
        own = zip(self.shape, kept, self.walk_strides, strict=True)
        strides = (0,) * extra + tuple(st if s == t else 0 for s, t, st in own)
        return dataclasses.replace(self, walk_shape=shape, walk_strides=strides, shape=shape)

    def array(self):
        """The view as a device array of its memory, when the walk is that memory in C order;
        ``None`` otherwise.
        """
        if self.memory is None or self.offset or self.memory.size != self.size:
            return None
        expected = 1
        for n, s in zip(reversed(self.walk_shape), reversed(self.walk_strides), strict=True):
            if n > 1 and s != expected:
                return None
            expected *= n
        return self.memory.reshape(self.shape)


def _c_strides(shape: tuple) -> tuple:
    """Strides in elements of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _memory(a, low: int, count: int):
    """``count`` elements of the memory of device array ``a``, from ``low`` elements past its
    first element (``low <= 0`` with negative strides), as a 1-D device array.
    """
    if _launch.SIMULATOR:
        corner = a._ary[tuple(slice(-1, None) if s < 0 else slice(0, 1) for s in a.strides)]
        flat = np.lib.stride_tricks.as_strided(corner, (count,), (a.dtype.itemsize,))
        return _Base(flat)
    pointer = a.__cuda_array_interface__["data"][0] + low * a.dtype.itemsize
    desc = {
        "shape": (count,),
        "strides": None,
        "data": (pointer, False),
        "typestr": a.dtype.str,
        "version": 3,
    }
    return cuda.from_cuda_array_interface(desc, owner=a, sync=False)


def _materialise(view: StridedView, dtype, negate: bool = False) -> DeviceArray:
    """A new C-contiguous array of ``dtype`` holding the view's elements (negated on request)."""
    out = DEVICE.empty(view.shape, dtype)
    if view.size:
        shape, strides = (view.walk_shape, view.walk_strides) if view.walk_shape else ((1,), (0,))
        flat = out.reshape(view.size)
        args = (view.memory, view.offset, shape, strides, flat, negate)
        _launch.for_each(elementwise.gather, view.size, *args)
    return out


def _flat(a):
    """A C-contiguous device array as 1-D."""
    return a.reshape(a.size)


class NumbaDeviceBackend:
    """Device arrays (numba's, or any ``__cuda_array_interface__``); ``kernels`` are the GPU
    kernels of :mod:`softorder.core.cuda`. The methods are those of
    :class:`softorder._engine.backends.numpy_host.NumpyBackend`.
    """

    @property
    def kernels(self):
        """The GPU kernels, under the names of :mod:`softorder.core`."""
        from softorder.core import cuda as gpu

        return gpu

    def float_input(self, x, name: str):
        """``x`` as a device array (host values are copied there) and the result dtype:
        float16/32/64 kept, integers and booleans give float64, complex raises ``TypeError``.
        """
        on_device = is_device_array(x)
        arr = _launch.as_device(x) if on_device else np.asarray(x)
        kind = arr.dtype.kind
        if kind == "c":
            raise TypeError(f"{name} must be real; got a complex array of dtype {arr.dtype}")
        if kind not in "biuf":
            raise TypeError(f"{name} must be a numeric array; got dtype {arr.dtype}")
        arr = arr if on_device else self.from_host(arr)
        return arr, np.dtype(arr.dtype) if kind == "f" else np.dtype(np.float64)

    def moveaxis(self, a, source, destination) -> StridedView:
        """``np.moveaxis`` without a copy: a :class:`StridedView`."""
        return StridedView.of(a).moveaxis(source, destination)

    def contiguous_f64(self, a, negate: bool = False) -> DeviceArray:
        """An array or view (any shape) as a C-contiguous float64 array, negated on request
        (no copy when it already is one and ``negate`` is false; the rules never write it).
        """
        view = StridedView.of(a)
        same = view.array() if view.dtype == np.float64 and not negate else None
        return _wrap(same) if same is not None else _materialise(view, np.float64, negate)

    def sort_rows(self, rows2d, order=None):
        """``(xs, order)``: each row sorted ascending (NaN last) and its stable argsort, by
        the merge sort of :mod:`softorder.core.cuda.sort_rows`; with ``order`` only the gather.
        """
        xs = self.empty(rows2d.shape)
        if order is None:
            order = self.empty(rows2d.shape, np.int64)
            argsort_rows(rows2d, xs, order)
        else:
            order = self.contiguous(order, np.int64).reshape(rows2d.shape)
            take_rows(rows2d, order, xs)
        return xs, order

    def contiguous(self, a, dtype=None) -> DeviceArray:
        """``a`` (device, host or a view) as a C-contiguous device array, of ``dtype`` if
        given; no copy when it already is one.
        """
        if not is_device_array(a) and not isinstance(a, StridedView):
            return self.from_host(np.asarray(a, dtype=dtype))
        view = StridedView.of(a)
        dtype = view.dtype if dtype is None else np.dtype(dtype)
        same = view.array() if view.dtype == dtype else None
        return _wrap(same) if same is not None else _materialise(view, dtype)

    def empty(self, shape, dtype=np.float64) -> DeviceArray:
        """An uninitialized C-contiguous device array."""
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        return _wrap(_launch.empty(shape, dtype))

    def zeros(self, shape) -> DeviceArray:
        """A float64 device array of zeros."""
        return self.full(shape, 0.0)

    def full(self, shape, value: float) -> DeviceArray:
        """A float64 device array filled with ``value``."""
        out = self.empty(shape)
        scan.fill(out.reshape(1, out.size), float(value))
        return out

    def from_host(self, arr: np.ndarray) -> DeviceArray:
        """A copy of a host array (validated arguments, targets) on the device."""
        return _wrap(cuda.to_device(np.asarray(arr, order="C"), stream=_launch.stream_()))

    def tile_rows(self, row: np.ndarray, rows: int) -> DeviceArray:
        """``rows`` copies of the host vector ``row`` as (rows, len(row)): ``row`` is copied to
        the device once and repeated there.
        """
        view = StridedView.of(self.from_host(row)).broadcast_to((rows, row.shape[0]))
        return _materialise(view, view.dtype)

    def broadcast_f64(self, a, shape) -> DeviceArray:
        """``a`` broadcast to ``shape`` as a new C-contiguous float64 array (on the device)."""
        a = a if is_device_array(a) or isinstance(a, StridedView) else self.from_host(a)
        return _materialise(StridedView.of(a).broadcast_to(shape), np.float64)

    def cast(self, a, dtype) -> DeviceArray:
        """``a`` (a device array, a view or a host value) as a C-contiguous device array of
        ``dtype``, 0-d included; values beyond a narrow dtype's range become +-inf.
        """
        if not is_device_array(a) and not isinstance(a, StridedView):
            return self.from_host(numpy_host.cast(a, dtype))
        return self.contiguous(a, dtype)

    def to_result(self, value, dtype) -> DeviceArray:
        """``value`` as a result of ``dtype``; 0-d results stay 0-d device arrays."""
        return self.cast(value, dtype)

    def unbroadcast(self, grad, shape) -> DeviceArray:
        """Sum ``grad`` over the axes that broadcasting added to an argument of ``shape``.

        On the host when there is a sum to do: these are gradients of ``alpha``, ``k`` and
        ``q``, a few values per row.
        """
        if tuple(grad.shape) == tuple(shape):
            return grad
        stream = _launch.stream_()
        host = self.contiguous(grad).copy_to_host(stream=stream)  # after the kernels on it
        if not isinstance(stream, int):
            stream.synchronize()
        return self.from_host(numpy_host.unbroadcast(host, tuple(shape)))

    def negate_(self, a) -> None:
        """``a = -a`` in place (a C-contiguous float64 array)."""
        _launch.for_each(elementwise.scale, a.size, _flat(a), -1.0, _flat(a))

    def scale(self, a, factor: float) -> DeviceArray:
        """A new array ``a * factor`` (float dtypes kept, others give float64)."""
        a = self.contiguous(a)
        dtype = a.dtype if a.dtype.kind == "f" else np.dtype(np.float64)
        out = self.empty(a.shape, dtype)
        _launch.for_each(elementwise.scale, a.size, _flat(a), float(factor), _flat(out))
        return out

    def total(self, a) -> DeviceArray:
        """The sum of all elements of a float64 array, as a 0-d device array."""
        out = self.empty(1)
        scan.row_sums(self.contiguous(a).reshape(1, a.size), out)
        return out.reshape(())

    def row_dots(self, a, b) -> DeviceArray:
        """``(a * b).sum(axis=1)`` of two C-contiguous float64 (rows, n) arrays."""
        products = self.empty(a.shape)
        _launch.for_each(elementwise.multiply, a.size, _flat(a), _flat(b), _flat(products))
        out = self.empty(a.shape[0])
        scan.row_sums(products, out)
        return out

    def add_product(self, out, a, b) -> None:
        """``out += a * b`` in place (C-contiguous float64 arrays of one shape)."""
        _launch.for_each(elementwise.add_product, out.size, _flat(out), _flat(a), _flat(b))


DEVICE = NumbaDeviceBackend()


def lookup(x):
    """:data:`DEVICE` for a device array that is not a PyTorch tensor (the torch bridge has
    its own backend for those), for :func:`softorder._engine.backend.register`.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return None
    return DEVICE if is_device_array(x) else None


# --- a framework's device buffers and stream: what a bridge's device callbacks run in -------

#: numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) stands in for a GPU
SIMULATOR = _launch.SIMULATOR


@dataclasses.dataclass
class Launch:
    """The kernels' side of a framework's device buffers (anything with
    ``__cuda_array_interface__``) in one callback: the stream the kernels launch on (the
    framework's own, from :func:`launching`; 0 in the simulator) and the backend of the rules.
    """

    stream: object
    backend: NumbaDeviceBackend = DEVICE

    @staticmethod
    def wrap(buffer) -> DeviceArray:
        """A device buffer as a numba device array (no copy)."""
        return _launch.as_device(buffer)

    def arguments(self, buffers) -> list:
        """The input as a device array; the small arguments the rules validate on the host
        (alpha, k, q, labels, p_k, target_ranks) copied there, once the stream computed them.
        """
        arrays = [self.wrap(buffers[0])]
        arrays += [self.wrap(b).copy_to_host(stream=self.stream) for b in buffers[1:]]
        if self.stream and len(buffers) > 1:
            self.stream.synchronize()
        return arrays

    def write(self, out, values) -> None:
        """Copy each value into its output buffer, device to device, on the stream: cast to
        the buffer's dtype (no copy when it has it) and reshaped to its shape.
        """
        for buffer, value in zip(out, values, strict=True):
            target = self.wrap(buffer)
            value = self.backend.cast(value, target.dtype)  # C-contiguous, on the device
            if target.size:
                target.copy_to_device(value.reshape(tuple(target.shape)), stream=self.stream)


@contextlib.contextmanager
def launching(device: int, stream_handle, allocate=None):
    """Launch every kernel inside the block on GPU ``device`` and on the framework's stream
    ``stream_handle`` (a ``cudaStream_t`` as an int: XLA's compute stream, PyTorch's current
    stream), taking temporaries from ``allocate(shape, dtype)`` when given; yields the
    :class:`Launch`. In numba's simulator the kernels run on stream 0.
    """
    from softorder.core import cuda as gpu

    if SIMULATOR:
        with gpu.on_stream(0, allocate):
            yield Launch(0)
        return
    with cuda.gpus[device]:
        stream = cuda.external_stream(stream_handle)
        with gpu.on_stream(stream, allocate):
            yield Launch(stream)
