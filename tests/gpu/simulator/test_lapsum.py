"""GPU scans, Lap-sum values, the inverse (soft sort / quantile) and its gradients, against
the CPU kernels and brute force, in numba's CUDA simulator.
"""

import numpy as np
import pytest
from numba import cuda

from softorder import core
from softorder.core.cuda import lapsum as gpu_lapsum
from softorder.core.cuda import scan
from softorder.core.cuda import sort as gpu_sort
from tests.gpu.simulator.harness import compare, rows_of, sample, work


def _affine_reference(a, c, reverse):
    out = np.zeros_like(c)
    for r in range(c.shape[0]):
        y = 0.0
        idx = range(c.shape[1] - 1, -1, -1) if reverse else range(c.shape[1])
        for step, i in enumerate(idx):
            factor = 0.0 if step == 0 else a[r, i + 1] if reverse else a[r, i]
            y = factor * y + c[r, i]
            out[r, i] = y
    return out


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape", [(3, 1), (2, 8), (2, 9), (1, 70)])  # 70: three scan levels
def test_affine_scan_and_row_sums(shape, reverse):
    rng = np.random.default_rng(shape[1])
    a, c = rng.uniform(0.0, 1.0, shape), rng.normal(size=shape)
    out = cuda.device_array(shape)
    scan.affine_scan(cuda.to_device(a), cuda.to_device(c), out, reverse=reverse)
    np.testing.assert_allclose(out.copy_to_host(), _affine_reference(a, c, reverse), atol=1e-13)
    sums = cuda.device_array(shape[0])
    scan.row_sums(cuda.to_device(c), sums)
    np.testing.assert_allclose(sums.copy_to_host(), c.sum(axis=1), atol=1e-13)


def _problem(m=3, seed=1):
    """A batch with ties, +inf, a NaN row and a wide gap; per-row alpha; integer targets."""
    rng = np.random.default_rng(seed)
    xs, order = rows_of(sample(rng, 4, 11))
    alpha = np.array([0.3, 1.0, 0.05, 2.0])
    w = np.sort(rng.uniform(0.2, 10.8, (4, m)), axis=1)
    w[0, 0] = 2.0  # an integer target next to a tie
    w[3, -1] = 10.0  # an integer target next to the far value (the log-space pitfall)
    return xs, order, alpha, w, np.argsort(w, axis=1)


def _forward(xs, alpha, w, worder):
    rows, m = w.shape
    out, anchor, offset = np.empty((rows, m)), np.empty((rows, m), np.int64), np.empty((rows, m))
    args = [xs, alpha, w, worder, out, anchor, offset, work(rows, 4, xs.shape[1])]
    return compare(core.inverse_kernel, gpu_lapsum.inverse_kernel, args, [4, 5, 6])


def test_inverse_matches_cpu_and_sums_to_targets():
    xs, order, alpha, w, worder = _problem()
    out = _forward(xs, alpha, w, worder)[4]
    rows = xs.shape[0]
    values = np.empty((rows, w.shape[1]))
    core.lapsum_kernel(xs, alpha, out, values, work(rows, 4, xs.shape[1]))
    finite = np.isfinite(xs).all(axis=1)
    np.testing.assert_allclose(values[finite], w[finite], rtol=1e-9)
    assert np.isnan(out[2]).all() and not np.isnan(out[[0, 1, 3]]).any()


def test_lapsum_values():
    xs, order, alpha, w, worder = _problem()
    points = np.random.default_rng(5).normal(size=(4, 5)) * 3
    args = [xs, alpha, points, np.empty((4, 5)), work(4, 4, xs.shape[1])]
    compare(core.lapsum_kernel, gpu_lapsum.lapsum_kernel, args, [3])


@pytest.mark.parametrize("m", [1, 3])
def test_inverse_vjp(m):
    xs, order, alpha, w, worder = _problem(m)
    _, _, _, _, _, anchor, offset, _ = _forward(xs, alpha, w, worder)
    rows, n = xs.shape
    u = np.random.default_rng(2).normal(size=(rows, m))
    args = [xs, order, alpha, anchor, offset, worder, u, np.empty((rows, n)), np.empty((rows, m))]
    args += [np.empty(rows), work(rows, core.sort.VJP_WORK, n), work(rows, 2, m)]
    compare(core.inverse_vjp, gpu_sort.inverse_vjp, args, [7, 8, 9])


def test_inverse_jvp():
    xs, order, alpha, w, worder = _problem()
    _, _, _, _, _, anchor, offset, _ = _forward(xs, alpha, w, worder)
    rows, n = xs.shape
    rng = np.random.default_rng(3)
    tangents = [rng.normal(size=(rows, n)), rng.normal(size=w.shape), rng.normal(size=rows)]
    args = [xs, order, alpha, anchor, offset, worder, *tangents, np.empty(w.shape)]
    args += [work(rows, 7, n), work(rows, 3, w.shape[1])]
    compare(core.inverse_jvp, gpu_sort.inverse_jvp, args, [9])
