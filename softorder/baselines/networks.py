"""Differentiable sorting networks (Petersen, Borgelt, Kuehne & Deussen, ICML 2021).

A sorting network is a fixed sequence of layers of comparators on wires; each comparator puts
the smaller of its two values on its ``lo`` wire and the larger on its ``hi`` wire. The
relaxation used here is the **logistic** one of the 2021 paper: with
``a`` on ``lo``, ``b`` on ``hi`` and ``alpha = sigmoid((b - a) / tau)``,

    lo <- alpha a + (1 - alpha) b,        hi <- (1 - alpha) a + alpha b,

so each layer is a doubly stochastic matrix and the relaxed permutation matrix
``P = L_t ... L_1`` is doubly stochastic for every temperature, with ``P @ x`` equal to the
values left on the wires. (Not implemented: the activation replacement trick of that paper
and the monotonic sigmoids of Petersen et al., ICLR 2022.)

Networks: **odd-even transposition** (n layers of neighbour comparators, any n) and
**bitonic** (``log2(N) (log2(N) + 1) / 2`` layers for ``N = 2^ceil(log2 n)``; inputs are padded
with wires that act as ``+inf`` exactly, i.e. their comparators are hard). The top ``rows`` rows
of ``P`` are computed back to front, ``E_rows L_t ... L_1``, as in the DiffTopK paper
(Petersen et al., ICML 2022, sec. 3.1): ``O(rows * N)`` per layer instead of ``O(N^2)``.
"""

from __future__ import annotations

import functools

import torch

from softorder.baselines._common import (
    Temperature,
    check_rows,
    check_scores,
    check_temperature,
)

NETWORKS = ("odd_even", "bitonic")


@functools.lru_cache(maxsize=64)
def _layers(network: str, wires: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Comparator layers ``(lo wires, hi wires)`` of an ascending sorting network."""
    layers = []
    if network == "odd_even":
        for layer in range(wires):
            lo = tuple(range(layer % 2, wires - 1, 2))
            if lo:
                layers.append((lo, tuple(i + 1 for i in lo)))
        return tuple(layers)
    size = 2
    while size <= wires:
        stride = size // 2
        while stride >= 1:
            lo, hi = [], []
            for i in range(wires):
                j = i ^ stride
                if j > i:
                    (lo if i & size == 0 else hi).append(i)
                    (hi if i & size == 0 else lo).append(j)
            layers.append((tuple(lo), tuple(hi)))
            stride //= 2
        size *= 2
    return tuple(layers)


def _mix(t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Apply one comparator layer along the last axis of ``t`` (out of place)."""
    a, b = t[..., lo], t[..., hi]
    new_lo = alpha * a + (1 - alpha) * b
    new_hi = (1 - alpha) * a + alpha * b
    return t.index_copy(-1, lo, new_lo).index_copy(-1, hi, new_hi)


def sorting_network(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    network: str = "odd_even",
    descending: bool = False,
    rows: int | None = None,
) -> torch.Tensor:
    """Relaxed permutation matrix of a differentiable sorting network (logistic comparators).

    Runs the comparators of the chosen network with ``alpha = sigmoid((b - a) / tau)`` (module
    docstring; ``1 / tau`` is the paper's steepness ``beta``), then multiplies the layer
    matrices from the last layer to the first for the requested rows. ``P`` is doubly
    stochastic for every temperature and tends to the permutation matrix of the sort as
    ``tau -> 0``. Errors compound over layers, so a network needs a smaller ``tau`` than a
    single softmax for the same sharpness. Time ``O(rows * N * layers)``; autograd memory the
    same.

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order); leading
        axes are batch axes.
    temperature : float or 0-d torch.Tensor
        The comparator temperature ``tau > 0`` (in the units of ``x``); a tensor may require
        grad.
    network : {"odd_even", "bitonic"}
        Odd-even transposition network (``n`` layers) or bitonic network
        (``O(log^2 n)`` layers, padded to a power of two).
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
        An unknown network, fewer than 2 elements, a temperature that is not positive, or
        ``rows`` out of range.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import sorting_network
    >>> x = torch.tensor([0.5, 3.0, 1.0, 2.0, -1.0], dtype=torch.float64)
    >>> (sorting_network(x, 0.01, network="bitonic") @ x).round(decimals=4)
    tensor([-1.0000,  0.5000,  1.0000,  2.0000,  3.0000], dtype=torch.float64)
    >>> p = sorting_network(x, 1.0, descending=True)  # doubly stochastic
    >>> one = torch.ones(5, dtype=torch.float64)
    >>> bool(torch.allclose(p.sum(-1), one) and torch.allclose(p.sum(-2), one))
    True
    """
    n = check_scores(x)
    check_temperature(temperature)
    rows = check_rows(rows, n)
    if network not in NETWORKS:
        raise ValueError(f"network must be one of {NETWORKS}, got {network!r}")
    wires = n if network == "odd_even" else 1 << (n - 1).bit_length()
    values = -x if descending else x
    values = torch.cat((values, values.new_zeros(values.shape[:-1] + (wires - n,))), dim=-1)
    pad = [False] * n + [True] * (wires - n)  # padding acts as +inf: hard comparators
    alphas = []
    for lo_wires, hi_wires in _layers(network, wires):
        lo = torch.tensor(lo_wires, device=x.device)
        hi = torch.tensor(hi_wires, device=x.device)
        alpha = torch.sigmoid((values[..., hi] - values[..., lo]) / temperature)
        pad_lo = torch.tensor([pad[i] for i in lo_wires], device=x.device)
        pad_hi = torch.tensor([pad[i] for i in hi_wires], device=x.device)
        if bool(pad_lo.any()) or bool(pad_hi.any()):
            alpha = torch.where(pad_hi, 1.0, torch.where(pad_lo, 0.0, alpha))
        for i, j in zip(lo_wires, hi_wires, strict=True):
            pad[i], pad[j] = pad[i] and pad[j], pad[i] or pad[j]
        values = _mix(values, lo, hi, alpha)
        alphas.append((lo, hi, alpha.unsqueeze(-2)))
    eye = torch.eye(wires, dtype=x.dtype, device=x.device)[:rows]
    perm = eye.expand(x.shape[:-1] + eye.shape)
    for lo, hi, alpha in reversed(alphas):
        perm = _mix(perm, lo, hi, alpha)
    return perm[..., :n]
