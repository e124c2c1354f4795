"""``benchmarks/bench_core.py --memory-profile`` (issue 13): the NumPy arrays alive at each
kernel call of one forward + VJP, as the issue's note reports them. Checked here against what
soft_sort's CPU path allocates for a long row (its docstrings' budget: three rows of float64
scratch, the float32 sorted row, its int32 order, the float32 result and gradient; no offsets
kept between the passes from ``core.sort.SOLVE_AGAIN_N`` on).
"""

from __future__ import annotations

import pathlib
import runpy

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_core.py"
N = 200_000  # above the scratch kept per thread, and a long row (core.sort.SOLVE_AGAIN_N)


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(BENCH))


def test_soft_sort_float32_profile(bench, capsys):
    steps = {k: arrays for k, arrays, _ in bench["memory_profile"]("soft_sort", "float32", N)}
    out = capsys.readouterr().out
    assert "sort.ladder_vjp" in steps and "sort.ladder_forward" in steps
    forward = sorted(round(b, 3) for b, _ in steps["sort.ladder_forward"])
    pullback = sorted(round(b, 3) for b, _ in steps["sort.ladder_vjp"])
    # scratch, then the result, the sorted row and its order (4 bytes each)
    assert forward == [4.0, 4.0, 4.0, 24.0]
    assert pullback == [4.0, 4.0, 4.0, 4.0, 24.0]  # ... and the gradient
    assert "sort.ladder_vjp: 40.0 B/element = 10.00 x input (resident " in out
    assert out.count("<- the most alive") == 1
    where = dict((b, w) for b, w in steps["sort.ladder_vjp"] if b != 4.0)
    assert "ctx.work(core.sort.LADDER_WORK)" in where[24.0]


def test_soft_sort_float32_profile_of_the_longest_rows(bench, capsys):
    # rows of core.sort.LEAN_N or more: two rows of scratch in each pass, 2-byte counts and
    # Bd kept at every BD_STEP-th point in the VJP, whose gradient's array comes after the
    # row of decays and the counts are gone
    from softorder import core
    from softorder._engine import scratch

    # (a row of scratch above what a thread keeps: the row of decays goes when dropped)
    n = max(core.sort.LEAN_N, scratch.limit() // 8) + 1000
    steps = {k: arrays for k, arrays, _ in bench["memory_profile"]("soft_sort", "float32", n)}
    out = capsys.readouterr().out
    forward = sorted(round(b, 1) for b, _ in steps["sort.ladder_forward"])
    pullback = sorted(round(b, 1) for b, _ in steps["sort.lean_vjp"])
    scatter = sorted(round(b, 1) for b, _ in steps["sort.scatter_rows"])
    assert forward == [4.0, 4.0, 4.0, 16.0]
    assert pullback == [0.1, 2.0, 4.0, 4.0, 4.0, 8.0, 8.0]
    assert scatter == [4.0, 4.0, 4.0, 4.0, 8.0]  # (the gradient, the row of B)
    assert "sort.lean_vjp: 30.1 B/element = 7.53 x input (resident " in out
    assert "<- the most alive" in out.split("sort.lean_vjp:")[1].splitlines()[0]


def test_unknown_operation_is_refused(bench):
    with pytest.raises(SystemExit, match="unknown operation 'soft_nothing'"):
        bench["main"](["--memory-profile", "soft_nothing", "float32"])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_descending_soft_sort_forward_peak_is_the_ascending_one(dtype):
    """The descending result is negated where the kernel wrote it (a copy of it beside the
    forward's scratch was one more array of n at the forward's peak).
    """
    import tracemalloc

    import numpy as np

    import softorder

    x = np.random.default_rng(3).standard_normal(N).astype(dtype)
    peaks = []
    for descending in (False, True):
        softorder.soft_sort(x, alpha=0.1, descending=descending)  # compiled or loaded
        previous = softorder.set_scratch_limit(0)
        tracemalloc.start()
        try:
            out = softorder.soft_sort(x, alpha=0.1, descending=descending)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
            softorder.set_scratch_limit(previous)
        assert out.dtype == x.dtype
    assert peaks[1] <= peaks[0] + 4096
