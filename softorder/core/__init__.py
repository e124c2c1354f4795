"""numba kernels on C-contiguous 2-D ``(rows, n)`` arrays: no framework imports here.

Conventions shared by every kernel:

* ``xs`` is float64, each row sorted ascending (NaN last, as NumPy sorts), ``order`` (int64)
  the argsort that produced it. Sorting happens outside the kernels (NumPy's SIMD sort is
  several times faster than a sort inside ``njit``).
* ``alpha`` is a float64 array with one value per row.
* Outputs are float64 arrays the caller allocates; element-indexed outputs and cotangents are in
  the caller's original element order. Inputs are never written.
* A row whose sorted values contain NaN produces NaN outputs and leaves other rows untouched.
"""

from softorder.core.lapsum import inverse_kernel, lapsum_kernel
from softorder.core.permutation import (
    permutation_forward,
    permutation_loss_forward,
    permutation_loss_vjp,
    permutation_vjp,
)
from softorder.core.rank import rank_forward, rank_jvp, rank_vjp
from softorder.core.sort import inverse_jvp, inverse_vjp
from softorder.core.topk import topk_forward, topk_jvp, topk_vjp
from softorder.core.topk_loss import topk_loss_forward, topk_loss_vjp

__all__ = [
    "inverse_jvp",
    "inverse_kernel",
    "inverse_vjp",
    "lapsum_kernel",
    "permutation_forward",
    "permutation_loss_forward",
    "permutation_loss_vjp",
    "permutation_vjp",
    "rank_forward",
    "rank_jvp",
    "rank_vjp",
    "topk_forward",
    "topk_jvp",
    "topk_loss_forward",
    "topk_loss_vjp",
    "topk_vjp",
]
