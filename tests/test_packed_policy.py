"""When the host sorts by packed keys (``numpy_host.PackedSort``): every operation gives the
same results, bit for bit, on either path; the argsort path counts its loss and compiles the
packed sort once the loss pays for it; a kernel in numba's disk cache is loaded without
compiling; ``softorder.precompile`` compiles it.
"""

import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading

import numba
import numpy as np
import pytest

import softorder
from softorder._engine.backends import numpy_host
from softorder._engine.backends.numpy_host import NUMPY, PACKED, PackedSort, argsort_loss
from softorder._precompile import OPERATIONS, _arguments

pytestmark = pytest.mark.skipif(
    numba.config.DISABLE_JIT, reason="NUMBA_DISABLE_JIT: no compilation to put off"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def mode():
    """Set the host's sort mode for one test, and restore it (and a fresh count) after."""
    previous = PACKED.mode
    yield PACKED.set_mode
    PACKED.set_mode(previous)


def inputs(dtype):
    """Rows long enough for the packed sort, with ties, -0.0 and 0.0, +-inf, values alike
    in all but their lowest bits and (row 2) a NaN.
    """
    rng = np.random.default_rng(7)
    x = np.round(rng.standard_normal((3, 500)), 1)
    x[:, :6] = [0.0, -0.0, np.inf, -np.inf, 1.0, np.nextafter(1.0, 2.0)]
    x[2, 9] = np.nan
    return rng.permuted(x, axis=1).astype(dtype)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


def results(name, x):
    fn = getattr(softorder, name)
    args = _arguments(name, x)
    out, pullback = softorder.vjp(fn, *args)
    grads = pullback(np.cos(np.arange(out.size)).reshape(np.shape(out)).astype(out.dtype))
    tangent = np.sin(np.arange(x.size)).reshape(x.shape).astype(x.dtype)
    _, out_dot = softorder.jvp(fn, args, (tangent,))
    return (out, *grads, out_dot)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", OPERATIONS)
def test_every_operation_is_the_same_on_either_path(name, dtype, mode):
    x = inputs(dtype)
    mode("packed")
    packed = results(name, x)
    mode("argsort")
    argsorted = results(name, x)
    for a, b in zip(packed, argsorted, strict=True):
        same_bits(a, b)


def test_argsort_path_counts_its_loss_and_switches(mode, monkeypatch):
    """Until the kernels are available (here: never, but by compiling), each sort adds its
    loss; the sort that brings it to the compile time compiles them and sorts by them.
    """
    mode("auto")
    monkeypatch.setattr(PackedSort, "_available", lambda self: False)
    compiled = []
    original = PackedSort.compile
    monkeypatch.setattr(PackedSort, "compile", lambda self: compiled.append(1) or original(self))
    x = np.random.default_rng(1).standard_normal((2, 1000))
    loss = argsort_loss(x.size, x.shape[1])
    assert loss > 0
    monkeypatch.setattr(numpy_host, "PACKED_COMPILE_SECONDS", 2.5 * loss)
    expected = np.argsort(x, axis=1, kind="stable").astype(np.int32)
    for calls in (1, 2):
        xs, order = NUMPY.sort_rows(x)
        assert PACKED.lost == pytest.approx(calls * loss) and not compiled
        same_bits(order, expected)
    xs, order = NUMPY.sort_rows(x)
    assert PACKED._ready and compiled == [1]
    same_bits(order, expected)
    same_bits(xs, np.take_along_axis(x, expected, 1))
    assert PACKED.use(x.size, x.shape[1]) is True and compiled == [1]  # once


def test_short_inputs_and_saved_orders_count_nothing(mode, monkeypatch):
    mode("auto")
    monkeypatch.setattr(PackedSort, "_available", lambda self: False)
    NUMPY.sort_rows(np.zeros((1, numpy_host.PACKED_SORT_SIZE - 1)))
    x = np.zeros((1, 1000))
    NUMPY.sort_rows(x, np.zeros(x.shape, np.int32))
    assert PACKED.lost == 0.0


def test_modes(mode):
    with pytest.raises(ValueError, match="softorder: the packed sort's mode"):
        PACKED.set_mode("fast")
    mode("argsort")
    assert PACKED.use(10**6, 10**6) is False and PACKED.lost == 0.0
    mode("packed")
    assert PACKED.use(1000, 1000) is True
    mode("auto")
    assert PACKED.lost == 0.0 and not PACKED._looked


def test_loss_grows_with_the_row():
    per_element = [argsort_loss(n, n) / n for n in (1000, 10**4, 10**5, 10**6)]
    assert all(0 < a < b for a, b in itertools.pairwise(per_element))


def test_threads_sort_alike_across_the_switch(mode, monkeypatch):
    mode("auto")
    monkeypatch.setattr(PackedSort, "_available", lambda self: False)
    x = np.random.default_rng(2).standard_normal((4, 600))
    monkeypatch.setattr(numpy_host, "PACKED_COMPILE_SECONDS", 20 * argsort_loss(x.size, 600))
    expected = np.argsort(x, axis=1, kind="stable")
    failures = []

    def work():
        for _ in range(30):
            xs, order = NUMPY.sort_rows(x)
            if not (np.array_equal(order, expected) and np.array_equal(xs, np.sort(x, 1))):
                failures.append(1)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and PACKED._ready


def test_precompile_compiles_the_packed_sort(mode):
    mode("auto")
    softorder._precompile._host_sort()
    assert PACKED._ready and PACKED.use(1000, 1000)


CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from softorder._engine.backends import numpy_host
    from softorder._engine.backends.numpy_host import NUMPY, PACKED, _packed_kernels

    def state():
        return {
            "compiled": [len(k.overloads) for k, _ in _packed_kernels()],
            "misses": [sum(k._cache_misses.values()) for k, _ in _packed_kernels()],
            "hits": [sum(k._cache_hits.values()) for k, _ in _packed_kernels()],
            "lost": PACKED.lost,
        }

    x = np.random.default_rng(0).standard_normal((1, 1000))
    expected = np.argsort(x, axis=1, kind="stable")
    report = {}
    xs, order = NUMPY.sort_rows(x)
    assert (order == expected).all() and (xs == np.sort(x, 1)).all()
    report["first"] = state()
    if sys.argv[1] == "switch":  # the next sort reaches the compile time
        numpy_host.PACKED_COMPILE_SECONDS = 1.5 * PACKED.lost
        xs, order = NUMPY.sort_rows(x)
        assert (order == expected).all() and (xs == np.sort(x, 1)).all()
        report["second"] = state()
    print(json.dumps(report))
    """
)


def run_child(step, cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, step], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cached_packed_sort_is_loaded_not_compiled(tmp_path):
    """A process with an empty cache sorts by argsort without compiling the packed sort, then
    compiles it (with the very signatures its calls use: one overload each) at the switch;
    the next process loads it from the disk cache on its first sort, compiling nothing.
    """
    first = run_child("switch", tmp_path)
    assert first["first"]["compiled"] == [0, 0] and first["first"]["lost"] > 0
    assert first["second"]["compiled"] == [1, 1] and first["second"]["misses"] == [1, 1]
    second = run_child("load", tmp_path)
    assert second["first"] == {"compiled": [1, 1], "misses": [0, 0], "hits": [1, 1], "lost": 0.0}


FORK = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from softorder._engine.backends.numpy_host import NUMPY, PACKED, PackedSort

    ready = sys.argv[1] == "ready"
    x = np.random.default_rng(3).standard_normal((2, 800))
    if ready:
        PACKED.compile()
    else:
        PackedSort._available = lambda self: False
        NUMPY.sort_rows(x)
    lost = PACKED.lost
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when its sort is right, and used the right path
        code = 1
        try:
            xs, order = NUMPY.sort_rows(x)
            right = np.array_equal(order, np.argsort(x, axis=1, kind="stable"))
            right = right and np.array_equal(xs, np.sort(x, axis=1))
            path = PACKED._ready if ready else PACKED.lost > lost
            code = 0 if right and path else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
    assert PACKED.lost == lost
    print("OK")
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
@pytest.mark.parametrize("ready", [True, False])
def test_a_forked_child_sorts_on_either_side_of_the_switch(ready):
    """A child forked after the switch sorts by the inherited kernels; one forked before it
    goes on counting (its own count: the parent's does not move). In a process of its own:
    this one may hold other libraries' threads (JAX warns at a fork then).
    """
    env = dict(os.environ, PYTHONPATH=ROOT)
    step = "ready" if ready else "counting"
    out = subprocess.run(
        [sys.executable, "-c", FORK, step], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
