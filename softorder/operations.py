"""The NumPy API: soft top-k, rank, sort, quantile, permutation and the two losses.

Every operation acts along ``axis`` (default -1); all other axes are batch axes. Results have
the input's floating dtype (integer input gives float64). ``alpha`` is the scale of the Laplace
distribution, in the units of ``x``: scaling ``x`` and ``alpha`` together leaves ranks and
memberships unchanged; small ``alpha`` approaches the hard operation. ``alpha`` is a scalar or
one per row: an array broadcastable to the batch shape (``x``'s shape without ``axis``), or
one with ``x``'s number of axes and length 1 along ``axis`` (NumPy's ``keepdims`` shape, e.g.
``x.std(axis, keepdims=True)``); its gradient has the shape it was given in. Gradients come
from :func:`softorder.vjp` and :func:`softorder.jvp` (or the PyTorch / JAX bridges).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from softorder._engine.autodiff import operation
from softorder._engine.rules import (
    PermutationCrossEntropyRule,
    PermutationRule,
    QuantileRule,
    RankRule,
    SortRule,
    TopKCrossEntropyRule,
    TopKRule,
)


@operation(TopKRule(log=False))
def soft_topk(
    x: ArrayLike, k: ArrayLike, alpha: float = 1.0, *, axis: int = -1, largest: bool = True
) -> np.ndarray:
    """Soft top-k memberships: how much each element belongs to the k largest (or smallest).

    For ``largest=False``: ``p_i = F((b - x_i) / alpha)`` with ``b`` solving
    ``sum_i F((b - x_i) / alpha) = k`` in closed form (LapSum, sections 4-5), ``F`` the Laplace
    CDF. ``largest=True`` applies this to ``-x``. Memberships lie in (0, 1) and sum to ``k``
    exactly; as ``alpha -> 0`` they become the 0/1 indicator of the top k.

    Parameters
    ----------
    x : array_like
        Scores; any shape, real.
    k : float or array_like
        Number of elements to select, strictly between 0 and n (need not be an integer).
        A scalar, or an array broadcastable to the batch shape (``x`` without ``axis``) for one
        k per row. To ask for several k per row in one call, give ``k`` one more trailing axis
        (shape ``batch + (m,)``, or ``(1,) * batch_ndim + (m,)``): the result then gets an axis
        of length m just before ``axis``.
    alpha : float or array_like
        Positive scale, in the units of ``x``: a scalar, or one per row (an array
        broadcastable to the batch shape).
    axis : int
        Axis along which to select.
    largest : bool
        Select the largest (default) or the smallest k.

    Returns
    -------
    ndarray
        Memberships, shaped like ``x`` (with the extra k axis for several k per row).

    Raises
    ------
    ValueError
        ``alpha`` not positive and finite, ``k`` outside (0, n), an empty axis, a ``k`` that
        does not broadcast.
    TypeError
        Complex or non-numeric input.

    Notes
    -----
    A row containing NaN gives NaN for that row only. Infinite entries are handled as the
    limit of very large values: with ``largest=True`` a ``-inf`` entry gets membership 0
    (and a ``+inf`` entry 1) whenever k leaves room for it, so ``-inf`` is a safe padding
    value; gradients with respect to infinite entries are 0.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> x = np.array([3.0, 1.0, 2.0, -5.0])
    >>> p = softorder.soft_topk(x, 2, alpha=0.01)
    >>> p.round(3), float(p.sum())
    (array([1., 0., 1., 0.]), 2.0)
    >>> softorder.soft_topk(x, [1, 2], alpha=0.5).shape  # several k per row in one call
    (2, 4)
    """


@operation(TopKRule(log=True))
def log_soft_topk(
    x: ArrayLike, k: ArrayLike, alpha: float = 1.0, *, axis: int = -1, largest: bool = True
) -> np.ndarray:
    """Logarithm of :func:`soft_topk`, computed without underflow (for cross-entropies).

    ``log p_i = log F((b - x_i) / alpha)`` with the stable log-CDF; elements far outside the
    top k get large negative values instead of ``-inf``, and finite gradients.

    Parameters
    ----------
    x, k, alpha, axis, largest
        As for :func:`soft_topk`.

    Returns
    -------
    ndarray
        Log-memberships, shaped like :func:`soft_topk`'s result.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> logp = softorder.log_soft_topk(np.array([0.0, 2000.0]), 1, alpha=1.0)
    >>> logp.round(3)
    array([-1000.693,    -0.   ])
    """


@operation(RankRule())
def soft_rank(
    x: ArrayLike, alpha: float = 1.0, *, axis: int = -1, descending: bool = False
) -> np.ndarray:
    """Soft ranks, 1-based like ``scipy.stats.rankdata``.

    ``rank_i = 1/2 + sum_j F((x_i - x_j) / alpha)``: values in (1/2, n + 1/2), summing to
    ``n (n + 1) / 2``; ties get equal ranks (the average rank as ``alpha -> 0``).
    ``descending=True`` gives ``n + 1 - rank``.

    Parameters
    ----------
    x : array_like
        Values; any shape, real.
    alpha : float or array_like
        Positive scale, in the units of ``x``: a scalar, or one per row (an array
        broadcastable to the batch shape).
    axis : int
        Axis along which to rank.
    descending : bool
        Rank 1 for the largest instead of the smallest value.

    Returns
    -------
    ndarray
        Ranks, shaped like ``x``.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> softorder.soft_rank(np.array([0.5, -1.0, 3.0]), alpha=0.01)
    array([2., 1., 3.])
    """


@operation(SortRule())
def soft_sort(
    x: ArrayLike, alpha: float = 1.0, *, axis: int = -1, descending: bool = False
) -> np.ndarray:
    """Soft sort: ``s_k = S^-1(k - 1/2)``, the points where the soft rank would be ``k``.

    Non-decreasing along ``axis`` (non-increasing with ``descending``), equal to ``np.sort``
    as ``alpha -> 0``.

    Parameters
    ----------
    x : array_like
        Values; any shape, real.
    alpha : float or array_like
        Positive scale, in the units of ``x``: a scalar, or one per row (an array
        broadcastable to the batch shape).
    axis : int
        Axis to sort along.
    descending : bool
        Largest first.

    Returns
    -------
    ndarray
        Soft-sorted values, shaped like ``x``.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> softorder.soft_sort(np.array([2.0, -1.0, 0.5]), alpha=0.001)
    array([-1. ,  0.5,  2. ])
    """


@operation(QuantileRule())
def soft_quantile(x: ArrayLike, q: ArrayLike, alpha: float = 1.0, *, axis: int = -1) -> np.ndarray:
    """Soft quantile: ``S^-1(q n)``, the point below which a soft fraction q of ``x`` lies.

    As ``alpha -> 0`` it becomes ``np.quantile(x, q, method="averaged_inverted_cdf")``.

    Parameters
    ----------
    x : array_like
        Values; any shape, real.
    q : float or array_like
        Probability strictly between 0 and 1. A scalar or an array broadcastable to the batch
        shape (one q per row); with one more trailing axis (``batch + (m,)``, or
        ``(1,) * batch_ndim + (m,)``) it lists m quantiles per row, and the result has an axis
        of length m in place of ``axis``.
    alpha : float or array_like
        Positive scale, in the units of ``x``: a scalar, or one per row (an array
        broadcastable to the batch shape).
    axis : int
        Axis along which to take quantiles; it is removed (or replaced by the q axis).

    Returns
    -------
    ndarray
        Quantiles, with ``axis`` removed (or replaced by the q axis).

    Examples
    --------
    >>> import numpy as np, softorder
    >>> x = np.array([4.0, 1.0, 3.0, 2.0])
    >>> round(float(softorder.soft_quantile(x, 0.5, alpha=1e-3)), 6)
    2.5
    >>> softorder.soft_quantile(x, [0.25, 0.75], alpha=1e-3).round(6)
    array([1.5, 3.5])
    """


@operation(PermutationRule())
def soft_permutation(
    x: ArrayLike, alpha: float = 1.0, *, axis: int = -1, descending: bool = False
) -> np.ndarray:
    """Soft permutation matrix ``P`` with ``P @ x`` a soft sort of ``x``.

    ``P[k, i] = F((b_(k+1) - x_i) / alpha) - F((b_k - x_i) / alpha)`` with ``b_k = S^-1(k)``,
    ``b_0 = -inf``, ``b_n = +inf``: doubly stochastic for every alpha, the hard permutation
    matrix of ``np.argsort`` as ``alpha -> 0``. The result is n x n per row; the losses built
    on it (:func:`permutation_cross_entropy`) never form it. ``P @ x`` averages ``x`` with
    each row's weights; it is not :func:`soft_sort`'s result (the inverse of the Lap-sum at
    the ranks), which it meets only as ``alpha -> 0``.

    Parameters
    ----------
    x : array_like
        Values; any shape, real.
    alpha : float or array_like
        Positive scale, in the units of ``x``: a scalar, or one per row (an array
        broadcastable to the batch shape).
    axis : int
        Axis to sort along. The two matrix axes are placed last: the result has shape
        ``batch + (n, n)`` where ``batch`` is ``x``'s shape without ``axis``.
    descending : bool
        Rows of ``P`` from the largest element to the smallest.

    Returns
    -------
    ndarray
        ``P`` of shape ``batch + (n, n)``: row k is the soft indicator of the element of rank k.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> x = np.array([0.2, -3.0, 1.0])
    >>> P = softorder.soft_permutation(x, alpha=0.01)
    >>> P.round(3)
    array([[0., 1., 0.],
           [1., 0., 0.],
           [0., 0., 1.]])
    >>> (P @ x).round(3)
    array([-3. ,  0.2,  1. ])
    """


@operation(TopKCrossEntropyRule())
def topk_cross_entropy(
    logits: ArrayLike,
    labels: ArrayLike,
    p_k: ArrayLike,
    alpha: float = 1.0,
    *,
    reduction: str = "mean",
    split_top1: bool = False,
) -> np.ndarray:
    """Top-k cross-entropy (Petersen et al., ICML 2022, eq. 2) on LapSum memberships.

    ``loss = -log sum_k P_K(k) p^(k)_y`` with ``p^(k) = soft_topk(logits, k, alpha)``: the
    cross-entropy of "the label is among the top k" with k drawn from ``P_K``. With
    ``split_top1=True`` the k = 1 share uses the softmax instead (eq. 4):
    ``P_K(1) softmax_CE - (1 - P_K(1)) log sum_(k>=2) P_K(k) p^(k)_y``.

    Parameters
    ----------
    logits : array_like
        Scores of shape ``(..., C)``; classes along the last axis. ``-inf`` masks a class.
    labels : array_like of int
        True classes in ``[0, C)``, shape ``(...)``.
    p_k : array_like
        ``P_K(k)`` for k = 1..K (K < C) along the last axis, non-negative, summing to 1;
        shape ``(K,)`` or broadcastable to ``(..., K)``.
    alpha : float or array_like
        Positive scale, in the units of the logits: a scalar, or one per row (an array
        broadcastable to the batch shape).
    reduction : {"mean", "sum", "none"}
        How to combine the per-sample losses.
    split_top1 : bool
        Use the softmax for the k = 1 share (eq. 4 of the paper).

    Returns
    -------
    ndarray
        The loss: a scalar, or shape ``(...)`` for ``reduction="none"``.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> logits = np.array([[2.0, 1.0, 0.1, -1.0], [0.0, 3.0, 1.0, 2.0]])
    >>> labels = np.array([1, 0])
    >>> p_k = [0.5, 0.5]  # "in the top 1" and "in the top 2" weigh equally
    >>> softorder.topk_cross_entropy(logits, labels, p_k, alpha=0.5, reduction="none").round(4)
    array([0.7257, 4.2676])
    """


@operation(PermutationCrossEntropyRule())
def permutation_cross_entropy(
    x: ArrayLike,
    target_ranks: ArrayLike,
    alpha: float = 1.0,
    *,
    reduction: str = "mean",
    descending: bool = False,
) -> np.ndarray:
    """Permutation cross-entropy ``-sum_i log P[t_i - 1, i]`` of :func:`soft_permutation`.

    Needs only two boundaries ``b_(t_i - 1)``, ``b_(t_i)`` per element: O(n log n) time, O(n)
    memory, no n x n matrix, for the value and the gradients.

    Parameters
    ----------
    x : array_like
        Scores of shape ``(..., n)``, ranked along the last axis.
    target_ranks : array_like of int
        The true 1-based rank of each element (1 = smallest, or the largest with
        ``descending``), same shape as ``x``; e.g.
        ``scipy.stats.rankdata(true_scores, method="ordinal", axis=-1)``.
    alpha : float or array_like
        Positive scale, in the units of ``x``: a scalar, or one per row (an array
        broadcastable to the batch shape).
    reduction : {"mean", "sum", "none"}
        How to combine the per-row losses.
    descending : bool
        Rank 1 is the largest score.

    Returns
    -------
    ndarray
        The loss: a scalar, or shape ``(...)`` for ``reduction="none"``.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> x = np.array([[0.1, 2.0, -1.0]])
    >>> good = softorder.permutation_cross_entropy(x, [[2, 3, 1]], alpha=0.1)
    >>> bad = softorder.permutation_cross_entropy(x, [[1, 2, 3]], alpha=0.1)
    >>> bool(good < bad)
    True
    """
