"""Latency (issue 14): what ``import softorder`` loads, the first-compilation note, and the
latency script, run in ``--quick`` mode so that it cannot rot.

Timing targets are not asserted here (a loaded CI machine would make them flaky); the script
prints them, and the asv suite tracks the per-call floor (``asv_bench/benchmarks/latency.py``).
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: int = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
        cwd=ROOT,
    )


def test_import_loads_no_numba_scipy_or_frameworks():
    code = (
        "import sys, softorder; "
        "print(sorted(m for m in ('numba', 'scipy', 'torch', 'jax', 'softorder.core.rank', "
        "'softorder.baselines') if m in sys.modules))"
    )
    done = _run(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_first_call_loads_the_kernels_it_needs():
    code = (
        "import sys, numpy as np, softorder; softorder.soft_rank(np.ones(3), 1.0); "
        "print(sorted(m for m in sys.modules if m.startswith('softorder.core.')))"
    )
    done = _run(["-c", code])
    assert done.returncode == 0, done.stderr
    loaded = ast.literal_eval(done.stdout.strip())
    assert "softorder.core.rank" in loaded
    assert "softorder.core.topk" not in loaded and "softorder.core.permutation" not in loaded


def test_bench_latency_quick():
    done = _run([str(ROOT / "benchmarks" / "bench_latency.py"), "--quick"])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "first call  numpy soft_rank" in out and "empty cache" in out and "warm cache" in out
    assert "import      softorder " in out
    rows = (
        "np.argsort n=100",
        "numpy soft_rank n=100",
        "numpy soft_topk n=1000",
        "np.argsort 256x100",
        "numpy soft_rank 1x100",
        "numpy soft_topk 256x100",
    )
    for row in rows:
        assert f"floor       {row}" in out, out


def test_precompile_covers_what_calls_need(tmp_path):
    """After ``precompile`` in one process, another compiles nothing for the same operation:
    forward, VJP, JVP, in float64 and float32, and a large batch on the thread pool
    (``parallel=True``)."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    first = _run(
        ["-c", "import softorder; softorder.precompile(['soft_rank'], parallel=True)"], **env
    )
    assert first.returncode == 0, first.stderr
    assert "softorder.precompile: soft_rank (1/1)" in first.stderr
    assert "softorder.precompile: parallel variants" in first.stderr
    code = (
        "import numpy as np, softorder\n"
        "from numba.core import event\n"
        "compiled = []\n"
        "class L(event.Listener):\n"
        "    def on_start(self, ev): compiled.append(ev.data['dispatcher'].py_func.__name__)\n"
        "    def on_end(self, ev): pass\n"
        "event.register('numba:compile', L())\n"
        "softorder.core.set_parallel(True)\n"
        "for x in (np.random.rand(2, 8), np.random.rand(2, 8).astype(np.float32),\n"
        "          np.random.rand(64, 1000)):\n"
        "    out, pullback = softorder.vjp(softorder.soft_rank, x, 0.5)\n"
        "    pullback(np.ones_like(out))\n"
        "    softorder.jvp(softorder.soft_rank, (x, 0.5), (np.ones_like(x),))\n"
        "from numba.np.ufunc import parallel\n"
        "assert parallel._is_initialized\n"
        "print(compiled)\n"
    )
    second = _run(["-c", code], **env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "[]"
    assert "compiling" not in second.stderr


def test_precompile_links_the_rare_paths():
    """The helpers of the VJPs' rare paths, which a process compiles when a row first needs
    one (``core.sort.OTHER_TARGET`` for float64 and float32 rows, ``core.sort.TIE_SEARCH``),
    are ``precompile``'s, even in a process that has met none.
    """
    import softorder
    from softorder.core import sort

    sort.OTHER_TARGET.unlink()
    sort.TIE_SEARCH.unlink()
    operations = ["soft_sort", "soft_quantile", "permutation_cross_entropy"]
    softorder.precompile(operations, progress=False)
    assert sort.OTHER_TARGET.linked("float64") and sort.OTHER_TARGET.linked("float32")
    assert sort.TIE_SEARCH.linked("float64")
    assert {str(s[0].dtype) for s in sort._other_target.signatures} >= {"float32", "float64"}


def test_precompile_compiles_soft_sorts_long_rows(monkeypatch):
    """Rows of ``core.sort.SOLVE_AGAIN_N`` or more keep no offsets: their forward and VJP are
    specializations of their own (no ``offset``), which ``precompile`` compiles too (the
    bound lowered here so that its row is short).
    """
    import softorder
    from softorder import core

    monkeypatch.setattr(core.sort, "SOLVE_AGAIN_N", 16)
    monkeypatch.setattr(core.sort, "LEAN_N", 24)
    softorder.precompile("soft_sort", progress=False)
    for kernel, at in ((core.sort.ladder_forward, 4), (core.sort.ladder_vjp, 3)):
        kinds = {str(signature[at]) for signature in kernel.serial.signatures}
        assert "none" in kinds and any(k.startswith("array(float64") for k in kinds), kinds
    # the longest float32 rows' VJP (two rows of scratch) and its scatter
    for kernel in (core.sort.lean_vjp, core.sort.scatter_rows):
        kinds = {str(signature[0]) for signature in kernel.serial.signatures}
        assert any(k.startswith("array(float32") for k in kinds), kinds


def test_precompile_takes_one_name_and_refuses_bad_arguments():
    import softorder

    assert list(softorder.precompile("soft_rank", apis="numpy", progress=False)) == ["soft_rank"]
    with pytest.raises(ValueError, match="unknown operation"):
        softorder.precompile(["soft_rank", "soft_nope"], progress=False)
    with pytest.raises(ValueError, match="apis must be among"):
        softorder.precompile("soft_rank", apis=["tensorflow"], progress=False)
    with pytest.raises(TypeError, match="operations must be a name or an iterable"):
        softorder.precompile(3, progress=False)
    with pytest.raises(TypeError, match="operations must hold names"):
        softorder.precompile([softorder.soft_rank], progress=False)


def test_symbol_calls_load_from_the_cache_and_refuse_other_types(tmp_path):
    """Kernels that call helpers by symbol (``SymbolCalls``) give the same results compiled
    and loaded from the disk cache in a fresh process (where the symbols are registered anew),
    and refuse argument types they were not declared for.
    """
    code = (
        "import numpy as np, softorder\n"
        "rng = np.random.default_rng(0)\n"
        "x = rng.standard_normal((3, 9))\n"
        "t = np.argsort(rng.standard_normal((3, 9)), axis=1) + 1\n"
        "out, pullback = softorder.vjp(softorder.permutation_cross_entropy, x, t, 0.3)\n"
        "g = pullback(np.ones_like(out))[0]\n"
        "P, pullback = softorder.vjp(softorder.soft_permutation, x, 0.3)\n"
        "h = pullback(np.cos(np.arange(P.size)).reshape(P.shape))[0]\n"
        "print(repr((out.tolist(), g.tolist(), h.tolist())))\n"
    )
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    compiled, loaded = _run(["-c", code], **env), _run(["-c", code], **env)
    assert compiled.returncode == 0, compiled.stderr
    assert loaded.returncode == 0, loaded.stderr
    assert "compiling" in compiled.stderr and "compiling" not in loaded.stderr
    assert compiled.stdout == loaded.stdout

    import numba
    import numpy as np

    from softorder.core import _jit, lapsum

    f1 = numba.types.Array(numba.types.float64, 1, "C")
    calls = _jit.SymbolCalls(prefix=(lapsum.lapsum_at_points, (f1, f1, f1)))
    call = calls.prefix

    @_jit.kernel
    def misuse(xs):
        for row in range(xs.shape[0]):
            call(xs[row], xs[row], xs[row, ::2])  # a strided array: not declared

    with pytest.raises(numba.core.errors.TypingError, match="softorder: lapsum_at_points"):
        misuse(np.ones((2, 4)))
