"""Entropic optimal-transport relaxations: Sinkhorn sort and SOFT top-k.

* Sinkhorn sort (Cuturi, Teboul & Vert, NeurIPS 2019): transport the n scores (mass 1/n each)
  onto n sorted anchors (mass 1/n each) with squared-distance cost and entropy ``epsilon``;
  ``P = n Gamma^T`` is a relaxed permutation matrix (doubly stochastic at convergence).
* SOFT top-k (Xie et al., NeurIPS 2020, sec. 2): transport the n scores onto the two anchors
  {0, 1} with masses ``(n - k) / n`` and ``k / n``; the memberships are ``A = n Gamma[:, 1]``
  (the paper's smallest-k form applied to the largest, by symmetry).

Both run a fixed number of log-domain Sinkhorn iterations (Cuturi 2013; Benamou et al. 2015)
and are differentiated by autograd through the iterations, as Cuturi et al. and the DiffTopK
paper do (Xie et al. derive an implicit O(n) backward instead; with two anchors autograd is
O(n) per iteration too). The last iteration projects on the anchors' marginal, so every rank
row of ``P`` sums to 1 exactly and the SOFT memberships sum to ``k`` exactly; the other marginal
is reached only at convergence (as ``n_iter`` grows).

Anchors are one unit apart (ranks ``0..n-1`` for the sort, ``{0, 1}`` for top-k) and the scores
are used unscaled (Cuturi et al. squash them into [0, 1] first; we do not, so ``epsilon`` is in
the units of ``x`` squared, as for the other methods). With a squared cost
``(x_i - y_j)^2 = x_i^2 - 2 x_i y_j + y_j^2`` the squares are absorbed by the dual potentials,
so the plan depends on ``x`` only through ``2 (x_i - mean(x)) y_j / epsilon``: the iterations use
that reduced cost, which avoids the huge magnitudes of the full one. Hence the SOFT top-k
memberships are logistic, ``A_i = sigmoid((2 x_i - t) / epsilon)`` with ``t`` such that they
sum to ``k``: a logistic scale of ``epsilon / 2`` in the units of ``x``.
"""

from __future__ import annotations

import math

import torch

from softorder.baselines._common import (
    Temperature,
    check_iterations,
    check_scores,
    check_temperature,
)


def _log_sinkhorn(
    log_kernel: torch.Tensor, log_mu: torch.Tensor, log_nu: torch.Tensor, n_iter: int
) -> torch.Tensor:
    """Log transport plan for ``exp(log_kernel)`` with marginals ``mu`` (rows), ``nu`` (columns).

    ``log_kernel`` has shape ``(..., n, m)``; the result has the same shape and its column sums
    are ``nu`` exactly (the last projection), its row sums ``mu`` at convergence.
    """
    v = torch.zeros_like(log_kernel[..., 0, :])
    u = torch.zeros_like(log_kernel[..., :, 0])
    for _ in range(n_iter):
        u = log_mu - torch.logsumexp(log_kernel + v.unsqueeze(-2), dim=-1)
        v = log_nu - torch.logsumexp(log_kernel + u.unsqueeze(-1), dim=-2)
    return u.unsqueeze(-1) + log_kernel + v.unsqueeze(-2)


def log_sinkhorn_sort(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    descending: bool = False,
    n_iter: int = 100,
) -> torch.Tensor:
    """Logarithm of :func:`sinkhorn_sort`, from the log-domain iterations (no underflow).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order).
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0``.
    descending : bool
        Row 0 is the largest score (else the smallest).
    n_iter : int
        Number of Sinkhorn iterations.

    Returns
    -------
    torch.Tensor
        ``log P`` of shape ``(..., n, n)``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import log_sinkhorn_sort
    >>> log_sinkhorn_sort(torch.tensor([0.0, 3.0, 1.0]), 0.1).exp().round(decimals=3)
    tensor([[0.9950, 0.0000, 0.0050],
            [0.0000, 0.0000, 1.0000],
            [0.0000, 1.0000, 0.0000]])
    """
    n = check_scores(x)
    check_temperature(temperature)
    check_iterations(n_iter)
    scores = -x if descending else x
    scores = scores - scores.mean(-1, keepdim=True)
    anchors = torch.arange(n, dtype=x.dtype, device=x.device) - (n - 1) / 2
    log_kernel = 2 * scores.unsqueeze(-1) * anchors / temperature  # (..., element, rank)
    log_mass = torch.full_like(scores, -math.log(n))
    log_plan = _log_sinkhorn(log_kernel, log_mass, log_mass, n_iter)
    return (log_plan + math.log(n)).transpose(-1, -2)


def sinkhorn_sort(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    descending: bool = False,
    n_iter: int = 100,
) -> torch.Tensor:
    """Sinkhorn (optimal-transport) sort: relaxed permutation matrix (Cuturi et al., 2019).

    Entropic optimal transport ``min <C, Gamma> + epsilon sum Gamma log Gamma`` between the
    scores (mass 1/n each) and the sorted anchors ``0, 1, ..., n-1`` (mass 1/n each), cost
    ``C_ij = (x_i - y_j)^2``, solved by ``n_iter`` Sinkhorn iterations in the log domain;
    ``P = n Gamma^T`` (rows: ranks, columns: elements). Rows sum to 1 exactly; columns sum
    to 1 at convergence. As ``epsilon -> 0`` (and ``n_iter -> inf``) it tends to the
    permutation matrix of the sort. Time ``O(n^2 n_iter)``; autograd keeps every iteration,
    so memory is ``O(n^2 n_iter)`` too. See the module docstring for the scaling choices.

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order); leading
        axes are batch axes.
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0``; the matrix is as sharp as a logistic of
        scale ``epsilon / 2`` in the units of ``x``. A tensor may require grad.
    descending : bool
        Row 0 is the largest score (else the smallest).
    n_iter : int
        Number of Sinkhorn iterations (each a row and a column projection). Small
        temperatures need more.

    Returns
    -------
    torch.Tensor
        ``P`` of shape ``(..., n, n)``.

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        Fewer than 2 elements, a temperature that is not positive, or ``n_iter < 1``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import sinkhorn_sort
    >>> x = torch.tensor([0.0, 3.0, 1.0], dtype=torch.float64)
    >>> (sinkhorn_sort(x, 0.1, n_iter=300) @ x).round(decimals=2)
    tensor([0., 1., 3.], dtype=torch.float64)
    >>> p = sinkhorn_sort(x, 2.0, n_iter=200)
    >>> p.sum(-1).round(decimals=6), p.sum(-2).round(decimals=6)  # doubly stochastic
    (tensor([1., 1., 1.], dtype=torch.float64), tensor([1., 1., 1.], dtype=torch.float64))
    """
    return log_sinkhorn_sort(x, temperature, descending=descending, n_iter=n_iter).exp()


def _log_soft_topk_ot(
    x: torch.Tensor, k: torch.Tensor, temperature: Temperature, n_iter: int
) -> torch.Tensor:
    """Log SOFT memberships (largest) of ``x`` ``(..., n)`` for ``k`` of shape ``(...)``."""
    n = x.shape[-1]
    scores = x - x.mean(-1, keepdim=True)
    zero = torch.zeros_like(scores)
    log_kernel = torch.stack((zero, 2 * scores / temperature), dim=-1)  # anchors 0 and 1
    log_mu = torch.full_like(scores, -math.log(n))
    log_nu = torch.stack((torch.log((n - k) / n), torch.log(k / n)), dim=-1)
    log_plan = _log_sinkhorn(log_kernel, log_mu, log_nu, n_iter)
    return log_plan[..., 1] + math.log(n)


def _k_tensor(k: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    k = torch.as_tensor(k, dtype=x.dtype, device=x.device)
    if k.numel() and not bool(((k > 0) & (k < n)).all()):
        raise ValueError(f"k must lie in (0, n) = (0, {n}), got {k}")
    try:
        return torch.broadcast_to(k, x.shape[:-1])
    except RuntimeError:
        raise ValueError(
            f"k of shape {tuple(k.shape)} does not broadcast to the batch shape "
            f"{tuple(x.shape[:-1])}"
        ) from None


def log_soft_topk_ot(
    x: torch.Tensor,
    k: float | torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    largest: bool = True,
    n_iter: int = 100,
) -> torch.Tensor:
    """Logarithm of :func:`soft_topk_ot`, from the log-domain iterations (no underflow).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, selected along the last axis.
    k : float or torch.Tensor
        Number of elements to select, in ``(0, n)``; a tensor broadcastable to ``x.shape[:-1]``.
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0``.
    largest : bool
        Select the largest (else the smallest) elements.
    n_iter : int
        Number of Sinkhorn iterations.

    Returns
    -------
    torch.Tensor
        Log memberships, shape of ``x``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import log_soft_topk_ot
    >>> log_soft_topk_ot(torch.tensor([0.0, 3.0, 1.0]), 1, 0.1).exp().round(decimals=3)
    tensor([0.0000, 0.9990, 0.0010])
    """
    check_scores(x)
    check_temperature(temperature)
    check_iterations(n_iter)
    return _log_soft_topk_ot(x if largest else -x, _k_tensor(k, x), temperature, n_iter)


def soft_topk_ot(
    x: torch.Tensor,
    k: float | torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    largest: bool = True,
    n_iter: int = 100,
) -> torch.Tensor:
    """SOFT top-k memberships: entropic OT onto two anchors (Xie et al., NeurIPS 2020, sec. 2).

    Transports the scores (mass 1/n each) onto the anchors ``{0, 1}`` with masses
    ``(n - k) / n`` and ``k / n`` and cost ``(x_i - y_j)^2``, entropy ``epsilon``; returns
    ``A = n Gamma[:, 1]``, which sums to ``k`` exactly and lies in ``[0, 1]`` at convergence.
    The paper's form selects the smallest k (anchor 0 gets mass ``k / n``); this is the same
    operator on ``-x``. As ``epsilon -> 0`` (and ``n_iter -> inf``) it tends to the 0/1
    indicator of the top k. Cost ``O(n n_iter)`` time and memory.

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, selected along the last axis; leading axes are batch axes.
    k : float or torch.Tensor
        Number of elements to select, in ``(0, n)`` (need not be an integer); a tensor
        broadcastable to ``x.shape[:-1]`` gives one per row.
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0``: memberships are logistic of scale
        ``epsilon / 2`` in the units of ``x`` (module docstring). A tensor may require grad.
    largest : bool
        Select the largest (else the smallest) elements.
    n_iter : int
        Number of Sinkhorn iterations. Small temperatures need more.

    Returns
    -------
    torch.Tensor
        Memberships, shape of ``x``.

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        Fewer than 2 elements, ``k`` outside ``(0, n)`` or not broadcastable, a temperature
        that is not positive, or ``n_iter < 1``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import soft_topk_ot
    >>> x = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    >>> soft_topk_ot(x, 2, 0.1).round(decimals=3)
    tensor([1., 0., 0., 1.], dtype=torch.float64)
    >>> a = soft_topk_ot(x, 2, 2.0)
    >>> a.round(decimals=3), round(float(a.sum()), 12)
    (tensor([0.6970, 0.1030, 0.3390, 0.8620], dtype=torch.float64), 2.0)
    """
    return log_soft_topk_ot(x, k, temperature, largest=largest, n_iter=n_iter).exp()
