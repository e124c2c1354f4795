"""The ladder VJPs call the rare targets' path (``softorder.core.sort._other_target``: ties,
rounding, integer values at a small alpha) through ``softorder.core.sort.OTHER_TARGET``,
compiled the first time a row meets one: until then they hand such a row back, and their
hosts link it and run the row again. The same bits as with it linked from the start, float32
and float64 rows; a fresh process with ordinary rows compiles none of it, and one that meets a
rare target compiles it alone, not a second kernel.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from softorder import core
from softorder.core import permutation as perm
from softorder.core import sort
from softorder.core.sort import OTHER_TARGET, TIE_SEARCH

pytestmark = pytest.mark.skipif(
    not hasattr(sort._other_target, "overloads"),
    reason="NUMBA_DISABLE_JIT: the helper is a Python call, never handed back",
)


def _rows(rng, rows, n, dtype, values=None):
    """Row 0 integer-valued (``values`` of them, rare targets at a small alpha), the others
    normal, one with NaN.
    """
    x = rng.normal(size=(rows, n))
    x[0] = rng.integers(0, values or n // 20, n)
    x[-1, 5] = np.nan
    order = np.argsort(x, axis=1)
    return np.take_along_axis(x, order, axis=1).astype(dtype), order.astype(np.int32)


def _same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _check_hand_back(run):
    """``run(mode)`` -> (x_bar, alpha_bar, redo, count handed back) of a ladder VJP kernel,
    with ``OTHER_TARGET`` not linked ("unlinked"), linked ("linked"), or through its host from
    not linked ("host"): unlinked, the kernel hands row 0 (integer values) back and does the
    NaN row; linked, it hands none back; the host (hand back, link, the rows again) gives the
    linked bits, and so do the rows the unlinked kernel did.
    """
    unlinked = run("unlinked")
    assert unlinked[3] >= 1 and unlinked[2][0] == 1 and unlinked[2][-1] == 0  # (NaN row: done)
    linked = run("linked")
    assert linked[3] == 0 and not linked[2].any()
    host = run("host")
    _same_bits(host[2], linked[2])  # (redo: no row left)
    _same_once_linked(unlinked[:2], linked[:2], host[:2], ~np.asarray(unlinked[2], bool))


def _same_once_linked(unlinked, linked, host, done):
    """The host's arrays (a hand back, the link, the rows again) have the bits of the kernel
    run linked, and so do the rows ``done`` by the kernel run unlinked.
    """
    for got, want in zip(host, linked, strict=True):
        _same_bits(got, want)
    for got, want in zip(unlinked, linked, strict=True):
        _same_bits(got[done], want[done])


def _linked(mode, key):
    """``OTHER_TARGET`` for ``key`` as ``mode`` asks: linked, or not (a fresh process's)."""
    if mode == "linked":
        OTHER_TARGET.link(key)
    else:
        OTHER_TARGET.unlink()


def _sort_vjp(xs, order, alpha, u, offset, mode):
    """``sort.ladder_vjp`` (``mode`` "host") or its kernel -> gradients, ``redo``, and the
    count handed back.
    """
    rows, n = xs.shape
    x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
    work = core.workspace(rows, sort.LADDER_WORK, n)
    ring = np.empty((rows, sort.WINDOW)) if offset is None else None
    redo = np.empty(rows, np.uint8)
    args = (xs, order, alpha, offset, ring, u, x_bar, x_bar.view(np.int64), alpha_bar, work, redo)
    _linked(mode, xs.dtype.name)
    if mode == "host":
        sort.ladder_vjp(*args)
        return x_bar, alpha_bar, redo, None
    handed = sort._ladder_vjp(*args, False)
    return x_bar, alpha_bar, redo, handed


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("keep", [True, False])
def test_soft_sorts_rare_targets_are_linked_when_first_met(rng, dtype, keep):
    rows, n = 4, 600
    xs, order = _rows(rng, rows, n, dtype)
    alpha = np.full(rows, 0.01)
    u = rng.normal(size=(rows, n))
    out = np.empty((rows, n))
    offset = np.empty((rows, n)) if keep else None
    ratios = None if keep else np.empty((rows, sort.TBLOCK))
    work = core.workspace(rows, sort.LADDER_WORK, n)
    wide = work.reshape(rows, -1) if dtype == np.float32 else xs
    sort.ladder_forward(xs, alpha, out, out.view(np.int64), offset, ratios, wide, work, True)
    _check_hand_back(lambda mode: _sort_vjp(xs, order, alpha, u, offset, mode))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_long_rows_rare_targets_are_linked_when_first_met(rng, dtype):
    rows, n = 3, 3000
    # (few ties: lean_vjp hands rows whose tie sends an injection below its window to
    # ladder_vjp, linked or not)
    xs, order = _rows(rng, rows, n, dtype, values=4 * n)
    alpha = np.full(rows, 0.01)
    u = rng.normal(size=(rows, n))

    def run(mode):
        counts = np.empty((rows, n), sort.LEAN_COUNTS)
        E, B = np.empty((rows, n)), np.empty((rows, n))
        marks = np.empty((rows, n // sort.BD_STEP + 1))
        alpha_bar, redo = np.empty(rows), np.empty(rows, np.uint8)
        args = (xs, alpha, u, False, counts, E, B, marks, alpha_bar, redo)
        _linked(mode, xs.dtype.name)
        handed = sort.lean_vjp(*args) if mode == "host" else sort._lean_vjp(*args, False)
        x_bar = np.zeros((rows, n))
        sort.scatter_rows(xs, B, order, x_bar, redo)
        return x_bar, alpha_bar, redo, handed

    _check_hand_back(run)


def _permutation_case(rng, dtype):
    """Rows of the permutation loss (row 0 integer-valued), its forward's saved arrays and a
    cotangent.
    """
    rows, n = 4, 600
    xs, order = _rows(rng, rows, n, dtype)
    xs = xs.astype(np.float64)  # (the loss's kernels read float64 rows)
    target = (np.argsort(rng.normal(size=(rows, n)), axis=1) + 1).astype(np.int32)
    alpha = np.full(rows, 0.01)
    out = np.empty(rows)
    anchor, offset = np.empty((rows, n - 1), np.int32), np.empty((rows, n - 1))
    work = core.workspace(rows, perm.LADDER_FORWARD_WORK, n)
    perm.ladder_loss_forward(xs, order, alpha, target, out, anchor, offset, work)
    return (xs, order, alpha, target, anchor, offset, rng.normal(size=rows))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("host", ["ladder_loss_vjp", "ladder_vjp_left_rows"])
def test_permutation_losss_rare_targets_are_linked_when_first_met(rng, dtype, host):
    """Through ``ladder_loss_vjp`` (the NumPy API's), or the kernel then
    ``ladder_vjp_left_rows`` (the JAX bridge's handler and its callback).
    """
    args = _permutation_case(rng, dtype)
    rows, n = args[0].shape

    def run(mode):
        x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
        work = core.workspace(rows, perm.LADDER_VJP_WORK, n)
        _linked(mode, "float64")
        if mode != "host":
            return x_bar, alpha_bar, perm._ladder_vjp_rows(*args, x_bar, alpha_bar, work, False)
        if host == "ladder_loss_vjp":
            perm.ladder_loss_vjp(*args, x_bar, alpha_bar, work)
        elif perm._ladder_vjp_rows.serial(*args, x_bar, alpha_bar, work, False):
            perm.ladder_vjp_left_rows(*args, x_bar, alpha_bar)
        return x_bar, alpha_bar, None

    unlinked = run("unlinked")
    assert unlinked[2] >= 1 and np.isnan(unlinked[1][0])
    linked = run("linked")
    assert linked[2] == 0
    host = run("host")
    assert OTHER_TARGET.linked("float64")
    _same_once_linked(unlinked[:2], linked[:2], host[:2], ~np.isnan(unlinked[1]))


def test_soft_quantiles_ties_are_linked_when_first_met(rng):
    """``few_inverse_vjp`` (soft quantile's VJP) hands back a row whose target meets a tie
    while ``TIE_SEARCH`` is not linked; its host links it and runs the row again: the bits of
    the kernel with it linked.
    """
    rows, n = 3, 400
    x = rng.normal(size=(rows, n))
    x[0] = np.repeat(np.arange(n // 8, dtype=float), 8)  # (ties of 8 at every value)
    x[-1, 5] = np.nan
    order = np.argsort(x, axis=1).astype(np.int32)
    xs = np.take_along_axis(x, order, axis=1)
    alpha = np.full(rows, 1e-3)
    w = np.tile([100.0, 200.0], (rows, 1))  # (targets at the ties' edges)
    out = np.empty_like(w)
    anchor, offset = np.empty(w.shape, np.int64), np.empty_like(w)
    worder = np.argsort(w, axis=1)
    work = core.workspace(rows, core.lapsum.TABLES, n)
    core.lapsum.inverse_kernel(xs, alpha, w, worder, out, anchor, offset, work)
    u = rng.normal(size=w.shape)

    def run(mode):
        x_bar, w_bar, alpha_bar = np.empty((rows, n)), np.empty_like(w), np.empty(rows)
        args = (xs, order, alpha, anchor, offset, np.empty((rows, 0), np.int64), u)
        args += (x_bar, w_bar, alpha_bar, core.workspace(rows, sort.FEW_VJP_WORK, n))
        args += (np.empty((rows, 0, 2)),)
        if mode == "linked":
            TIE_SEARCH.link("float64")
        else:
            TIE_SEARCH.unlink()
        if mode == "host":
            return x_bar, w_bar, alpha_bar, sort.few_inverse_vjp(*args)
        return x_bar, w_bar, alpha_bar, sort._few_inverse_vjp(*args, False)

    unlinked = run("unlinked")
    assert unlinked[3] == 1 and np.isnan(unlinked[2][0]) and not np.isnan(unlinked[2][1])
    linked = run("linked")
    assert linked[3] == 0
    host = run("host")
    assert TIE_SEARCH.linked("float64")
    _same_once_linked(unlinked[:3], linked[:3], host[:3], slice(1, None))


def test_the_jax_bridge_links_the_rare_targets_when_first_met(rng):
    """The JAX bridge's permutation-loss handler leaves rows with rare targets while
    ``OTHER_TARGET`` is not linked; its callback links it and runs them again: the NumPy API's
    gradient to the bit.
    """
    jax = pytest.importorskip("jax")
    import softorder
    from softorder.bridges import jax as soj

    x = rng.integers(0, 30, (3, 400)).astype(np.float64)
    ranks = np.argsort(rng.normal(size=x.shape), axis=1) + 1
    loss, pullback = softorder.vjp(softorder.permutation_cross_entropy, x, ranks, 0.01)
    want = pullback(np.ones_like(loss))[0]
    OTHER_TARGET.unlink()

    def loss(v):
        return soj.permutation_cross_entropy(v, ranks, alpha=0.01).sum()

    with jax.enable_x64(True):
        got = np.asarray(jax.grad(loss)(jax.numpy.asarray(x)))
    assert OTHER_TARGET.linked("float64")
    _same_bits(got, want)


#: a fresh process's soft sort, permutation loss and soft quantile on the rows ``{rows}`` at
#: alpha ``{alphas}``: the count of each VJP kernel's compilations, the rare targets' helper's
#: row types and the count of the tie search's compilations
CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
import softorder
from softorder.core import permutation as perm, sort
rng = np.random.default_rng(0)
x = {rows}
for alpha in {alphas}:
    out, pullback = softorder.vjp(softorder.soft_sort, x, alpha)
    pullback(np.cos(out))
    ranks = np.argsort(rng.normal(size=x.shape), axis=1) + 1
    loss, pullback = softorder.vjp(softorder.permutation_cross_entropy, x, ranks, alpha)
    pullback(np.ones_like(loss))
    for q in (0.1, 0.25, 0.9):
        out, pullback = softorder.vjp(softorder.soft_quantile, x, q, alpha)
        pullback(np.ones_like(out))
kernels = (sort._ladder_vjp.serial, perm._ladder_vjp_rows.serial, perm._ladder_loss_row_vjp)
report = [len(k.signatures) for k in (*kernels, sort._few_inverse_vjp.serial)]
report.append(sorted(str(s[0].dtype) for s in sort._other_target.signatures))
report.append(len(sort._first_at_or_above.signatures))
print(json.dumps(report))
"""


def _child_report(code: str, **values):
    """Run ``code`` (formatted with the repository's root and ``values``) in a fresh process:
    the JSON of its last line of output.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", code.format(root=root, **values)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ordinary_rows_compile_no_rare_targets_path():
    """Normal rows at alphas from 0.1 to 100 meet no rare target: a fresh process compiles
    each VJP kernel once, and neither the rare targets' helper nor the tie search.
    """
    report = _child_report(CHILD, rows="rng.normal(size=(3, 500))", alphas=(0.1, 1.0, 100.0))
    assert report == [1, 1, 1, 1, [], 0]


def test_a_rare_target_compiles_the_helpers_alone():
    """Integer rows at a small alpha meet rare targets and ties: a fresh process compiles the
    rare targets' helper and the tie search for their dtype, and no second VJP kernel.
    """
    rows = "rng.integers(0, 100, (3, 400)).astype(float)"
    assert _child_report(CHILD, rows=rows, alphas=(0.01,)) == [1, 1, 1, 1, ["float64"], 1]
