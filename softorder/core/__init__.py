"""numba kernels on C-contiguous 2-D ``(rows, n)`` arrays: no framework imports here.

Conventions shared by every kernel:

* ``xs`` is float64, each row sorted ascending (NaN last, as NumPy sorts), ``order`` (int64)
  the argsort that produced it. Sorting happens outside the kernels (NumPy's SIMD sort is
  several times faster than a sort inside ``njit``).
* ``alpha`` is a float64 array with one value per row.
* Outputs are float64 arrays the caller allocates; element-indexed outputs and cotangents are in
  the caller's original element order. Inputs are never written.
* A row whose sorted values contain NaN produces NaN outputs and leaves other rows untouched.
* Scratch memory comes from the caller as a ``work`` array of shape ``(rows, W, n)`` (and a
  ``twork`` of shape ``(rows, T, m)`` for per-target scratch), with ``W``/``T`` given by the
  ``*_WORK`` constants of each module; :func:`workspace` allocates one. Large fresh allocations
  inside numba page-fault on every call (about 3 ms per 8 MB here) while NumPy's are cheap,
  which at n = 1e6 decided whether a gradient cost 3x or 7x a sort.
"""

import numpy as np

from softorder.core._jit import set_parallel
from softorder.core.lapsum import inverse_kernel, lapsum_kernel
from softorder.core.permutation import (
    permutation_forward,
    permutation_jvp,
    permutation_loss_forward,
    permutation_loss_vjp,
    permutation_vjp,
)
from softorder.core.rank import rank_forward, rank_jvp, rank_vjp
from softorder.core.rows import take_rows
from softorder.core.sort import inverse_jvp, inverse_vjp
from softorder.core.topk import topk_forward, topk_jvp, topk_vjp
from softorder.core.topk_loss import topk_loss_forward, topk_loss_vjp


def workspace(rows: int, width: int, length: int) -> np.ndarray:
    """Uninitialized float64 scratch of shape ``(rows, width, length)`` for one kernel call."""
    return np.empty((rows, width, max(length, 1)))


__all__ = [
    "workspace",
    "inverse_jvp",
    "inverse_kernel",
    "inverse_vjp",
    "lapsum_kernel",
    "permutation_forward",
    "permutation_jvp",
    "permutation_loss_forward",
    "permutation_loss_vjp",
    "permutation_vjp",
    "rank_forward",
    "rank_jvp",
    "rank_vjp",
    "set_parallel",
    "take_rows",
    "topk_forward",
    "topk_jvp",
    "topk_loss_forward",
    "topk_loss_vjp",
    "topk_vjp",
]
