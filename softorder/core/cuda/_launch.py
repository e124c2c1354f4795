"""The one place that holds how GPU kernels are launched: block size, stream, device arrays.

* Every kernel runs ``THREADS`` threads per block, each handling ``ITEMS`` consecutive
  elements of a tile; :func:`configure` changes both (the simulator tests make them tiny so
  that a row spans several blocks).
* Every launch goes on the stream set by :func:`on_stream` (the PyTorch bridge passes
  ``torch.cuda.current_stream()``), the default stream otherwise.
* Temporaries come from :func:`empty`: from the allocator given to :func:`on_stream` (the
  PyTorch bridge gives its caching allocator), from numba's otherwise.
* :func:`device` compiles a CPU helper of :mod:`softorder.core` again as a CUDA device
  function: the scalar mathematics (Laplace CDFs, the closed-form inverse, the derivative sums
  of a target) is written once and runs on both targets.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types

import numba
import numpy as np
from numba import cuda

#: True when ``NUMBA_ENABLE_CUDASIM=1``: kernels run in numba's Python simulator.
SIMULATOR = bool(numba.config.ENABLE_CUDASIM)

_config = {"threads": 256, "items": 4}
_state = threading.local()


def configure(threads: int | None = None, items: int | None = None) -> dict:
    """Set threads per block (a power of two) and elements per thread, at least two elements
    per block; returns the previous setting as a dict that can be passed back
    (``configure(**previous)``).

    256 x 4: a 1000-element row is one block (one launch per scan, no carries), and a
    1e7-element row is 9766 blocks whose carries take two more levels of the same scan.

    Examples
    --------
    >>> from softorder.core import cuda as gpu  # needs numba-cuda, not a GPU
    >>> previous = gpu.configure(threads=4, items=2)  # what the simulator tests use
    >>> gpu.configure(**previous)
    {'threads': 4, 'items': 2}
    """
    previous = dict(_config)
    threads = previous["threads"] if threads is None else threads
    items = previous["items"] if items is None else items
    if threads < 1 or threads & (threads - 1):
        raise ValueError(f"threads must be a power of two; got {threads}")
    if items < 1:
        raise ValueError(f"items must be positive; got {items}")
    if threads * items < 2:
        # a one-element tile leaves a scan's tile totals as long as the row: the scan of the
        # carries (affine_scan) would recurse on them forever
        raise ValueError("threads * items must be at least 2; got 1 x 1")
    _config["threads"], _config["items"] = int(threads), int(items)
    return previous


def threads() -> int:
    return _config["threads"]


def items() -> int:
    return _config["items"]


def tile() -> int:
    """Elements of one row that one block covers."""
    return _config["threads"] * _config["items"]


def tiles(n: int) -> int:
    return max(1, -(-n // tile()))


@contextlib.contextmanager
def on_stream(stream, allocate=None):
    """Launch every kernel inside the block on ``stream`` (a numba stream), and take
    temporaries from ``allocate(shape, dtype)`` when given (see :func:`empty`).

    Examples
    --------
    >>> from softorder.core import cuda as gpu
    >>> from softorder.core.cuda import _launch
    >>> with gpu.on_stream(0):  # on a GPU: numba.cuda.external_stream(handle), for instance
    ...     _launch.stream_()
    0
    """
    previous = (stream_(), getattr(_state, "allocate", None))
    _state.stream, _state.allocate = stream, allocate
    try:
        yield
    finally:
        _state.stream, _state.allocate = previous


def stream_():
    """The stream kernels launch on now (0: the default stream)."""
    return getattr(_state, "stream", 0)


def for_each(kernel, total: int, *args) -> None:
    """Launch an elementwise ``kernel`` with one thread per index in ``range(total)``."""
    if total <= 0:
        return
    block = _config["threads"]
    kernel[-(-total // block), block, stream_()](*args)


def per_tile(kernel, rows: int, n: int, *args) -> None:
    """Launch ``kernel`` with one block per (row, tile): ``rows * tiles(n)`` blocks, numbered
    tile-fastest along the grid's x axis (up to 2**31 - 1 blocks; its y axis would cap a
    batch at 65535 rows).
    """
    if rows <= 0 or n <= 0:
        return
    kernel[rows * tiles(n), _config["threads"], stream_()](*args)


def as_device(obj):
    """A numba device array viewing ``obj`` (anything with ``__cuda_array_interface__``:
    numba device arrays, CuPy arrays, PyTorch CUDA tensors), without a copy.

    Under the simulator, host arrays (NumPy, CPU tensors) stand in for device memory.
    """
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        if isinstance(obj, FakeCUDAArray):
            return obj
        if hasattr(obj, "numpy"):  # a CPU tensor
            obj = obj.detach().numpy()
        return FakeCUDAArray(np.asarray(obj))
    if isinstance(obj, cuda.devicearray.DeviceNDArray):
        return obj
    if cuda.is_cuda_array(obj):
        return cuda.as_cuda_array(obj, sync=False)
    raise TypeError(
        "expected a device array (an object with __cuda_array_interface__); "
        f"got {type(obj).__name__}: host arrays go to the CPU kernels of softorder.core"
    )


def empty(shape, dtype=np.float64):
    """An uninitialized device array for a temporary of one call: from the allocator given to
    :func:`on_stream` (a bridge's caching allocator), from numba's otherwise.
    """
    allocate = getattr(_state, "allocate", None)
    if allocate is None:
        return cuda.device_array(tuple(shape), dtype=np.dtype(dtype), stream=stream_())
    return as_device(allocate(tuple(shape), np.dtype(dtype)))


def entry(launcher):
    """A public launcher that accepts any device arrays (``__cuda_array_interface__``) for
    its array arguments, as the core's GPU entry point.
    """

    @functools.wraps(launcher)
    def run(*args):
        return launcher(*(_device_or_value(a) for a in args))

    return run


def _device_or_value(arg):
    if isinstance(arg, (bool, int, float, np.generic)):
        return arg
    return as_device(arg)


#: Type names for kernel signatures.
F1, F2, F3 = "float64[:]", "float64[:, :]", "float64[:, :, :]"
I1, I2 = "int64[:]", "int64[:, :]"

#: Every kernel's Python function and a signature to compile it for a real GPU without one
#: (``numba.cuda.compile_ptx``; tests/gpu/test_ptx.py), by qualified name.
KERNELS: dict = {}


def kernel(*types_: str):
    """Register a CUDA kernel (compiled lazily, at its first launch) with the argument types
    that the PTX tests compile it for.
    """

    def wrap(fn):
        KERNELS[f"{fn.__module__}.{fn.__qualname__}"] = (fn, f"void({', '.join(types_)})")
        return cuda.jit(fn)

    return wrap


def device(helper):
    """The CUDA device-function twin of a CPU helper (an ``njit`` dispatcher or a plain
    function): the same Python source, with the helpers it calls replaced by their twins.
    """
    fn = getattr(helper, "py_func", helper)
    return _twin(fn)


@functools.cache
def _twin(fn):
    env = dict(fn.__globals__)
    for name in fn.__code__.co_names:
        value = env.get(name)
        if isinstance(value, numba.core.registry.CPUDispatcher):
            env[name] = device(value)
    clone = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__doc__ = fn.__doc__
    return cuda.jit(device=True)(clone)
