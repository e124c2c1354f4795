"""Argument checks and small helpers shared by the baseline methods (no math of their own)."""

from __future__ import annotations

import math

import torch

Temperature = float | torch.Tensor


def check_scores(x: torch.Tensor, name: str = "x", *, min_n: int = 2) -> int:
    """Return ``n = x.shape[-1]`` after checking that ``x`` is a floating tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] < min_n:
        raise ValueError(
            f"{name} needs at least {min_n} elements along its last axis, got shape "
            f"{tuple(x.shape)}"
        )
    return x.shape[-1]


def check_temperature(temperature: Temperature, name: str = "temperature") -> Temperature:
    """Check that a float or 0-d tensor temperature is positive and finite."""
    if isinstance(temperature, torch.Tensor) and temperature.ndim != 0:
        raise ValueError(
            f"{name} must be a number or a 0-d tensor, got shape {tuple(temperature.shape)}"
        )
    value = float(temperature.detach()) if isinstance(temperature, torch.Tensor) else temperature
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {temperature!r}")
    return temperature


def check_rows(rows: int | None, n: int) -> int:
    """Number of leading rows of the permutation matrix to compute (all when ``None``)."""
    if rows is None:
        return n
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= n:
        raise ValueError(f"rows must be an int in [1, {n}], got {rows!r}")
    return rows


def check_iterations(n_iter: int) -> int:
    """Check a Sinkhorn iteration count."""
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1:
        raise ValueError(f"n_iter must be a positive int, got {n_iter!r}")
    return n_iter
