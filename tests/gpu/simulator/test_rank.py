"""GPU soft rank (forward, VJP, JVP) against the CPU kernels, in numba's CUDA simulator."""

import numpy as np
import pytest
from numba import cuda

from softorder.core import rank as cpu
from softorder.core.cuda import rank as gpu
from tests.gpu.simulator.harness import compare, rows_of, sample, work

INF = np.inf


def _batch():
    """Ties, an infinite tie and a lone -inf, a NaN row, far-apart values, per-row alpha."""
    x = sample(np.random.default_rng(0), 4, 9)
    x[0, 5] = x[0, 6] = x[0, 0]  # a run of four equal values
    x[1, 3] = INF  # two equal infinities
    x[1, 4] = -INF
    return x, np.array([0.3, 1.0, 0.05, 2.0])


def _single():
    return np.array([[0.7], [-2.0]]), np.array([0.5, 1.5])


def _equal():
    """A row of equal values, and a run of equal values across a tile boundary (8 elements)."""
    x = np.array([np.full(12, 2.5), [0.1, 0.4, 0.9, 1.3, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 4.2, 9.0]])
    return x, np.array([0.8, 0.25])


CASES = {"batch": _batch, "n1": _single, "equal": _equal}


def _forward_args(case):
    x, alpha = CASES[case]()
    xs, order = rows_of(x)
    rows, n = xs.shape
    return [xs, order, alpha, np.empty((rows, n)), np.empty((rows, n)), work(rows, 2, n)]


def _decay(xs, order, alpha):
    """The decays the CPU forward saves, as the gradients receive them."""
    rows, n = xs.shape
    decay = np.empty((rows, n))
    cpu.rank_forward(xs, order, alpha, np.empty((rows, n)), decay, work(rows, 2, n))
    return decay


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward(case):
    args = _forward_args(case)
    out = compare(cpu.rank_forward, gpu.rank_forward, args, [3, 4])[3]
    xs = args[0]
    assert np.isnan(out).any(axis=1).tolist() == np.isnan(xs).any(axis=1).tolist()


@pytest.mark.parametrize("case", ["batch", "equal"])
def test_forward_ties_are_exactly_equal(case):
    args = _forward_args(case)
    dev = [cuda.to_device(a) for a in args]
    gpu.rank_forward(*dev)
    xs, order = args[0], args[1]
    ranks = np.take_along_axis(dev[3].copy_to_host(), order, 1)  # sorted order
    tie = xs[:, 1:] == xs[:, :-1]
    assert tie.any()
    np.testing.assert_array_equal(ranks[:, 1:][tie], ranks[:, :-1][tie])


@pytest.mark.parametrize("case", sorted(CASES))
def test_vjp(case):
    x, alpha = CASES[case]()
    xs, order = rows_of(x)
    rows, n = xs.shape
    v = np.random.default_rng(1).normal(size=(rows, n))
    args = [xs, order, alpha, _decay(xs, order, alpha), v]
    args += [np.empty((rows, n)), np.empty(rows), work(rows, 3, n)]
    compare(cpu.rank_vjp, gpu.rank_vjp, args, [5, 6])


@pytest.mark.parametrize("case", sorted(CASES))
def test_jvp(case):
    x, alpha = CASES[case]()
    xs, order = rows_of(x)
    rows, n = xs.shape
    rng = np.random.default_rng(2)
    x_dot = rng.normal(size=(rows, n))
    alpha_dot = rng.normal(size=rows)
    args = [xs, order, alpha, _decay(xs, order, alpha), x_dot, alpha_dot]
    args += [np.empty((rows, n)), work(rows, 3, n)]
    compare(cpu.rank_jvp, gpu.rank_jvp, args, [6])


def test_gradients_of_separated_values_keep_their_diagonal():
    """Gaps of 40 alpha: d rank_i / d x_i = sum_(j != i) f_ij (about 2e-18) is not lost to
    v_i A_i - left_i; exact to the CPU's rounding, with no absolute tolerance to hide it."""
    x = np.array([[0.0, 40.0, 80.0, 100.0]])
    alpha = np.array([1.0])
    xs, order = rows_of(x)
    rows, n = xs.shape
    v = np.array([[1.0, 0.0, -1.0, 0.5]])
    args = [xs, order, alpha, _decay(xs, order, alpha), v]
    args += [np.empty((rows, n)), np.empty(rows), work(rows, 3, n)]
    x_bar = compare(cpu.rank_vjp, gpu.rank_vjp, args, [5, 6], rtol=1e-12, atol=0.0)[5]
    assert x_bar[0, 0] > 0.0  # e^-40 / 2, not 0
    x_dot = np.array([[1.0, 0.0, 0.0, 0.0]])
    args = [xs, order, alpha, _decay(xs, order, alpha), x_dot, np.zeros(rows)]
    args += [np.empty((rows, n)), work(rows, 3, n)]
    out = compare(cpu.rank_jvp, gpu.rank_jvp, args, [6], rtol=1e-12, atol=0.0)[6]
    assert out[0, 0] > 0.0
