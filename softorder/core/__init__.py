"""numba kernels on C-contiguous 2-D ``(rows, n)`` arrays: no framework imports here.

Conventions shared by every kernel:

* ``xs`` is float64, each row sorted ascending (NaN last, as NumPy sorts), ``order`` (int32
  or int64) the argsort that produced it. Sorting happens outside the kernels, in NumPy's SIMD
  sort of keys that carry each value's index (:func:`~softorder.core.rows.pack_sort_keys`,
  :func:`~softorder.core.rows.unpack_sorted`; several times faster than a sort inside
  ``njit``), except in compiled callers that cannot call NumPy (the JAX bridge's FFI
  handlers): those sort with :mod:`softorder.core.sort_rows`.
* ``alpha`` is a float64 array with one value per row.
* Outputs are float64 arrays the caller allocates; element-indexed outputs and cotangents are in
  the caller's original element order. Inputs are never written.
* A row whose sorted values contain NaN produces NaN outputs and leaves other rows untouched.
* Scratch memory comes from the caller as a ``work`` array of shape ``(rows, W, n)`` (and a
  ``twork`` of shape ``(rows, T, m)`` for per-target scratch), with ``W``/``T`` the module
  constants each kernel's docstring names (``TABLES``, ``FORWARD_WORK``, ...);
  :func:`workspace` allocates one. Large fresh allocations inside numba page-fault on every
  call while NumPy's are cheap, which at n = 1e6 costs more than the kernels' own work
  (figures in CHANGELOG.md).
* The kernels trust the shapes they are given: numba checks no bounds, so an output or a
  scratch array smaller than its docstring says is written past its end, which corrupts the
  process's memory. The NumPy API and the bridges allocate them; a caller of the kernels must
  allocate them as documented.
"""

import importlib

import numpy as np

from softorder.core._jit import cache_dir, set_parallel

#: Where each kernel is defined. The kernel modules (and numba) are imported on first use,
#: not with softorder: ``import softorder`` stays light (numba alone takes ~0.1 s to import).
_KERNELS = {
    "inverse_kernel": "lapsum",
    "lapsum_kernel": "lapsum",
    "permutation_forward": "permutation",
    "permutation_jvp": "permutation",
    "permutation_loss_forward": "permutation",
    "permutation_loss_vjp": "permutation",
    "permutation_vjp": "permutation",
    "rank_forward": "rank",
    "rank_jvp": "rank",
    "rank_vjp": "rank",
    "rank_vjp_narrow": "rank",
    "take_rows": "rows",
    "pack_sort_keys": "rows",
    "unpack_sorted": "rows",
    "sort_rows_again": "rows",
    "inverse_jvp": "sort",
    "inverse_vjp": "sort",
    "few_inverse_vjp": "sort",
    "topk_forward": "topk",
    "topk_jvp": "topk",
    "topk_vjp": "topk",
    "topk_vjp_narrow": "topk",
    "topk_loss_forward": "topk_loss",
    "topk_loss_vjp": "topk_loss",
}
_MODULES = frozenset(
    ("kernel_sums", "laplace", "lapsum", "permutation", "rank", "rows", "sort", "topk")
    + ("sort_rows", "topk_loss", "cuda")
)


def __getattr__(name: str):
    if name in _KERNELS:
        value = getattr(importlib.import_module(f"softorder.core.{_KERNELS[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"softorder.core.{name}")
    else:
        raise AttributeError(f"module 'softorder.core' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_KERNELS) | _MODULES)


def workspace(rows: int, width: int, length: int) -> np.ndarray:
    """Uninitialized float64 scratch of shape ``(rows, width, length)`` for one kernel call."""
    return np.empty((rows, width, max(length, 1)))


__all__ = [
    "cache_dir",
    "workspace",
    *_KERNELS,
    "set_parallel",
]
