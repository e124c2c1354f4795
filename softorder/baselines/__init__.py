"""Baseline differentiable sorting and top-k methods in PyTorch, for comparisons with LapSum.

Each method follows its paper; all act along the last axis with leading batch axes and take
a ``temperature`` (the paper's own parameter, in the units of the scores):

* :func:`neuralsort` (Grover et al., 2019) and :func:`softsort` (Prillo & Eisenschlos, 2020):
  row-softmax relaxed permutation matrices (row stochastic).
* :func:`sinkhorn_sort` (Cuturi et al., 2019): entropic optimal transport onto sorted anchors.
* :func:`soft_topk_ot` (Xie et al., 2020): SOFT top-k, entropic OT onto two anchors, and
  :func:`sorted_soft_topk_ot` (its appendix B): the top k each at its rank, onto k + 1 anchors.
* :func:`sorting_network` (Petersen et al., 2021): odd-even and bitonic differentiable
  sorting networks with logistic comparators (doubly stochastic).

One entry point covers them all (and LapSum, via ``softorder.bridges.torch``):
:func:`topk_memberships`, :func:`relaxed_permutation`, :func:`topk_cross_entropy` (the DiffTopK
loss, eqs. 2 and 4 of Petersen et al., 2022) and :func:`permutation_cross_entropy`.

>>> import torch
>>> from softorder import baselines
>>> baselines.METHODS  # doctest: +NORMALIZE_WHITESPACE
('neuralsort', 'softsort', 'sinkhorn', 'soft_topk_ot', 'sorted_soft_topk_ot',
 'odd_even_network', 'bitonic_network')
>>> x = torch.tensor([2.0, -1.0, 0.5, 3.0])
>>> baselines.topk_memberships(x, 2, "bitonic_network", 0.01).round(decimals=3)
tensor([[0., 0., 0., 1.],
        [1., 0., 0., 1.]])
"""

from softorder.baselines.api import (
    ALL_METHODS,
    DEFAULT_TEMPERATURE,
    METHODS,
    PERMUTATION_METHODS,
    permutation_cross_entropy,
    relaxed_permutation,
    topk_cross_entropy,
    topk_memberships,
)
from softorder.baselines.networks import sorting_network
from softorder.baselines.sinkhorn import (
    log_sinkhorn_sort,
    log_soft_topk_ot,
    log_sorted_soft_topk_ot,
    sinkhorn_sort,
    soft_topk_ot,
    sorted_soft_topk_ot,
)
from softorder.baselines.softmax_sorts import log_neuralsort, log_softsort, neuralsort, softsort

__all__ = [
    "ALL_METHODS",
    "DEFAULT_TEMPERATURE",
    "METHODS",
    "PERMUTATION_METHODS",
    "log_neuralsort",
    "log_sinkhorn_sort",
    "log_soft_topk_ot",
    "log_sorted_soft_topk_ot",
    "log_softsort",
    "neuralsort",
    "permutation_cross_entropy",
    "relaxed_permutation",
    "sinkhorn_sort",
    "soft_topk_ot",
    "sorted_soft_topk_ot",
    "softsort",
    "sorting_network",
    "topk_cross_entropy",
    "topk_memberships",
]
