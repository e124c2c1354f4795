"""The memory of the gradients (issue 13): what a pullback allocates, and that the paths that
allocate less give the same results to the bit.

NumPy's allocations are traced by ``tracemalloc`` (numba's are not: the kernels allocate
nothing large of their own), so the bytes a pullback asks for are a deterministic figure,
unlike the resident peak that ``benchmarks/bench_core.py`` reports. The traced calls keep no
scratch for the next (``softorder.set_scratch_limit(0)``): what they allocate is theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import softorder
from softorder import core

N = 100_000


def _pullback_peak(fn, x, *args, **kwargs) -> int:
    """Peak bytes NumPy allocates during one pullback (the forward pass and the cotangent
    come before the trace starts).
    """
    out, pullback = softorder.vjp(fn, x, *args, alpha=0.1, **kwargs)
    cotangent = np.ones(np.shape(out), np.asarray(out).dtype)
    pullback(cotangent)  # kernels compiled or loaded
    previous = softorder.set_scratch_limit(0)  # every kernel's scratch allocated and freed
    tracemalloc.start()
    try:
        pullback(cotangent)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        softorder.set_scratch_limit(previous)


@pytest.mark.parametrize(
    ("fn", "k"),
    [(softorder.soft_topk, 5), (softorder.soft_topk, N // 10), (softorder.log_soft_topk, 7)],
)
def test_float32_topk_pullback_allocates_a_float32_gradient_and_one_row(fn, k):
    x = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    # the float32 gradient and one row of float64 scratch
    assert _pullback_peak(fn, x, k) <= 12 * N + 4096


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_cross_entropy_pullback_allocates_the_gradient_and_one_row(dtype):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, N // 2)).astype(dtype)
    labels = np.array([3, 11])
    # float64 x_bar and E, then the cast of a float32 gradient once the scratch is freed
    peak = _pullback_peak(softorder.topk_cross_entropy, logits, labels, np.full(5, 0.2))
    assert peak <= 16 * N + 4096


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_permutation_cross_entropy_forward_and_pullback_peak(dtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, N // 2)).astype(dtype)
    ranks = np.argsort(rng.standard_normal(x.shape), axis=1) + 1
    fn = softorder.permutation_cross_entropy
    out, pullback = softorder.vjp(fn, x, ranks, alpha=0.1)
    cotangent = np.ones((), out.dtype)
    pullback(cotangent)  # kernels compiled or loaded
    previous = softorder.set_scratch_limit(0)  # every kernel's scratch allocated and freed
    tracemalloc.start()
    try:
        out, pullback = softorder.vjp(fn, x, ranks, alpha=0.1)
        kept = tracemalloc.get_traced_memory()[0]
        pullback(cotangent)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        softorder.set_scratch_limit(previous)
    # kept by the forward pass: the sorted row (float64), its order, the boundaries' int32
    # anchors (4 bytes each) and offsets (8), and the loss's own int32 copy of the ranks (4);
    # the pullback adds x_bar (float64) and 3 rows of float64 scratch: 60 bytes per element
    # at the peak
    assert kept <= 28 * N + 4096
    assert peak <= 60 * N + 8192


def _rows(dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 300))
    x[1, ::9] = x[1, 4]  # ties
    x[2, 3], x[2, 8] = np.inf, -np.inf
    x[3, 10] = np.nan
    far = np.concatenate([rng.standard_normal(150), 400.0 + rng.standard_normal(150)])
    return [x.astype(dtype), np.stack([far, -far]).astype(dtype)]


def test_float32_rank_pullback_allocates_a_float32_gradient_and_one_row():
    x = np.random.default_rng(8).standard_normal(N).astype(np.float32)
    # the float32 gradient, where the sorted cotangent waits, and one row of float64 partial
    # sums
    assert _pullback_peak(softorder.soft_rank, x) <= 12 * N + 4096


@pytest.mark.parametrize("descending", [False, True])
def test_float32_rank_values_and_gradients_are_the_float64_ones_rounded(descending):
    rng = np.random.default_rng(9)
    for x32 in _rows(np.float32):
        x64 = x32.astype(np.float64)
        for alpha in (0.01, 0.5, 4.0):
            out32, pull32 = softorder.vjp(
                softorder.soft_rank, x32, alpha=alpha, descending=descending
            )
            out64, pull64 = softorder.vjp(
                softorder.soft_rank, x64, alpha=alpha, descending=descending
            )
            np.testing.assert_array_equal(
                out32.view(np.int32), out64.astype(np.float32).view(np.int32)
            )
            u = rng.standard_normal(out32.shape).astype(np.float32)
            u[:, ::7] = 0.0
            want = [np.asarray(g).astype(np.float32) for g in pull64(u.astype(np.float64))]
            for cotangent in (u, u.astype(np.float64)):  # read in place / softorder's copy
                for g, w in zip(pull32(cotangent), want, strict=True):
                    assert np.asarray(g).dtype == np.float32
                    np.testing.assert_array_equal(np.asarray(g).view(np.int32), w.view(np.int32))


def test_rank_vjp_narrow_refuses_a_float64_cotangent():
    rows, n = 2, 20
    xs = np.sort(np.random.default_rng(6).standard_normal((rows, n)), axis=1)
    with pytest.raises(ValueError, match="softorder"):
        core.rank_vjp_narrow(
            xs,
            np.tile(np.arange(n, dtype=np.int32), (rows, 1)),
            np.ones(rows),
            np.ones((rows, n)),
            np.zeros((rows, n)),
            np.empty((rows, n), np.float32),
            np.empty(rows),
            core.workspace(rows, core.rank.LINEAR_WORK, n),
        )


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("k", [1, 150, 37.5])
def test_float32_topk_gradient_is_the_float64_one_rounded(log, largest, k):
    fn = softorder.log_soft_topk if log else softorder.soft_topk
    rng = np.random.default_rng(3)
    for x32 in _rows(np.float32):
        x64 = x32.astype(np.float64)
        for alpha in (0.1, 2.0):  # at 0.1 the far rows' targets are > 700 alphas from all
            out32, pull32 = softorder.vjp(fn, x32, k, alpha=alpha, largest=largest)
            out64, pull64 = softorder.vjp(fn, x64, k, alpha=alpha, largest=largest)
            u = rng.standard_normal(out32.shape).astype(np.float32)
            u[:, ::7] = 0.0
            for cotangent in (u, u.astype(np.float64)):  # read in place / softorder's copy
                # (the gradient of one k shared by rows sums -inf and inf for log far rows)
                with np.errstate(invalid="ignore"):
                    got = pull32(cotangent)
                    want = pull64(u.astype(np.float64))
                for g, w in zip(got, want, strict=True):
                    g, w = np.asarray(g), np.asarray(w)
                    assert g.dtype == np.float32
                    with np.errstate(over="ignore", invalid="ignore"):
                        rounded = w.astype(np.float32)
                    np.testing.assert_array_equal(g.view(np.int32), rounded.view(np.int32))


def test_float32_topk_gradient_along_a_leading_axis():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((50, 3)).astype(np.float32)
    out, pullback = softorder.vjp(softorder.soft_topk, x, 4, alpha=0.3, axis=0)
    u = rng.standard_normal(out.shape).astype(np.float32)
    u_before = u.copy()
    got = pullback(u)[0]
    want = softorder.vjp(softorder.soft_topk, x.astype(np.float64), 4, alpha=0.3, axis=0)[1](
        u.astype(np.float64)
    )[0]
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(u, u_before)  # the caller's cotangent is never written


def test_topk_vjp_narrow_refuses_several_targets():
    rows, n, m = 2, 20, 2
    rng = np.random.default_rng(6)
    xs = np.sort(rng.standard_normal((rows, n)), axis=1)
    order = np.tile(np.arange(n, dtype=np.int32), (rows, 1))
    with pytest.raises(ValueError, match="softorder"):
        core.topk_vjp_narrow(
            xs,
            order,
            np.ones(rows),
            np.zeros((rows, m), np.int64),
            np.zeros((rows, m)),
            False,
            np.zeros((rows, m, n), np.float32),
            np.empty((rows, n), np.float32),
            np.empty((rows, m)),
            np.empty(rows),
            core.workspace(rows, core.topk.VJP_WORK, n),
        )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantile_pullback_allocates_the_gradient_and_one_row(dtype):
    x = np.random.default_rng(2).standard_normal(N).astype(dtype)
    # float64 x_bar and E, and the 4 tables that the kernel allocates and writes at a few
    # points only
    assert _pullback_peak(softorder.soft_quantile, x, np.array([0.1, 0.5, 0.9])) <= 48 * N + 4096


def _inverse_vjp(xs, order, alpha, targets, u):
    rows, n = xs.shape
    k = targets.shape[1]
    anchor = np.empty((rows, k), np.int64)
    offset = np.empty((rows, k))
    core.inverse_kernel(
        xs,
        alpha,
        targets,
        np.argsort(targets, axis=1),
        np.empty((rows, k)),
        anchor,
        offset,
        core.workspace(rows, 4, n),
    )
    x_bar, w_bar, alpha_bar = np.empty((rows, n)), np.empty((rows, k)), np.empty(rows)
    few = core.sort.few_targets(k, n)
    (core.few_inverse_vjp if few else core.inverse_vjp)(
        *(xs, order, alpha, anchor, offset, np.empty((rows, 0), np.int64), u),
        *(x_bar, w_bar, alpha_bar),
        core.workspace(rows, core.sort.FEW_VJP_WORK if few else core.sort.VJP_WORK, n),
        core.workspace(rows, 0, k),
    )
    return x_bar, w_bar, alpha_bar


@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0, 1e-3])
def test_few_targets_pullback_equals_the_general_one_bitwise_among_ties(scale):
    """Blocks of equal values (targets inside them take the exact injection of
    :func:`~softorder.core.kernel_sums.inject_exact`) and several targets injecting at one
    point: the few-targets VJP (upward injections kept as a list) gives the general VJP's
    values, bit for bit (signs of zero included).
    """
    rng = np.random.default_rng(int(scale * 1000))
    rows, n = 3, 64
    x = np.round(rng.standard_normal((rows, n)) * scale)
    x[1, ::4] = np.inf
    x[2, 1::5] = -np.inf
    order = np.argsort(x, axis=1).astype(np.int32)
    xs = np.take_along_axis(x, order, axis=1)
    w = np.tile([17.0, 17.0, 3.5, 40.0, 17.0, 32.0, 31.99], (rows, 1))  # 7 * 8 <= 64
    u = np.tile([1.0, -0.5, 2.0, -1.0, 0.25, 0.0, 3.0], (rows, 1))
    pad = np.tile(np.linspace(0.5, n - 0.5, n), (rows, 1))
    for alpha in (0.01, 0.3, 2.0):
        alphas = np.full(rows, alpha)
        few = _inverse_vjp(xs, order, alphas, w, u)
        general = _inverse_vjp(
            xs, order, alphas, np.concatenate([w, pad], 1), np.pad(u, ((0, 0), (0, n)))
        )
        for a, b in zip(few, (general[0], general[1][:, :7], general[2]), strict=True):
            np.testing.assert_array_equal(a.view(np.int64), b.view(np.int64))


def test_precompile_covers_float32_inputs(tmp_path):
    """float32 inputs of rank and top-k take kernels of their own (a float32 result, cotangent
    and gradient): after ``precompile`` another process compiles nothing for them.
    """
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    ops = "['soft_rank', 'soft_topk']"
    first = subprocess.run(
        [sys.executable, "-c", f"import softorder; softorder.precompile({ops})"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr
    code = (
        "import numpy as np, softorder\n"
        "from numba.core import event\n"
        "compiled = []\n"
        "class L(event.Listener):\n"
        "    def on_start(self, ev): compiled.append(ev.data['dispatcher'].py_func.__name__)\n"
        "    def on_end(self, ev): pass\n"
        "event.register('numba:compile', L())\n"
        "x = np.random.rand(3, 40).astype(np.float32)\n"
        "for fn, args in ((softorder.soft_rank, ()), (softorder.soft_topk, (4,))):\n"
        "    out, pullback = softorder.vjp(fn, x, *args)\n"
        "    pullback(np.ones_like(out))\n"
        "print(compiled)\n"
    )
    second = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "[]"
