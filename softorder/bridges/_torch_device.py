"""PyTorch tensors on a GPU as a backend of the rules (:mod:`softorder._engine.backend`): ``torch``
operations for the layout (moving axes, casting, sorting with ``torch.sort``), the numba-cuda
kernels of :mod:`softorder.core.cuda` for the mathematics, on the tensor's device and on
``torch.cuda.current_stream()``, with temporaries from PyTorch's caching allocator.

Nothing here touches host memory but the small validated arguments (``alpha``, ``k``, ``q``,
labels, ``p_k``), which the rules check on the host and then copy to the device.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from softorder._engine import backend as _backend

_TORCH = {
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.int64): torch.int64,
}


def _torch_dtype(dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else _TORCH[np.dtype(dtype)]


class TorchDeviceBackend:
    """Tensors of one device; ``kernels`` are the GPU kernels, launched on its current stream."""

    kernels: _Kernels  # (set per instance)

    def __init__(self, device: torch.device):
        from softorder._engine.backends import numba_cuda  # needs numba-cuda

        self.device = device
        self._numba_cuda = numba_cuda
        self._gpu = numba_cuda.DEVICE.kernels
        self.kernels = _Kernels(self)

    def launching(self):
        """The context of every kernel call: this device's current stream and allocator."""
        simulated = self._numba_cuda.SIMULATOR
        handle = None if simulated else torch.cuda.current_stream(self.device).cuda_stream
        allocate = functools.partial(_allocate, self.device)
        return self._numba_cuda.launching(self.device.index or 0, handle, allocate)

    def float_input(self, x, name: str):
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x), device=self.device)
        if x.is_complex():
            raise TypeError(f"{name} must be real; got a complex tensor of dtype {x.dtype}")
        return x, x.dtype if x.is_floating_point() else torch.float64

    def moveaxis(self, a, source, destination):
        return torch.movedim(a, source, destination)

    def contiguous_f64(self, a, negate: bool = False):
        a = a.to(torch.float64)
        return (-a if negate else a).contiguous()

    def sort_rows(self, rows2d, order=None):
        if order is None:
            xs, order = torch.sort(rows2d, dim=1)  # NaN last, as NumPy sorts
            return xs.contiguous(), order.contiguous()
        order = torch.as_tensor(order, device=self.device).to(torch.int64)
        order = order.reshape(rows2d.shape).contiguous()
        return torch.gather(rows2d, 1, order), order

    def contiguous(self, a):
        return torch.as_tensor(a, device=self.device).contiguous()

    def empty(self, shape, dtype=np.float64):
        return torch.empty(shape, dtype=_torch_dtype(dtype), device=self.device)

    def zeros(self, shape):
        return torch.zeros(shape, dtype=torch.float64, device=self.device)

    def full(self, shape, value: float):
        shape = (shape,) if isinstance(shape, int) else shape
        return torch.full(shape, value, dtype=torch.float64, device=self.device)

    def from_host(self, arr: np.ndarray):
        return torch.tensor(arr, device=self.device)  # a copy: host arrays may be read-only

    def tile_rows(self, row: np.ndarray, rows: int):
        return self.from_host(row).expand(rows, row.shape[0]).contiguous()

    def broadcast_f64(self, a, shape):
        a = torch.as_tensor(a, device=self.device).to(torch.float64)
        return a.expand(tuple(shape)).contiguous()

    def cast(self, a, dtype):
        return torch.as_tensor(a, device=self.device).to(_torch_dtype(dtype))

    def to_result(self, value, dtype):
        return self.cast(value, dtype)

    def unbroadcast(self, grad, shape):
        extra = grad.dim() - len(shape)
        grad = grad.sum(dim=tuple(range(extra))) if extra > 0 else grad
        dims = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
        return grad.sum(dim=dims, keepdim=True) if dims else grad

    def negate_(self, a) -> None:
        a.neg_()

    def scale(self, a, factor: float):
        return a * factor

    def total(self, a):
        return a.sum()

    def row_dots(self, a, b):
        return (a * b).sum(dim=1)

    def add_product(self, out, a, b) -> None:
        out.add_(a * b)


def _allocate(device, shape, dtype):
    return torch.empty(shape, dtype=_torch_dtype(dtype), device=device)


class _Kernels:
    """The GPU kernels under the names of :mod:`softorder.core`, run in the backend's context."""

    def __init__(self, backend: TorchDeviceBackend):
        self._backend = backend

    def __getattr__(self, name: str):
        launcher = getattr(self._backend._gpu, name)

        def run(*args):
            with self._backend.launching():
                launcher(*args)

        return run


@functools.cache
def backend_for(device: torch.device) -> TorchDeviceBackend:
    """The backend of one device (made once)."""
    return TorchDeviceBackend(device)


def device_type_lookup(device_type: str):
    """A lookup for :func:`softorder._engine.backend.register`: tensors on devices of this type."""

    def lookup(x):
        if isinstance(x, torch.Tensor) and x.device.type == device_type:
            return backend_for(x.device)
        return None

    return lookup


CUDA = device_type_lookup("cuda")
_backend.register(CUDA)
