"""One entry point for every method: relaxed permutations, top-k memberships and the losses.

``method`` is one of :data:`METHODS` (the baselines) or ``"lapsum"``, which is routed to the
PyTorch bridge ``softorder.bridges.torch`` (its ``alpha`` is the temperature). Each method's
temperature is its own paper's parameter (see each function); ``None`` means 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from softorder.baselines._common import Temperature, check_scores, check_temperature
from softorder.baselines.networks import sorting_network
from softorder.baselines.sinkhorn import (
    log_sinkhorn_sort,
    log_soft_topk_ot,
    log_sorted_soft_topk_ot,
    sorted_soft_topk_all_anchors,
)
from softorder.baselines.softmax_sorts import log_neuralsort, log_softsort

#: The baseline methods, by name: every one gives top-k memberships; all but
#: ``"soft_topk_ot"`` also give a relaxed permutation matrix.
METHODS = (
    "neuralsort",
    "softsort",
    "sinkhorn",
    "soft_topk_ot",
    "sorted_soft_topk_ot",
    "odd_even_network",
    "bitonic_network",
)
#: The methods with a relaxed permutation matrix (all but SOFT top-k).
PERMUTATION_METHODS = tuple(m for m in METHODS if m != "soft_topk_ot")
#: ``"lapsum"`` (through ``softorder.bridges.torch``) and the baselines.
ALL_METHODS = ("lapsum", *METHODS)
DEFAULT_TEMPERATURE = 1.0


def _check_method(method: str, allowed: tuple[str, ...]) -> None:
    if method not in allowed:
        raise ValueError(f"method must be one of {allowed}, got {method!r}")


def _temperature(temperature: Temperature | None) -> Temperature:
    return check_temperature(DEFAULT_TEMPERATURE if temperature is None else temperature)


def _bridge() -> Any:
    import softorder.bridges.torch as sot

    return sot


def _tiny_log(p: torch.Tensor) -> torch.Tensor:
    """``log p`` for a matrix built in linear space; underflowed entries get log(tiny)."""
    return torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))


def _permutation(
    x: torch.Tensor,
    method: str,
    temperature: Temperature,
    descending: bool,
    rows: int | None,
    options: dict[str, Any],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(log P, P)`` with one of them possibly ``None`` (whichever the method builds)."""
    if method == "neuralsort":
        return log_neuralsort(x, temperature, descending=descending, rows=rows, **options), None
    if method == "softsort":
        return log_softsort(x, temperature, descending=descending, rows=rows, **options), None
    if method == "sinkhorn":
        log_p = log_sinkhorn_sort(x, temperature, descending=descending, **options)
        return (log_p if rows is None else log_p[..., :rows, :]), None
    if method == "sorted_soft_topk_ot":
        # The paper's operator for the first ``rows`` ranks (its own OT problem, not rows of
        # the full one); k = n - 1 gives the full matrix, the last anchor's column the last row.
        n = check_scores(x)
        if rows is None or rows >= n:
            return sorted_soft_topk_all_anchors(
                x, n - 1, temperature, largest=descending, **options
            ), None
        return log_sorted_soft_topk_ot(x, rows, temperature, largest=descending, **options), None
    if method == "lapsum":
        p = _bridge().soft_permutation(x, temperature, descending=descending, **options)
        return None, (p if rows is None else p[..., :rows, :])
    network = method.removesuffix("_network")
    return None, sorting_network(
        x, temperature, network=network, descending=descending, rows=rows, **options
    )


def relaxed_permutation(
    x: torch.Tensor,
    method: str,
    temperature: Temperature | None = None,
    *,
    descending: bool = False,
    rows: int | None = None,
    **options: Any,
) -> torch.Tensor:
    """Relaxed permutation matrix ``P`` (rows: ranks, columns: elements) of any method.

    ``P @ x`` approximates ``sort(x)``; see the method's own function for its properties:
    :func:`~softorder.baselines.neuralsort`, :func:`~softorder.baselines.softsort`
    (row stochastic), :func:`~softorder.baselines.sinkhorn_sort` (rows exact, columns at
    convergence), :func:`~softorder.baselines.sorting_network` (doubly stochastic), and
    LapSum's ``soft_permutation`` (doubly stochastic).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order).
    method : str
        One of :data:`PERMUTATION_METHODS` or ``"lapsum"``.
    temperature : float or 0-d torch.Tensor, optional
        The method's temperature (LapSum: ``alpha``); 1.0 by default.
    descending : bool
        Row 0 is the largest score (else the smallest).
    rows : int, optional
        Only the first ``rows`` rows (computed alone where the method allows it).
    **options
        Passed to the method (``n_iter`` for ``"sinkhorn"``).

    Returns
    -------
    torch.Tensor
        Shape ``(..., rows, n)``.

    Raises
    ------
    ValueError
        An unknown method, or the method's own argument errors.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import relaxed_permutation
    >>> x = torch.tensor([0.0, 3.0, 1.0])
    >>> relaxed_permutation(x, "softsort", 0.01, descending=True, rows=2).round(decimals=3)
    tensor([[0., 1., 0.],
            [0., 0., 1.]])
    """
    _check_method(method, ("lapsum", *PERMUTATION_METHODS))
    log_p, p = _permutation(x, method, _temperature(temperature), descending, rows, options)
    return p if p is not None else log_p.exp()


def _memberships(
    x: torch.Tensor,
    K: int,
    method: str,
    temperature: Temperature,
    options: dict[str, Any],
    *,
    log: bool,
) -> torch.Tensor:
    """Memberships (or their logs) in the top k = 1..K, shape ``(..., K, n)``."""
    n = check_scores(x)
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K < n:
        raise ValueError(f"K must be an int in [1, n) = [1, {n}), got {K!r}")
    ks = torch.arange(1, K + 1, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], K)
    if method == "soft_topk_ot":
        rows = x.unsqueeze(-2).expand(*x.shape[:-1], K, n)
        log_m = log_soft_topk_ot(rows, ks, temperature, **options)
        return log_m if log else log_m.exp()
    if method == "lapsum":
        sot = _bridge()
        return (sot.log_soft_topk if log else sot.soft_topk)(x, ks, temperature, **options)
    log_p, p = _permutation(x, method, temperature, True, K, options)
    if log_p is not None:
        log_m = torch.logcumsumexp(log_p, dim=-2)
        return log_m if log else log_m.exp()
    m = torch.cumsum(p, dim=-2)
    return _tiny_log(m) if log else m


def topk_memberships(
    x: torch.Tensor,
    K: int,
    method: str,
    temperature: Temperature | None = None,
    **options: Any,
) -> torch.Tensor:
    """Soft membership of every element in the top k (largest), for k = 1..K, by any method.

    For the permutation methods, membership in the top k is the sum of the first k rows of the
    descending relaxed permutation matrix, ``m^(k)_j = sum_(i <= k) P[i, j]`` (DiffTopK paper,
    eq. 2); only the first K rows are computed where the method allows it. ``"soft_topk_ot"``
    solves one two-anchor transport problem per k; ``"lapsum"`` calls the bridge's
    ``soft_topk`` with all K values of k at once. Every method's rows sum to ``k`` (its
    permutation matrix is row stochastic); they lie in ``[0, 1]`` when its matrix is column
    stochastic too (not so for NeuralSort and SoftSort).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, selected along the last axis.
    K : int
        Largest k, ``1 <= K < n``.
    method : str
        One of :data:`ALL_METHODS`.
    temperature : float or 0-d torch.Tensor, optional
        The method's temperature (LapSum: ``alpha``); 1.0 by default.
    **options
        Passed to the method (``n_iter`` for the Sinkhorn methods).

    Returns
    -------
    torch.Tensor
        Shape ``(..., K, n)``: row ``k - 1`` holds the memberships in the top k.

    Raises
    ------
    ValueError
        An unknown method, ``K`` out of range, or the method's own argument errors.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import topk_memberships
    >>> x = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    >>> topk_memberships(x, 2, "odd_even_network", 0.01)
    tensor([[[0., 0., 0., 1.],
             [1., 0., 0., 1.]]])
    >>> topk_memberships(x, 3, "neuralsort", 1.0).sum(-1)  # rows sum to k
    tensor([[1., 2., 3.]])
    """
    _check_method(method, ALL_METHODS)
    return _memberships(x, K, method, _temperature(temperature), options, log=False)


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f'reduction must be "mean", "sum" or "none", got {reduction!r}')


def _check_labels(labels: torch.Tensor, shape: torch.Size, size: int, name: str) -> None:
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {labels.dtype}")
    if labels.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(labels.shape)}")
    if labels.numel() and not bool(((labels >= 0) & (labels < size)).all()):
        raise ValueError(f"{name} must lie in [0, {size}), got values outside")


def _top_m_subset(
    logits: torch.Tensor, labels: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``m`` largest logits with the true class among them, and its position there."""
    index = logits.topk(m, dim=-1).indices  # (..., m), descending
    present = (index == labels[..., None]).any(-1)
    last = torch.where(present, index[..., -1], labels)
    index = torch.cat((index[..., :-1], last[..., None]), dim=-1)
    position = (index == labels[..., None]).to(torch.int64).argmax(-1)
    return logits.gather(-1, index), position


def topk_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    p_k: Sequence[float] | torch.Tensor,
    *,
    method: str,
    temperature: Temperature | None = None,
    reduction: str = "mean",
    split_top1: bool = False,
    top_m: int | None = None,
    **options: Any,
) -> torch.Tensor:
    """Top-k cross-entropy with k ~ P_K (Petersen et al., ICML 2022, eqs. 2 and 4), any method.

    ``loss = -log sum_k P_K(k) m^(k)_y`` with ``m^(k) = topk_memberships(logits, K, method)``,
    evaluated in log space (``logsumexp`` of ``log P_K(k) + log m^(k)_y``; the row-softmax and
    Sinkhorn methods give ``log m`` without underflow, the sorting networks from their linear
    matrix, floored at the smallest normal float). With ``split_top1=True`` the k = 1 share uses
    the softmax instead (eq. 4):
    ``P_K(1) softmax_CE - (1 - P_K(1)) log sum_(k>=2) P_K(k) m^(k)_y``.
    ``method="lapsum"`` calls ``softorder.bridges.torch.topk_cross_entropy``.

    With ``top_m`` (the DiffTopK paper's subset trick, m = 16 or 50 for 1000 classes), the
    memberships are computed only among the ``top_m`` largest logits of each sample, the true
    class always among them (it replaces the m-th largest when it is not); the softmax share of
    ``split_top1`` still uses every logit. That equals the full loss up to the influence of the
    classes left out, which vanishes as they fall below the m-th logit by many temperatures.

    Parameters
    ----------
    logits : torch.Tensor
        Scores of shape ``(..., C)``; classes along the last axis.
    labels : torch.Tensor
        Integer classes in ``[0, C)``, shape ``(...)``.
    p_k : sequence of float or torch.Tensor
        ``P_K(k)`` for k = 1..K (K < C), non-negative, summing to 1; shape ``(K,)`` or
        broadcastable to ``(..., K)``.
    method : str
        One of :data:`ALL_METHODS`.
    temperature : float or 0-d torch.Tensor, optional
        The method's temperature (LapSum: ``alpha``); 1.0 by default.
    reduction : {"mean", "sum", "none"}
        How to combine the per-sample losses.
    split_top1 : bool
        Use the softmax for the k = 1 share (eq. 4 of the paper).
    top_m : int, optional
        Relax only the ``top_m`` largest logits (``K < top_m <= C``); all by default.
    **options
        Passed to the method (``n_iter``, ``tol`` and ``grad`` for the Sinkhorn methods).

    Returns
    -------
    torch.Tensor
        The loss: a scalar, or shape ``(...)`` for ``reduction="none"``.

    Raises
    ------
    TypeError
        Labels that are not integers.
    ValueError
        An unknown method or reduction, labels of the wrong shape or out of range, ``p_k``
        negative, not summing to 1, or with ``K >= C``, or ``top_m`` not in ``(K, C]``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import topk_cross_entropy
    >>> logits = torch.tensor([[2.0, 1.0, 0.1, -1.0], [0.0, 3.0, 1.0, 2.0]])
    >>> labels = torch.tensor([1, 0])
    >>> loss = topk_cross_entropy(logits, labels, [0.5, 0.5], method="softsort",
    ...                           temperature=0.5, reduction="none")
    >>> loss.round(decimals=4)
    tensor([0.7017, 4.6833])
    """
    _check_method(method, ALL_METHODS)
    temperature = _temperature(temperature)
    c = check_scores(logits, "logits")
    p_k = torch.as_tensor(p_k, dtype=logits.dtype, device=logits.device)
    if p_k.ndim < 1 or not 1 <= p_k.shape[-1] < c:
        raise ValueError(
            f"p_k needs 1 <= K < C = {c} entries along its last axis, got shape {tuple(p_k.shape)}"
        )
    if bool((p_k < 0).any()) or not torch.allclose(
        p_k.sum(-1), torch.ones((), dtype=p_k.dtype, device=p_k.device), atol=1e-6
    ):
        raise ValueError("p_k must be non-negative and sum to 1 over its last axis")
    _check_labels(labels, logits.shape[:-1], c, "labels")
    big_k = p_k.shape[-1]
    if top_m is not None and (
        isinstance(top_m, bool) or not isinstance(top_m, int) or not big_k < top_m <= c
    ):
        raise ValueError(f"top_m must be an int in (K, C] = ({big_k}, {c}], got {top_m!r}")
    if method == "lapsum" and top_m is None:  # per-sample losses from the bridge
        loss = _bridge().topk_cross_entropy(
            logits, labels, p_k, temperature, reduction="none", split_top1=split_top1
        )
        return _reduce(loss, reduction)
    relaxed, relaxed_labels = logits, labels
    if top_m is not None and top_m < c:
        relaxed, relaxed_labels = _top_m_subset(logits, labels, top_m)
    log_m = _memberships(relaxed, big_k, method, temperature, options, log=True)
    index = relaxed_labels[..., None, None].expand(*labels.shape, big_k, 1)
    log_m_y = log_m.gather(-1, index).squeeze(-1)  # (..., K)
    log_p_k = torch.log(p_k)
    if not split_top1:
        loss = -torch.logsumexp(log_p_k + log_m_y, dim=-1)
        return _reduce(loss, reduction)
    softmax_ce = -torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    w1 = p_k[..., 0]
    has_rest = (p_k[..., 1:] > 0).any(-1)
    safe_log_p = torch.where(has_rest[..., None], log_p_k[..., 1:], 0.0)
    rest = -torch.logsumexp(safe_log_p + log_m_y[..., 1:], dim=-1)
    loss = w1 * softmax_ce + torch.where(has_rest, (1 - w1) * rest, 0.0)
    return _reduce(loss, reduction)


def permutation_cross_entropy(
    x: torch.Tensor,
    target_ranks: torch.Tensor,
    *,
    method: str,
    temperature: Temperature | None = None,
    reduction: str = "mean",
    descending: bool = False,
    **options: Any,
) -> torch.Tensor:
    """Permutation cross-entropy ``-sum_i log P[t_i - 1, i]`` of any method's relaxed ``P``.

    The row-wise cross-entropy against the true permutation matrix (the loss of the NeuralSort
    and LapSum sorting experiments). Uses ``log P`` without underflow for the row-softmax and
    Sinkhorn methods; the sorting networks' ``P`` is floored at the smallest normal float.
    ``method="lapsum"`` calls ``softorder.bridges.torch.permutation_cross_entropy``, which needs
    no ``n x n`` matrix.

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, ranked along the last axis.
    target_ranks : torch.Tensor
        The true 1-based rank of each element (1 = smallest, or the largest with
        ``descending``), integers of the shape of ``x``.
    method : str
        One of :data:`PERMUTATION_METHODS` or ``"lapsum"``.
    temperature : float or 0-d torch.Tensor, optional
        The method's temperature (LapSum: ``alpha``); 1.0 by default.
    reduction : {"mean", "sum", "none"}
        How to combine the per-row losses.
    descending : bool
        Rank 1 is the largest score.
    **options
        Passed to the method (``n_iter`` for ``"sinkhorn"``).

    Returns
    -------
    torch.Tensor
        The loss: a scalar, or shape ``(...)`` for ``reduction="none"``.

    Raises
    ------
    TypeError
        Ranks that are not integers.
    ValueError
        An unknown method or reduction, ranks of the wrong shape or outside ``[1, n]``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import permutation_cross_entropy
    >>> x = torch.tensor([[0.0, 3.0, 1.0]])
    >>> ranks = torch.tensor([[1, 3, 2]])
    >>> permutation_cross_entropy(x, ranks, method="neuralsort", temperature=0.1)
    tensor(9.0835e-05)
    """
    _check_method(method, ("lapsum", *PERMUTATION_METHODS))
    temperature = _temperature(temperature)
    n = check_scores(x)
    _check_labels(target_ranks - 1, x.shape, n, "target_ranks - 1")
    if method == "lapsum":  # per-row losses from the bridge, reduced here like the others
        loss = _bridge().permutation_cross_entropy(
            x, target_ranks, temperature, reduction="none", descending=descending
        )
        return _reduce(loss, reduction)
    log_p, p = _permutation(x, method, temperature, descending, None, options)
    if log_p is None:
        log_p = _tiny_log(p)
    picked = log_p.gather(-2, (target_ranks - 1).unsqueeze(-2)).squeeze(-2)  # (..., n)
    return _reduce(-picked.sum(-1), reduction)
