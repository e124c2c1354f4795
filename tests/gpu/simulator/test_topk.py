"""GPU soft top-k and its log (forward, VJP, JVP) against the CPU kernels, in numba's CUDA
simulator.
"""

import numpy as np
import pytest
from numba import cuda

from softorder.core import topk as cpu
from softorder.core.cuda import topk as gpu
from tests.gpu.simulator.harness import compare, rows_of, sample, work

INF = np.inf

# The simulator runs the kernels on NumPy scalars, which warn where a GPU (and the CPU kernels,
# compiled) silently produce inf - inf = NaN: ``offset_z`` computes exactly that and then
# checks for it. (Its ``math.exp`` also raises on overflow where a GPU gives inf, so gaps stay
# below ~1400 alpha here.)


def _batch(m):
    """Ties, a wide gap, +inf and a NaN row (``sample``), a -inf, per-row alpha."""
    x = sample(np.random.default_rng(0), 4, 9)
    x[3, 5] = -INF
    alpha = np.array([0.3, 1.0, 0.05, 2.0])
    k = np.array([[3.0, 1.0, 6.5], [2.5, 7.0, 4.0], [4.0, 2.0, 5.0], [1.0, 8.0, 3.5]])
    return x, alpha, np.ascontiguousarray(k[:, :m])


def _far(m):
    """Values hundreds of alphas apart with integer k (the inverse in log space), and a row of
    two blocks of equal values.
    """
    x = np.array([np.arange(8) * 300.0, [1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0, 9.0]])
    alpha = np.array([1.0, 0.5])
    k = np.array([[3.0, 1.0, 6.0], [4.0, 2.0, 7.0]])
    return x, alpha, np.ascontiguousarray(k[:, :m])


CASES = {"batch": _batch, "far": _far}
PARAMS = [(case, m, log) for case in sorted(CASES) for m in (1, 3) for log in (False, True)]


def _forward_args(case, m, log):
    x, alpha, k = CASES[case](m)
    xs, order = rows_of(x)
    rows, n = xs.shape
    worder = np.argsort(k, axis=1)
    return [
        xs,
        order,
        alpha,
        k,
        worder,
        log,
        np.empty((rows, m, n)),
        np.empty((rows, m), dtype=np.int64),
        np.empty((rows, m)),
        work(rows, cpu.FORWARD_WORK, n),
    ]


def _targets(case, m, log):
    """The sorted rows, order, alpha and the CPU forward's ``(anchor, offset)``."""
    args = _forward_args(case, m, log)
    cpu.topk_forward(*args)
    xs, order, alpha = args[:3]
    return xs, order, alpha, args[7], args[8]


@pytest.mark.parametrize("case, m, log", PARAMS)
def test_forward(case, m, log):
    args = _forward_args(case, m, log)
    out = compare(cpu.topk_forward, gpu.topk_forward, args, [6, 7, 8])[6]
    nan = np.isnan(args[0]).any(axis=1)
    assert nan.any() == (case == "batch")
    assert np.isnan(out[nan]).all() and not np.isnan(out[~nan]).any()
    if not log:
        np.testing.assert_allclose(out[~nan].sum(axis=2), args[3][~nan], rtol=1e-9)


@pytest.mark.parametrize("case, m, log", PARAMS)
def test_vjp(case, m, log):
    xs, order, alpha, anchor, offset = _targets(case, m, log)
    rows, n = xs.shape
    v = np.random.default_rng(1).normal(size=(rows, m, n))
    v[0, 0, 2] = 0.0  # a zero cotangent is skipped
    args = [xs, order, alpha, anchor, offset, log, v]
    args += [np.empty((rows, n)), np.empty((rows, m)), np.empty(rows)]
    args += [work(rows, cpu.GRADIENT_WORK, n)]
    x_bar = compare(cpu.topk_vjp, gpu.topk_vjp, args, [7, 8, 9])[7]
    assert np.isnan(x_bar).any(axis=1).tolist() == np.isnan(xs).any(axis=1).tolist()


@pytest.mark.parametrize("case, m, log", PARAMS)
def test_jvp(case, m, log):
    xs, order, alpha, anchor, offset = _targets(case, m, log)
    rows, n = xs.shape
    rng = np.random.default_rng(2)
    w_dot = rng.normal(size=(rows, m))
    w_dot[0, 0] = 0.0  # no tangent of k
    args = [xs, order, alpha, anchor, offset, log, rng.normal(size=(rows, n)), w_dot]
    args += [rng.normal(size=rows), np.empty((rows, m, n)), work(rows, cpu.GRADIENT_WORK, n)]
    compare(cpu.topk_jvp, gpu.topk_jvp, args, [9])


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("log", [False, True])
def test_nearest_point_keeps_its_terms(m, log):
    """Fractional k with one point near the threshold and the others far off (that point
    carries nearly all of G): its terms of the VJP and the JVP (in x and alpha) are formed
    from the sums without it, as on the CPU (``tests/test_edge_cases.py`` checks those against
    the exact Jacobian); ``omega phi - v kappa`` lost every bit, far beyond these tolerances.
    """
    x = np.array([[0.0, 40.0, 80.0, 200.0], [23.84, 3.695, 0.395, 15.0]])
    alpha = np.array([1.0, 0.5])
    k = np.array([[1.5, 1.3, 0.2], [2.032, 3.5, 1.0]])[:, :m]
    xs, order = rows_of(x)
    rows, n = xs.shape
    args = [xs, order, alpha, np.ascontiguousarray(k), np.argsort(k, axis=1), log]
    args += [np.empty((rows, m, n)), np.empty((rows, m), np.int64), np.empty((rows, m))]
    args += [work(rows, cpu.FORWARD_WORK, n)]
    cpu.topk_forward(*args)
    anchor, offset = args[7], args[8]
    rng = np.random.default_rng(3)
    v = rng.normal(size=(rows, m, n))
    args = [xs, order, alpha, anchor, offset, log, v]
    args += [np.empty((rows, n)), np.empty((rows, m)), np.empty(rows)]
    args += [work(rows, cpu.GRADIENT_WORK, n)]
    compare(cpu.topk_vjp, gpu.topk_vjp, args, [7, 9], rtol=1e-12, atol=1e-300)
    args = [xs, order, alpha, anchor, offset, log, rng.normal(size=(rows, n))]
    args += [np.zeros((rows, m)), np.zeros(rows), np.empty((rows, m, n))]
    args += [work(rows, cpu.GRADIENT_WORK, n)]
    compare(cpu.topk_jvp, gpu.topk_jvp, args, [9], rtol=1e-12, atol=1e-300)
    # the alpha column: where the far points' terms cancel (k = 1.5 midway between them) the
    # entry is 0 to within the rounding of b, so the tolerance is relative to each target's
    args[6], args[8] = np.zeros((rows, n)), np.ones(rows)
    want = compare(cpu.topk_jvp, gpu.topk_jvp, args, [])[9]
    got = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
    gpu.topk_jvp(*got)
    scale = np.abs(want).max(axis=2, keepdims=True)
    got = got[9].copy_to_host()
    bad = np.abs(got - want) > 1e-12 * np.abs(want) + 1e-13 * scale
    assert not bad.any(), (got[bad], want[bad])
