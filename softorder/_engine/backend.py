"""Where a call's arrays live and which kernels run on them: the choice of a backend.

The rules (:mod:`softorder._engine.rules`) and the shape handling
(:mod:`softorder._engine.layout`) are written once against one small interface, implemented
by the backends of :mod:`softorder._engine.backends` (the
:class:`~softorder._engine.backends.protocol.Backend` protocol): :data:`NUMPY` keeps arrays in host
memory and runs the CPU kernels of :mod:`softorder.core`; device arrays of any framework
(``__cuda_array_interface__``) go to
the numba device backend, loaded the first time one is seen; a bridge registers a backend for
its own device arrays (the PyTorch bridge does for CUDA tensors). Small arguments that must be
validated (``alpha``, ``k``, ``q``, labels, ``p_k``) are always validated in host memory and
moved with the backend's ``from_host``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from softorder._engine.backends.numpy_host import (
    NUMPY,
    NumpyBackend,
    cast,
    float_array,
    host_array,
    unbroadcast,
)
from softorder._engine.backends.protocol import Backend

__all__ = [
    "NUMPY",
    "Backend",
    "NumpyBackend",
    "backend_of",
    "cast",
    "float_array",
    "host_array",
    "register",
    "unbroadcast",
    "unregister",
]

_lookups: list = []


def register(lookup: Callable[[Any], Backend | None]) -> None:
    """Consult ``lookup(x) -> backend or None`` (before NumPy) for each input ``x``."""
    if lookup not in _lookups:
        _lookups.insert(0, lookup)


def unregister(lookup) -> None:
    """Stop consulting ``lookup``."""
    if lookup in _lookups:
        _lookups.remove(lookup)


def backend_of(x) -> Backend:
    """The backend for an input ``x``: the first registered lookup's answer, or NumPy.

    A device array (``__cuda_array_interface__``) loads the numba device backend (and
    registers its lookup) the first time one is seen.
    """
    for lookup in _lookups:
        backend = lookup(x)
        if backend is not None:
            return backend
    if type(x) is np.ndarray:  # never a device array (the common case: no attribute lookups)
        return NUMPY
    if not _device_backend_loaded and _is_device_array(x):
        _load_device_backend()
        return backend_of(x)
    return NUMPY


_device_backend_loaded = False


def _load_device_backend() -> None:
    global _device_backend_loaded
    try:
        from softorder._engine.backends import numba_cuda
    except ImportError as error:
        raise ImportError(
            "softorder runs device arrays (__cuda_array_interface__) on its GPU kernels, "
            "which need numba-cuda: pip install 'softorder[cuda]'"
        ) from error
    register(numba_cuda.lookup)
    _device_backend_loaded = True


def _is_device_array(x) -> bool:
    try:
        if hasattr(x, "__cuda_array_interface__"):
            return True
    except Exception:  # e.g. a sharded JAX array: not one device array
        return False
    # numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) stands host arrays in for device arrays
    simulated = sys.modules.get("numba.cuda.simulator.cudadrv.devicearray")
    return simulated is not None and isinstance(x, simulated.FakeCUDAArray)
