"""GPU soft permutation kernels against the CPU kernels, in numba's CUDA simulator."""

from __future__ import annotations

import numpy as np
import pytest

from softorder import core
from softorder.core import permutation as cpu
from softorder.core.cuda import permutation as gpu
from tests.gpu.simulator.harness import compare, rows_of, sample, work

INF = np.inf

# The simulator runs the kernels on NumPy scalars, which warn where a GPU (and the CPU kernels,
# compiled) silently produce inf - inf = NaN: ``offset_z`` computes exactly that and then
# checks for it.


def _batch():
    """Ties, an inf, a NaN row, a value far apart compared to alpha; alpha per row."""
    return sample(np.random.default_rng(0), 4, 8), np.array([0.7, 1.3, 0.5, 0.2])


def _infinities():
    """Blocks of equal infinities (boundaries inside them) and a small alpha.

    Not smaller: beyond gaps of ~1400 alpha ``exp(shift)`` in the inverse's ``w_bar`` (unused
    here) overflows, which the simulator's ``math.exp`` raises where a GPU gives inf.
    """
    x = np.array(
        [
            [INF, INF, 0.1, -INF, 0.3, INF],
            [-INF, -INF, 0.0, 1.0, 2.0, 3.0],
            [0.0, 1e-3, 5.0, 5.0, 5.0, -2.0],
        ]
    )
    return x, np.array([1.0, 0.4, 0.01])


def _two():
    x = np.array([[0.3, -0.1], [1.0, 1.0], [np.nan, 1.0], [INF, 0.0]])
    return x, np.array([0.5, 1.0, 1.0, 2.0])


def _one():
    return np.array([[0.5], [np.nan], [-INF]]), np.array([0.5, 1.0, 2.0])


CASES = {"batch": _batch, "infinities": _infinities, "n2": _two, "n1": _one}


@pytest.fixture(params=sorted(CASES))
def case(request):
    """Sorted rows, order, alpha and the boundary targets ``w = 1..n-1``, ``worder``."""
    x, alpha = CASES[request.param]()
    xs, order = rows_of(x)
    m = xs.shape[1] - 1
    return xs, order, alpha, np.arange(1.0, m + 1.0), np.arange(m)


def _boundaries(xs, order, alpha, w, worder):
    rows, n = xs.shape
    anchor = np.zeros((rows, n - 1), dtype=np.int64)
    offset = np.zeros((rows, n - 1))
    out = np.empty((rows, n, n))
    cpu.permutation_forward(
        xs, order, alpha, w, worder, out, anchor, offset, work(rows, cpu.FORWARD_WORK, n)
    )
    return anchor, offset


def _gradient_work(xs):
    rows, n = xs.shape
    return work(rows, cpu.GRADIENT_WORK, n), work(rows, cpu.BOUNDARY_WORK, n - 1)


def _targets(xs, permutations: bool):
    """1-based target ranks: a permutation per row, or ranks with repeats."""
    rng = np.random.default_rng(1)
    rows, n = xs.shape
    if permutations:
        return np.stack([rng.permutation(n) + 1 for _ in range(rows)]).astype(np.int64)
    return rng.integers(1, n + 1, size=(rows, n)).astype(np.int64)


def test_forward(case):
    xs, order, alpha, w, worder = case
    rows, n = xs.shape
    args = [
        xs,
        order,
        alpha,
        w,
        worder,
        np.empty((rows, n, n)),
        np.zeros((rows, n - 1), dtype=np.int64),
        np.zeros((rows, n - 1)),
        work(rows, cpu.FORWARD_WORK, n),
    ]
    out = compare(cpu.permutation_forward, gpu.permutation_forward, args, [5, 6, 7])
    assert np.isnan(out[5]).all(axis=(1, 2)).tolist() == np.isnan(xs).any(axis=1).tolist()


def test_vjp(case):
    xs, order, alpha, w, worder = case
    rows, n = xs.shape
    anchor, offset = _boundaries(xs, order, alpha, w, worder)
    V = np.random.default_rng(2).normal(size=(rows, n, n))
    args = [
        xs,
        order,
        alpha,
        anchor,
        offset,
        worder,
        V,
        np.empty((rows, n)),
        np.empty(rows),
        *_gradient_work(xs),
    ]
    compare(cpu.permutation_vjp, gpu.permutation_vjp, args, [7, 8])


def test_jvp(case):
    xs, order, alpha, w, worder = case
    rows, n = xs.shape
    anchor, offset = _boundaries(xs, order, alpha, w, worder)
    rng = np.random.default_rng(3)
    args = [
        xs,
        order,
        alpha,
        anchor,
        offset,
        worder,
        rng.normal(size=(rows, n)),
        rng.normal(size=rows),
        np.empty((rows, n, n)),
        *_gradient_work(xs),
    ]
    compare(cpu.permutation_jvp, gpu.permutation_jvp, args, [8])


@pytest.mark.parametrize("permutations", [True, False], ids=["permutation", "repeats"])
def test_loss_forward(case, permutations):
    xs, order, alpha, w, worder = case
    rows, n = xs.shape
    args = [
        xs,
        order,
        alpha,
        _targets(xs, permutations),
        w,
        worder,
        np.empty(rows),
        np.zeros((rows, n - 1), dtype=np.int64),
        np.zeros((rows, n - 1)),
        work(rows, cpu.FORWARD_WORK, n),
    ]
    out = compare(cpu.permutation_loss_forward, gpu.permutation_loss_forward, args, [6, 7, 8])
    assert np.isnan(out[6]).tolist() == np.isnan(xs).any(axis=1).tolist()


@pytest.mark.parametrize("permutations", [True, False], ids=["permutation", "repeats"])
def test_loss_vjp(case, permutations):
    xs, order, alpha, w, worder = case
    rows, n = xs.shape
    anchor, offset = _boundaries(xs, order, alpha, w, worder)
    args = [
        xs,
        order,
        alpha,
        _targets(xs, permutations),
        anchor,
        offset,
        worder,
        np.random.default_rng(4).normal(size=rows),
        np.empty((rows, n)),
        np.empty(rows),
        *_gradient_work(xs),
    ]
    compare(cpu.permutation_loss_vjp, gpu.permutation_loss_vjp, args, [8, 9])


def test_same_signatures():
    """Each launcher takes the CPU kernel's arguments, by the same names."""
    import inspect

    for name in gpu.__all__:
        expected = inspect.signature(getattr(core, name)).parameters
        assert list(inspect.signature(getattr(gpu, name)).parameters) == list(expected), name
