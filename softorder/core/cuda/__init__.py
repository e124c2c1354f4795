"""The GPU kernels (numba-cuda): the same functions, arguments and outputs as
:mod:`softorder.core`, on device arrays.

Every function here accepts, for each array argument, any object with
``__cuda_array_interface__`` (numba device arrays, CuPy arrays, PyTorch CUDA tensors) and
writes its outputs into the device arrays it is given, on the stream set by
:func:`on_stream` (the default stream otherwise). As on the CPU, each row of ``xs`` is sorted
ascending (NaN last) by the caller, with ``order`` its argsort: a framework's device sort
(``torch.sort``) is faster than any sort written here. Host arrays raise ``TypeError``.

The PyTorch bridge calls these through the same rules as the NumPy API
(:mod:`softorder._engine.rules`), so ``softorder.bridges.torch`` operations on CUDA tensors
run here.

Importing this module needs the ``numba-cuda`` package (``pip install "softorder[cuda]"``);
launching a kernel needs a GPU, or ``NUMBA_ENABLE_CUDASIM=1`` (numba's simulator, set before
numba is imported).
"""

from softorder.core.cuda import lapsum, permutation, rank, sort, topk, topk_loss
from softorder.core.cuda._launch import SIMULATOR, configure, entry, on_stream

inverse_kernel = entry(lapsum.inverse_kernel)
lapsum_kernel = entry(lapsum.lapsum_kernel)
inverse_vjp = entry(sort.inverse_vjp)
inverse_jvp = entry(sort.inverse_jvp)
rank_forward = entry(rank.rank_forward)
rank_vjp = entry(rank.rank_vjp)
rank_jvp = entry(rank.rank_jvp)
topk_forward = entry(topk.topk_forward)
topk_vjp = entry(topk.topk_vjp)
topk_jvp = entry(topk.topk_jvp)
topk_loss_forward = entry(topk_loss.topk_loss_forward)
topk_loss_vjp = entry(topk_loss.topk_loss_vjp)
permutation_forward = entry(permutation.permutation_forward)
permutation_vjp = entry(permutation.permutation_vjp)
permutation_jvp = entry(permutation.permutation_jvp)
permutation_loss_forward = entry(permutation.permutation_loss_forward)
permutation_loss_vjp = entry(permutation.permutation_loss_vjp)

__all__ = [
    "SIMULATOR",
    "configure",
    "inverse_jvp",
    "inverse_kernel",
    "inverse_vjp",
    "lapsum_kernel",
    "on_stream",
    "permutation_forward",
    "permutation_jvp",
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
