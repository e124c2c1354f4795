"""The ladder VJPs' lean variants (compiled without the rare targets' path,
``softorder.core.sort._other_target``) hand a row that meets a rare target (ties, rounding:
integer values at a small alpha) to the full variant: the same bits as the full variant on
every row, float32 and float64 rows; rows without rare targets stay in the lean variant.
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


def _check_variants(run):
    """``run(rare)`` -> (x_bar, alpha_bar, redo, count handed back) of a soft sort VJP kernel:
    the lean variant hands row 0 (integer values) back and does the NaN row; the full one
    hands none back; the wrapper (lean, then full on the rows handed back) gives the full
    one's bits, and so do the rows the lean one did.
    """
    lean = run(None)
    assert lean[3] >= 1 and lean[2][0] == 1 and lean[2][-1] == 0  # (the NaN row: done)
    full = run(False)
    assert full[3] == 0 and not full[2].any()
    both = run("both")
    for got, want in zip(both[:3], full[:3], strict=True):
        _same_bits(got, want)
    done = ~np.asarray(lean[2], bool)
    for got, want in zip(lean[:2], full[:2], strict=True):
        _same_bits(got[done], want[done])


def _sort_vjp(xs, order, alpha, u, offset, rare):
    """``sort._ladder_vjp``'s kernel with ``rare`` (the lean then the full variant: None,
    otherwise the variant named) -> gradients, ``redo``, and the count handed back.
    """
    rows, n = xs.shape
    x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
    work = core.workspace(rows, sort.LADDER_WORK, n)
    ring = np.empty((rows, sort.WINDOW)) if offset is None else None
    redo = np.empty(rows, np.uint8)
    args = (xs, order, alpha, offset, ring, u, x_bar, x_bar.view(np.int64), alpha_bar, work, redo)
    if rare == "both":
        sort.ladder_vjp(*args)
        return x_bar, alpha_bar, redo, None
    handed = sort._ladder_vjp(*args, rare)
    return x_bar, alpha_bar, redo, handed


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("keep", [True, False])
def test_soft_sorts_rare_targets_take_the_full_variant(rng, dtype, keep):
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
    _check_variants(lambda rare: _sort_vjp(xs, order, alpha, u, offset, rare))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_long_rows_rare_targets_take_the_full_variant(rng, dtype):
    rows, n = 3, 3000
    # (few ties: lean_vjp hands rows whose tie sends an injection below its window to
    # ladder_vjp, with either variant)
    xs, order = _rows(rng, rows, n, dtype, values=4 * n)
    alpha = np.full(rows, 0.01)
    u = rng.normal(size=(rows, n))

    def run(rare):
        counts = np.empty((rows, n), sort.LEAN_COUNTS)
        E, B = np.empty((rows, n)), np.empty((rows, n))
        marks = np.empty((rows, n // sort.BD_STEP + 1))
        alpha_bar, redo = np.empty(rows), np.empty(rows, np.uint8)
        args = (xs, alpha, u, False, counts, E, B, marks, alpha_bar, redo)
        handed = sort.lean_vjp(*args) if rare == "both" else sort._lean_vjp(*args, rare)
        x_bar = np.zeros((rows, n))
        sort.scatter_rows(xs, B, order, x_bar, redo)
        return x_bar, alpha_bar, redo, handed

    _check_variants(run)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_permutation_losss_rare_targets_take_the_full_variant(rng, dtype):
    rows, n = 4, 600
    xs, order = _rows(rng, rows, n, dtype)
    xs = xs.astype(np.float64)  # (the loss's kernels read float64 rows)
    target = (np.argsort(rng.normal(size=(rows, n)), axis=1) + 1).astype(np.int32)
    alpha = np.full(rows, 0.01)
    out = np.empty(rows)
    anchor, offset = np.empty((rows, n - 1), np.int32), np.empty((rows, n - 1))
    work = core.workspace(rows, perm.LADDER_FORWARD_WORK, n)
    perm.ladder_loss_forward(xs, order, alpha, target, out, anchor, offset, work)
    cot = rng.normal(size=rows)
    args = (xs, order, alpha, target, anchor, offset, cot)

    def run(rare):
        x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
        work = core.workspace(rows, perm.LADDER_VJP_WORK, n)
        if rare == "both":
            perm.ladder_loss_vjp(*args, x_bar, alpha_bar, work)
            return x_bar, alpha_bar, None
        return x_bar, alpha_bar, perm._ladder_vjp_rows(*args, x_bar, alpha_bar, work, rare)

    lean = run(None)
    assert lean[2] >= 1 and np.isnan(lean[1][0])
    full = run(False)
    assert full[2] == 0
    both = run("both")
    for got, want in zip(both[:2], full[:2], strict=True):
        _same_bits(got, want)
    for got, want in zip(lean[:2], full[:2], strict=True):  # the rows the lean one did
        done = ~np.asarray(lean[2], bool) if lean[2] is not None else None
        _same_bits(got[done], want[done])


CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
import softorder
from softorder.core import permutation as perm, sort
rng = np.random.default_rng(0)
x = rng.normal(size=(3, 500))
for alpha in (0.1, 1.0, 100.0):
    out, pullback = softorder.vjp(softorder.soft_sort, x, alpha)
    pullback(np.cos(out))
    ranks = np.argsort(rng.normal(size=x.shape), axis=1) + 1
    loss, pullback = softorder.vjp(softorder.permutation_cross_entropy, x, ranks, alpha)
    pullback(np.ones_like(loss))
kernels = (sort._ladder_vjp, perm._ladder_vjp_rows)
kinds = [sorted({{str(s[-1]) for s in k.serial.signatures}}) for k in kernels]
kinds.append(sorted({{str(s[-1]) for s in perm._ladder_loss_row_vjp.signatures}}))
print(json.dumps(kinds))
"""

#: the full variant alone (what the JAX bridge's handler runs, and a process that has met a
#: rare target): its row pass, and not the lean one's too
FULL_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
import softorder
from softorder.core import permutation as perm
perm._RARE[0] = False
x = np.random.default_rng(0).normal(size=(2, 300))
ranks = np.tile(np.arange(1, 301), (2, 1))
loss, pullback = softorder.vjp(softorder.permutation_cross_entropy, x, ranks, 0.5)
pullback(np.ones_like(loss))
print(json.dumps(sorted({{str(s[-1]) for s in perm._ladder_loss_row_vjp.signatures}})))
"""


def _child_report(code: str):
    """Run ``code`` (formatted with the repository's root) in a fresh process: the JSON of
    its last line of output.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", code.format(root=root)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_full_variant_alone_compiles_its_row_pass_alone():
    """The permutation loss's full variant alone (the JAX handler's) compiles the row pass's
    full variant, not the lean one's too.
    """
    assert _child_report(FULL_CHILD) == ["bool"]


def test_ordinary_rows_take_the_lean_variants_alone():
    """Normal rows at alphas from 0.1 to 100 meet no rare target: a fresh process compiles
    (or loads) the lean variants of soft sort's and the permutation loss's VJPs alone.
    """
    assert _child_report(CHILD) == [["none"], ["none"], ["none"]]


def test_after_a_row_needed_the_full_variant_every_row_takes_it(rng):
    """A row handed back is computed twice: once the full variant is compiled, the wrappers
    run it alone (the same bits).
    """
    rows, n = 2, 300
    xs, order = _rows(rng, rows, n, np.float64)
    alpha = np.full(rows, 0.01)
    u = rng.normal(size=(rows, n))
    saved = sort.ladder_vjp.rare[0], perm._RARE[0]
    try:
        _both_take_the_full_variant_after_a_hand_back(rng, xs, order, alpha, u)
    finally:
        sort.ladder_vjp.rare[0], perm._RARE[0] = saved


def _both_take_the_full_variant_after_a_hand_back(rng, xs, order, alpha, u):
    rows, n = xs.shape
    sort.ladder_vjp.rare[0] = None
    before = _sort_vjp(xs, order, alpha, u, None, "both")
    assert sort.ladder_vjp.rare[0] is False
    after = _sort_vjp(xs, order, alpha, u, None, "both")
    for got, want in zip(after[:3], before[:3], strict=True):
        _same_bits(got, want)
    target = (np.argsort(rng.normal(size=(rows, n)), axis=1) + 1).astype(np.int32)
    perm._RARE[0] = None
    out = np.empty(rows)
    anchor, offset = np.empty((rows, n - 1), np.int32), np.empty((rows, n - 1))
    work = core.workspace(rows, perm.LADDER_FORWARD_WORK, n)
    perm.ladder_loss_forward(xs, order, alpha, target, out, anchor, offset, work)
    grads = []
    for _ in range(2):
        x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
        work = core.workspace(rows, perm.LADDER_VJP_WORK, n)
        perm.ladder_loss_vjp(
            xs, order, alpha, target, anchor, offset, np.ones(rows), x_bar, alpha_bar, work
        )
        grads.append((x_bar, alpha_bar))
        assert perm._RARE[0] is False
    for got, want in zip(*grads, strict=True):
        _same_bits(got, want)
