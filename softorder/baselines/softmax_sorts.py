"""NeuralSort (Grover et al., ICLR 2019) and SoftSort (Prillo & Eisenschlos, ICML 2020).

Both relax the permutation matrix of a descending sort row by row with a softmax, so their
matrices are row stochastic (each row sums to 1) but only approximately column stochastic.
Both are defined row-wise, so the top ``rows`` rows cost ``O(rows * n)`` after an ``O(n^2)``
(NeuralSort) or ``O(n log n)`` (SoftSort) preamble, as the DiffTopK paper (Petersen et al.,
ICML 2022, sec. 3.1) notes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from softorder.baselines._common import (
    Temperature,
    check_rows,
    check_scores,
    check_temperature,
)


def _neuralsort_logits(x: torch.Tensor, temperature: Temperature, rows: int) -> torch.Tensor:
    """Descending NeuralSort logits ``((n + 1 - 2i) x_j - sum_l |x_j - x_l|) / tau``."""
    n = x.shape[-1]
    spread = (x.unsqueeze(-1) - x.unsqueeze(-2)).abs().sum(-1)  # (..., n): A_x 1
    scale = n + 1 - 2 * torch.arange(1, rows + 1, dtype=x.dtype, device=x.device)
    return (scale.unsqueeze(-1) * x.unsqueeze(-2) - spread.unsqueeze(-2)) / temperature


def _softsort_logits(x: torch.Tensor, temperature: Temperature, rows: int) -> torch.Tensor:
    """Descending SoftSort logits ``-|sort(x)_i - x_j| / tau`` for the first ``rows`` ranks."""
    top = torch.sort(x, dim=-1, descending=True).values[..., :rows]
    return -(top.unsqueeze(-1) - x.unsqueeze(-2)).abs() / temperature


def _log_row_softmax(
    logits: Callable[[torch.Tensor, Temperature, int], torch.Tensor],
    x: torch.Tensor,
    temperature: Temperature,
    descending: bool,
    rows: int | None,
) -> torch.Tensor:
    """Check the arguments, then the log-softmax over elements of descending ``logits``."""
    n = check_scores(x)
    check_temperature(temperature)
    rows = check_rows(rows, n)
    scores = x if descending else -x
    return torch.log_softmax(logits(scores, temperature, rows), dim=-1)


def log_neuralsort(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    descending: bool = False,
    rows: int | None = None,
) -> torch.Tensor:
    """Logarithm of :func:`neuralsort`, computed as a log-softmax (no underflow).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order).
    temperature : float or 0-d torch.Tensor
        The softmax temperature ``tau > 0``.
    descending : bool
        Row 0 is the largest score (else the smallest).
    rows : int, optional
        Compute only the first ``rows`` rows (ranks); all ``n`` by default.

    Returns
    -------
    torch.Tensor
        Shape ``(..., rows, n)``; ``logsumexp`` over the last axis is 0.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import log_neuralsort
    >>> log_neuralsort(torch.tensor([0.0, 3.0, 1.0]), 0.1, rows=1).exp().round(decimals=3)
    tensor([[1., 0., 0.]])
    """
    return _log_row_softmax(_neuralsort_logits, x, temperature, descending, rows)


def neuralsort(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    descending: bool = False,
    rows: int | None = None,
) -> torch.Tensor:
    """NeuralSort relaxed permutation matrix (Grover et al., ICLR 2019, Theorem 4).

    For descending order, row ``i`` (1-based) is
    ``softmax(((n + 1 - 2 i) x - A_x 1) / tau)`` with ``A_x[j, l] = |x_j - x_l|``: unimodal and
    row stochastic; columns sum to 1 only approximately. As ``tau -> 0`` it tends to the
    permutation matrix ``P`` with ``P @ x = sort(x)``. Ascending order applies the descending
    form to ``-x``. Cost ``O(n^2)`` time and memory.

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order); leading
        axes are batch axes.
    temperature : float or 0-d torch.Tensor
        The softmax temperature ``tau > 0`` (in the units of ``x``); a tensor may require grad.
    descending : bool
        Row 0 is the largest score (else the smallest).
    rows : int, optional
        Compute only the first ``rows`` rows, e.g. the top-k rows; all ``n`` by default.

    Returns
    -------
    torch.Tensor
        ``P`` of shape ``(..., rows, n)``: rows are ranks, columns are elements.

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        Fewer than 2 elements, a temperature that is not positive, or ``rows`` out of range.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import neuralsort
    >>> x = torch.tensor([0.0, 3.0, 1.0])
    >>> (neuralsort(x, 0.01) @ x).round(decimals=3)  # ascending by default
    tensor([0., 1., 3.])
    >>> neuralsort(x, 1.0, descending=True).sum(-1).round(decimals=6)  # row stochastic
    tensor([1., 1., 1.])
    """
    return log_neuralsort(x, temperature, descending=descending, rows=rows).exp()


def log_softsort(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    descending: bool = False,
    rows: int | None = None,
) -> torch.Tensor:
    """Logarithm of :func:`softsort`, computed as a log-softmax (no underflow).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order).
    temperature : float or 0-d torch.Tensor
        The softmax temperature ``tau > 0``.
    descending : bool
        Row 0 is the largest score (else the smallest).
    rows : int, optional
        Compute only the first ``rows`` rows (ranks); all ``n`` by default.

    Returns
    -------
    torch.Tensor
        Shape ``(..., rows, n)``; ``logsumexp`` over the last axis is 0.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import log_softsort
    >>> log_softsort(torch.tensor([0.0, 3.0, 1.0]), 0.1, rows=1).exp().round(decimals=3)
    tensor([[1., 0., 0.]])
    """
    return _log_row_softmax(_softsort_logits, x, temperature, descending, rows)


def softsort(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    descending: bool = False,
    rows: int | None = None,
) -> torch.Tensor:
    """SoftSort relaxed permutation matrix (Prillo & Eisenschlos, ICML 2020, eq. 1).

    For descending order ``P = softmax_rows(-|sort(x)_desc 1^T - 1 x^T| / tau)``: row ``i`` is a
    softmax of the distances of every element to the ``i``-th largest value, with ``d = |.|``
    (the paper's default). Row stochastic, unimodal; columns sum to 1 only approximately. As
    ``tau -> 0`` it tends to the permutation matrix of the sort (distinct values). Ascending
    order applies the descending form to ``-x``. Cost ``O(n log n + rows * n)``.

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order); leading
        axes are batch axes.
    temperature : float or 0-d torch.Tensor
        The softmax temperature ``tau > 0`` (in the units of ``x``); a tensor may require grad.
    descending : bool
        Row 0 is the largest score (else the smallest).
    rows : int, optional
        Compute only the first ``rows`` rows, e.g. the top-k rows; all ``n`` by default.

    Returns
    -------
    torch.Tensor
        ``P`` of shape ``(..., rows, n)``: rows are ranks, columns are elements.

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        Fewer than 2 elements, a temperature that is not positive, or ``rows`` out of range.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import softsort
    >>> x = torch.tensor([0.0, 3.0, 1.0])
    >>> (softsort(x, 0.01, descending=True) @ x).round(decimals=3)
    tensor([3., 1., 0.])
    >>> softsort(x, 1.0).sum(-1).round(decimals=6)  # row stochastic
    tensor([1., 1., 1.])
    """
    return log_softsort(x, temperature, descending=descending, rows=rows).exp()
