"""Kernels that call their per-row helpers by symbol (``softorder.core._jit.SymbolCalls``):
the helpers' code is not compiled again inside the kernel, and a kernel loaded from the disk
cache in a fresh process finds its helpers (issue 14, the first call with an empty cache).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import softorder
from softorder.core import _jit, sort

CALLS = [
    (sort.ladder_vjp, sort._LADDER_VJP_CALLS),
    (sort.ladder_forward, sort._LADDER_FORWARD_CALLS),
]


def _run_soft_sort():
    """soft_sort forward and backward through the NumPy API (the two kernels)."""
    x = np.random.default_rng(0).normal(size=(2, 50))
    x[1] *= 1e4  # far apart: the log-space inverse
    out, pullback = softorder.vjp(softorder.soft_sort, x, 0.01)
    x_bar, alpha_bar = pullback(np.cos(out))
    return out, x_bar, alpha_bar


@pytest.mark.parametrize("run, calls", CALLS, ids=["ladder_vjp", "ladder_forward"])
def test_the_kernel_declares_its_helpers_instead_of_compiling_them(run, calls):
    if not hasattr(run.serial, "overloads"):
        pytest.skip("NUMBA_DISABLE_JIT: no compiled code")
    import numba

    _run_soft_sort()
    assert run.serial.signatures
    for signature in run.serial.signatures:
        # compiled afresh: numba cannot show the code of a kernel loaded from the cache
        fresh = numba.njit(**_jit._OPTIONS)(run.serial.py_func)
        fresh.compile(signature)
        ir = fresh.inspect_llvm(signature)
        for dispatcher, arg_types in calls._helpers.values():
            symbol = _jit._symbol(dispatcher, arg_types)
            assert symbol in _jit._symbols
            assert re.search(rf'declare [^\n]*@"?{symbol}"?\(', ir), symbol
            # the helper's own function is not defined in the kernel's module
            name = dispatcher.overloads[arg_types].fndesc.llvm_func_name
            assert not re.search(rf'define [^\n]*@"?{re.escape(name)}"?\(', ir), name


CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests.test_symbol_calls import _run_soft_sort
from softorder.core import sort
out, x_bar, alpha_bar = _run_soft_sort()
stats = {{
    name: [len(k.serial.stats.cache_hits), len(k.serial.stats.cache_misses)]
    for name, k in (("ladder_forward", sort.ladder_forward), ("ladder_vjp", sort.ladder_vjp))
}}
print(json.dumps({{"bits": [a.tobytes().hex() for a in (out, x_bar, np.asarray(alpha_bar))],
                  "stats": stats}}))
"""


def test_kernels_loaded_from_the_cache_find_their_helpers(tmp_path):
    """The first fresh process compiles the kernels into an empty cache; the second loads
    them from it (no compilation) and registers the helpers' symbols before it links them:
    the same bits, without "symbol not found" from LLVM."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("NUMBA_DISABLE_JIT", None)
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", CHILD.format(root=root)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=root,
        )
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["stats"] == {"ladder_forward": [0, 1], "ladder_vjp": [0, 1]}
    assert second["stats"] == {"ladder_forward": [1, 0], "ladder_vjp": [1, 0]}
    assert first["bits"] == second["bits"]


def test_a_helper_making_symbol_calls_refuses_direct_calls():
    """``inverse_pullback`` calls its own helpers by symbol: a kernel that linked it in
    would lose their symbols when it came from the cache, so compiled code reaches it by
    address only (``address_only``), and a direct call is a typing error naming softorder."""
    import numba

    from softorder.core.lapsum import inverse_pullback

    if not hasattr(inverse_pullback, "overloads"):
        pytest.skip("NUMBA_DISABLE_JIT: no compiled code")

    @numba.njit
    def direct(r, tables, anchor, offset, u, rbar, inj):
        return inverse_pullback(
            r, 1.0, tables, anchor, offset, u, rbar, rbar[:0], inj, rbar, False, True
        )

    r = np.zeros(3)
    with pytest.raises(numba.core.errors.TypingError, match="softorder: inverse_pullback"):
        direct(r, (r, r, r, r, r, r), np.zeros(3, np.int64), r, r, r.copy(), r.copy())


def _on_demand(restype_name="float64"):
    """A ``CallOnDemand`` of a small helper (``r[0] * s``) and a kernel that calls it."""
    import numba
    from numba.core import types

    @_jit.helper
    def scaled_first(r, s):
        return r[0] * s

    restype = getattr(types, restype_name)
    on_demand = _jit.CallOnDemand(
        scaled_first, restype, float64=(types.Array(types.float64, 1, "C"), types.float64)
    )
    call = on_demand.call

    @numba.njit
    def kernel(r, s):
        return call(r, s)

    return on_demand, kernel


def test_a_call_on_demand_reports_whether_its_helper_is_linked():
    """Before ``link`` the kernel's call returns (False, 0) and compiles no helper; after it,
    (True, the helper's value); ``unlink`` restores a fresh process's state.
    """
    on_demand, kernel = _on_demand()
    if not on_demand._jitted:
        pytest.skip("NUMBA_DISABLE_JIT: the helper is a Python call")
    r = np.array([1.5, 2.0])
    assert kernel(r, 2.0) == (False, 0.0) and not on_demand.linked("float64")
    assert not on_demand._dispatcher.signatures
    on_demand.link("float64")
    assert on_demand.linked("float64") and kernel(r, 2.0) == (True, 3.0)
    on_demand.unlink()
    assert kernel(r, 2.0) == (False, 0.0)


def test_a_call_on_demand_refuses_other_types_and_a_wrong_return_type():
    """A call with other argument types is a typing error naming softorder and the helper;
    a declared return type the helper does not have is refused when it is linked, never
    called.
    """
    import numba

    on_demand, kernel = _on_demand()
    if not on_demand._jitted:
        pytest.skip("NUMBA_DISABLE_JIT: the helper is a Python call")
    with pytest.raises(numba.core.errors.TypingError, match="softorder: scaled_first"):
        kernel(np.zeros(2, np.float32), 2.0)
    wrong, _ = _on_demand("int64")
    with pytest.raises(TypeError, match="softorder: scaled_first returns float64"):
        wrong.link("float64")
    assert not wrong.linked("float64")
