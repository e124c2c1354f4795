"""softorder: differentiable top-k, rank, sort, permutation and quantile (LapSum, ICML 2025).

>>> import numpy as np, softorder
>>> softorder.soft_rank(np.array([0.5, -1.0, 3.0]), alpha=0.01)
array([2., 1., 3.])
"""

from softorder._engine.autodiff import jvp, vjp
from softorder._engine.scratch import set_scratch_limit
from softorder._precompile import precompile
from softorder._version import __version__
from softorder.operations import (
    log_soft_topk,
    permutation_cross_entropy,
    soft_permutation,
    soft_quantile,
    soft_rank,
    soft_sort,
    soft_topk,
    topk_cross_entropy,
)

__all__ = [
    "__version__",
    "jvp",
    "log_soft_topk",
    "permutation_cross_entropy",
    "precompile",
    "set_scratch_limit",
    "soft_permutation",
    "soft_quantile",
    "soft_rank",
    "soft_sort",
    "soft_topk",
    "topk_cross_entropy",
    "vjp",
]
