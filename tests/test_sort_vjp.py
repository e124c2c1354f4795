"""Soft sort's own VJP kernels (:func:`softorder.core.sort.sort_vjp`, and
:func:`~softorder.core.sort.ladder_vjp` after :func:`~softorder.core.sort.ladder_forward`)
against the general :func:`~softorder.core.sort.inverse_vjp` at the targets k - 1/2, bit for
bit, including NaN rows, ties, infinities, ``x_bar`` written into the cotangent, targets out of
order, float32 rows and float32 cotangents and gradients.
"""

import numpy as np
import pytest

import softorder
from softorder import core


def _rows(rng, kind, rows, n):
    x = rng.normal(size=(rows, n))
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "infinite" and n >= 3:
        x[0, :3] = np.inf
        x[-1, 0] = -np.inf
        x[-1, 1:3] = x[-1, 3 % n]
    elif kind == "nan":
        x[0, n // 2] = np.nan
    elif kind == "spread":
        x *= 1e4
    order = np.argsort(x, axis=1)
    return np.take_along_axis(x, order, axis=1), order


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "nan", "spread"])
@pytest.mark.parametrize("shape", [(3, 1), (2, 2), (3, 40), (2, 1000)])
def test_sort_vjp_equals_inverse_vjp_bitwise(rng, kind, shape):
    rows, n = shape
    xs, order = _rows(rng, kind, rows, n)
    alpha = rng.uniform(1e-3, 3.0, rows)
    anchor, offset = _ladder(xs, alpha)
    u = rng.normal(size=(rows, n))
    x_bar, alpha_bar = _inverse_vjp(xs, order, alpha, anchor, offset, u)
    work = core.workspace(rows, core.sort.SORT_VJP_WORK, n)
    got, got_alpha = np.empty((rows, n)), np.empty(rows)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u, got, got_alpha, work)
    np.testing.assert_array_equal(got, x_bar)
    np.testing.assert_array_equal(got_alpha, alpha_bar)
    in_place, in_place_alpha = u.copy(), np.empty(rows)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, in_place, in_place, in_place_alpha, work)
    np.testing.assert_array_equal(in_place, x_bar)
    np.testing.assert_array_equal(in_place_alpha, alpha_bar)


def _ladder(xs, alpha):
    rows, n = xs.shape
    anchor, offset = np.empty((rows, n), np.int64), np.empty((rows, n))
    core.lapsum.sort_kernel(
        xs, alpha, np.empty((rows, n)), anchor, offset, core.workspace(rows, 3, n)
    )
    return anchor, offset


def _inverse_vjp(xs, order, alpha, anchor, offset, u):
    rows, n = xs.shape
    x_bar, alpha_bar = np.empty((rows, n)), np.empty(rows)
    core.inverse_vjp(
        xs,
        order,
        alpha,
        anchor,
        offset,
        np.empty((rows, 0), np.int64),
        u,
        x_bar,
        np.empty((rows, 0)),
        alpha_bar,
        core.workspace(rows, core.sort.VJP_WORK, n),
        core.workspace(rows, 0, n),
    )
    return x_bar, alpha_bar


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "spread"])
def test_sort_vjp_takes_targets_in_any_order(rng, kind):
    # the targets' left points out of order restart the recurrences of A and Ad: the same
    # values as the general VJP, which reads them from rows
    rows, n = 2, 300
    xs, order = _rows(rng, kind, rows, n)
    alpha = rng.uniform(1e-2, 1.0, rows)
    anchor, offset = _ladder(xs, alpha)
    shuffle = np.stack([rng.permutation(n) for _ in range(rows)])
    anchor = np.take_along_axis(anchor, shuffle, 1)
    offset = np.take_along_axis(offset, shuffle, 1)
    u = rng.normal(size=(rows, n))
    want, want_alpha = _inverse_vjp(xs, order, alpha, anchor, offset, u)
    got, got_alpha = np.empty((rows, n)), np.empty(rows)
    work = core.workspace(rows, core.sort.SORT_VJP_WORK, n)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u, got, got_alpha, work)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_alpha, want_alpha)


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "nan", "spread"])
def test_sort_vjp_of_float32_cotangents_is_the_float64_one_rounded(rng, kind):
    rows, n = 3, 200
    xs, order = _rows(rng, kind, rows, n)
    order = order.astype(np.int32)  # the host's index dtype
    alpha = rng.uniform(1e-2, 1.0, rows)
    anchor, offset = _ladder(xs, alpha)
    u32 = rng.normal(size=(rows, n)).astype(np.float32)
    u32[:, ::7] = 0.0
    want, want_alpha = _inverse_vjp(xs, order, alpha, anchor, offset, u32.astype(np.float64))
    got, got_alpha = np.empty((rows, n), np.float32), np.empty(rows)
    work = core.workspace(rows, core.sort.SORT_VJP_WORK, n)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u32, got, got_alpha, work)
    np.testing.assert_array_equal(got.view(np.int32), want.astype(np.float32).view(np.int32))
    np.testing.assert_array_equal(got_alpha, want_alpha)


@pytest.mark.parametrize("descending", [False, True])
def test_float32_soft_sort_gradients_are_the_float64_ones_rounded(rng, descending):
    x32 = rng.normal(size=(3, 50)).astype(np.float32)
    x32[1, ::5] = x32[1, 2]  # ties
    x64 = x32.astype(np.float64)
    for alpha in (0.01, 0.5, 4.0):
        out32, pull32 = softorder.vjp(softorder.soft_sort, x32, alpha=alpha, descending=descending)
        _, pull64 = softorder.vjp(softorder.soft_sort, x64, alpha=alpha, descending=descending)
        u = rng.normal(size=out32.shape).astype(np.float32)
        want = [np.asarray(g).astype(np.float32) for g in pull64(u.astype(np.float64))]
        for cotangent in (u, u.astype(np.float64)):  # read in place / softorder's copy
            for g, w in zip(pull32(cotangent), want, strict=True):
                assert np.asarray(g).dtype == np.float32
                np.testing.assert_array_equal(np.asarray(g).view(np.int32), w.view(np.int32))


def test_sort_vjp_of_a_target_beyond_a_long_tie_block(rng):
    # a target just above a block of 20 equal values, anchored at its first: its injection
    # lands far from the target
    n = 100
    x = np.sort(rng.normal(size=n))
    x[40:60] = x[40]
    xs, order = x.reshape(1, n), np.arange(n).reshape(1, n)
    alpha = np.array([0.05])
    anchor, offset = _ladder(xs, alpha)
    j = int(np.searchsorted(anchor[0], 40))
    anchor[0, j], offset[0, j] = 40, 0.01
    u = rng.normal(size=(1, n))
    want, want_alpha = _inverse_vjp(xs, order, alpha, anchor, offset, u)
    got, got_alpha = np.empty((1, n)), np.empty(1)
    work = core.workspace(1, core.sort.SORT_VJP_WORK, n)
    core.sort.sort_vjp(xs, order, alpha, anchor, offset, u, got, got_alpha, work)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_alpha, want_alpha)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sort_pullback_allocates_the_gradient_and_three_rows(dtype):
    from tests.test_memory import N, _pullback_peak

    x = np.random.default_rng(3).standard_normal(N).astype(dtype)
    # the gradient (float32 for a float32 input: no float64 copy of the cotangent) and 3 rows
    # of scratch (sort_vjp: 5 rows; inverse_vjp's path: a float64 gradient and 7 rows)
    itemsize = np.dtype(dtype).itemsize
    assert _pullback_peak(softorder.soft_sort, x) <= (24 + itemsize) * N + 4096


def test_sort_forward_keeps_the_offsets_and_a_float32_row():
    import tracemalloc

    n = 100_000
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    softorder.vjp(softorder.soft_sort, x, alpha=0.1)  # kernels compiled or loaded
    tracemalloc.start()
    try:
        out, pullback = softorder.vjp(softorder.soft_sort, x, alpha=0.1)
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # the result, the float32 sorted row, its int32 order and the float64 offsets (the
    # anchors are counted again by the VJP): 20 bytes per element
    assert out.dtype == np.float32
    assert kept <= 20 * n + 16384
    del pullback


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "nan", "spread"])
def test_sort_forward_is_sort_kernel_with_int32_anchors(rng, kind):
    rows, n = 3, 300
    xs, _ = _rows(rng, kind, rows, n)
    alpha = rng.uniform(1e-3, 3.0, rows)
    want = np.empty((rows, n))
    anchor, offset = np.empty((rows, n), np.int64), np.empty((rows, n))
    work = core.workspace(rows, core.lapsum.SORT_TABLES, n)
    core.lapsum.sort_kernel(xs, alpha, want, anchor, offset, work)
    for dtype in (np.float64, np.float32):
        out = np.empty((rows, n), dtype)
        anchor32, offset32 = np.empty((rows, n), np.int32), np.empty((rows, n))
        core.lapsum.sort_forward(xs, alpha, out, anchor32, offset32, work)
        np.testing.assert_array_equal(out, want.astype(dtype))
        np.testing.assert_array_equal(anchor32, anchor)
        np.testing.assert_array_equal(offset32, offset)


@pytest.mark.parametrize("zeros", ["head", "tail", "all"])
def test_soft_sort_gradient_with_zero_cotangents_matches_finite_differences(rng, zeros):
    # zero cotangents skip targets in the pullback: the gradient of <u, soft_sort(x)> must
    # still be its directional derivative (a kernel that kept table values in the skipped
    # slots once gave gradients of 55.8 for a zero cotangent)
    n = 100
    x = rng.normal(size=n)
    u = rng.normal(size=n)
    if zeros == "head":
        u[: n - 3] = 0.0
    elif zeros == "tail":
        u[3:] = 0.0
    else:
        u[:] = 0.0
    out, pullback = softorder.vjp(softorder.soft_sort, x, 0.3)
    x_bar, alpha_bar = pullback(u)
    xs, order = np.sort(x).reshape(1, n), np.argsort(x).reshape(1, n)
    anchor, offset = _ladder(xs, np.array([0.3]))
    want, want_alpha = _inverse_vjp(xs, order, np.array([0.3]), anchor, offset, u.reshape(1, n))
    np.testing.assert_array_equal(x_bar, want[0])
    np.testing.assert_array_equal(alpha_bar, want_alpha[0])
    d = rng.normal(size=n)
    h = 1e-6
    plus = softorder.soft_sort(x + h * d, 0.3)
    minus = softorder.soft_sort(x - h * d, 0.3)
    np.testing.assert_allclose(x_bar @ d, u @ (plus - minus) / (2 * h), rtol=1e-5, atol=1e-7)


def _ladder_forward(xs, alpha, out_dtype=np.float64, keep=True, lean=False):
    """:func:`~softorder.core.sort.ladder_forward`'s values and offsets (``xs`` float32 or
    float64; without ``keep``, the offsets' array has no columns: soft sort's forward; with
    ``lean``, two rows of scratch, the longest float32 rows' forward).
    """
    rows, n = xs.shape
    out = np.empty((rows, n), out_dtype)
    offset, ratios = (
        (np.empty((rows, n)), None) if keep else (None, np.empty((rows, core.sort.TBLOCK)))
    )
    counts = out.view(np.int32 if out_dtype == np.float32 else np.int64)
    width = core.sort.LEAN_FORWARD_WORK if lean else core.sort.LADDER_WORK
    work = core.workspace(rows, width, n)
    if lean:  # (the two rows side by side)
        work = work.reshape(rows, -1)
    wide = work.reshape(rows, -1) if xs.dtype == np.float32 else xs
    core.sort.ladder_forward(xs, alpha, out, counts, offset, ratios, wide, work, True)
    return out, offset


def _ladder_vjp(xs, order, alpha, offset, u, x_bar_dtype=np.float64):
    """:func:`~softorder.core.sort.ladder_vjp`'s gradients and ``redo``, with the forward
    pass's offsets, or solving them again where ``offset`` is None.
    """
    rows, n = xs.shape
    x_bar, alpha_bar = np.empty((rows, n), x_bar_dtype), np.empty(rows)
    counts = x_bar.view(np.int32 if x_bar_dtype == np.float32 else np.int64)
    work = core.workspace(rows, core.sort.LADDER_WORK, n)
    redo = np.empty(rows, np.uint8)
    ring = np.empty((rows, core.sort.WINDOW)) if offset is None else None
    core.sort.ladder_vjp(xs, order, alpha, offset, ring, u, x_bar, counts, alpha_bar, work, redo)
    return x_bar, alpha_bar, redo


def _lean_vjp(xs, order, alpha, u, x_bar_dtype=np.float64, counts_dtype=None):
    """:func:`~softorder.core.sort.lean_vjp` and :func:`~softorder.core.sort.scatter_rows`:
    the gradients and ``redo`` (rows flagged there are left NaN).
    """
    rows, n = xs.shape
    counts = np.empty((rows, n), counts_dtype or core.sort.LEAN_COUNTS)
    E, B = np.full((rows, n), np.nan), np.full((rows, n), np.nan)  # (nothing read unwritten)
    marks = np.full((rows, n // core.sort.BD_STEP + 1), np.nan)
    alpha_bar, redo = np.full(rows, np.nan), np.empty(rows, np.uint8)
    core.sort.lean_vjp(xs, alpha, u, False, counts, E, B, marks, alpha_bar, redo)
    x_bar = np.full((rows, n), np.nan, x_bar_dtype)
    core.sort.scatter_rows(xs, B, order, x_bar, redo)
    return x_bar, alpha_bar, redo


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "nan", "spread"])
@pytest.mark.parametrize("shape", [(3, 1), (2, 2), (3, 40), (2, 1000)])
@pytest.mark.parametrize("row_dtype", [np.float64, np.float32])
def test_ladder_kernels_equal_sort_forward_and_inverse_vjp_bitwise(rng, kind, shape, row_dtype):
    rows, n = shape
    xs, order = _rows(rng, kind, rows, n)
    xs = xs.astype(row_dtype)  # a float32 row's values widen exactly: the float64 row's bits
    wide = xs.astype(np.float64)
    order = order.astype(np.int32)
    alpha = rng.uniform(1e-3, 3.0, rows)
    for out_dtype in (np.float64, np.float32):
        want = np.empty((rows, n), out_dtype)
        anchor, offset = np.empty((rows, n), np.int32), np.empty((rows, n))
        work = core.workspace(rows, core.lapsum.SORT_TABLES, n)
        core.lapsum.sort_forward(wide, alpha, want, anchor, offset, work)
        out, got_offset = _ladder_forward(xs, alpha, out_dtype)
        np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(got_offset.view(np.uint8), offset.view(np.uint8))
        # soft sort's forward keeps no offsets: the same values
        out = _ladder_forward(xs, alpha, out_dtype, keep=False)[0]
        np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
        # ... nor, on the longest rows, a row of A
        out = _ladder_forward(xs, alpha, out_dtype, keep=False, lean=True)[0]
        np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
        # without the values, the anchors stay where the counts were
        counts = np.empty((rows, n), np.int32 if out_dtype == np.float32 else np.int64)
        plain, kept = counts.view(out_dtype), np.empty((rows, n))
        work = core.workspace(rows, core.sort.LADDER_WORK, n)
        wide_row = work.reshape(rows, -1) if xs.dtype == np.float32 else xs
        core.sort.ladder_forward(xs, alpha, plain, counts, kept, None, wide_row, work, False)
        np.testing.assert_array_equal(counts, anchor)
        np.testing.assert_array_equal(kept.view(np.uint8), offset.view(np.uint8))
    anchor = anchor.astype(np.int64)  # (inverse_vjp's type)
    u = rng.normal(size=(rows, n))
    u[:, ::5] = 0.0  # skipped targets
    x_bar, alpha_bar = _inverse_vjp(wide, order, alpha, anchor, offset, u)
    u32 = u.astype(np.float32)
    x_bar32, alpha_bar32 = _inverse_vjp(wide, order, alpha, anchor, offset, u32.astype(np.float64))
    for kept in (got_offset, None):  # the forward pass's offsets, or solved again
        got, got_alpha, redo = _ladder_vjp(xs, order, alpha, kept, u)
        assert not redo.any()
        np.testing.assert_array_equal(got, x_bar)
        np.testing.assert_array_equal(got_alpha, alpha_bar)
        got, got_alpha, redo = _ladder_vjp(xs, order, alpha, kept, u32, np.float32)
        want = x_bar32.astype(np.float32).view(np.int32)
        np.testing.assert_array_equal(got.view(np.int32), want)
        np.testing.assert_array_equal(got_alpha, alpha_bar32)
    # the longest rows' VJP (two rows of scratch): the same bits on every row it does not
    # hand back (ties whose injection lands below its window), and it hands back none here
    for uu, dtype, want, want_alpha in (
        (u, np.float64, x_bar, alpha_bar),
        (u32, np.float32, x_bar32.astype(np.float32), alpha_bar32),
    ):
        got, got_alpha, redo = _lean_vjp(xs, order, alpha, uu, dtype)
        if kind != "ties":
            assert not redo.any()
        done = redo == 0
        np.testing.assert_array_equal(got[done].view(np.uint8), want[done].view(np.uint8))
        np.testing.assert_array_equal(got_alpha[done], want_alpha[done])


@pytest.mark.parametrize("zeros", ["head", "tail", "middle", "all"])
def test_ladder_vjp_with_zero_cotangents_leaves_no_table_values(rng, zeros):
    # the injections wait in the rows of B and Bd: slots the skipped targets never reached
    # must hold 0, not the tables (the withdrawn 3-row kernel gave 55.8 for a zero cotangent)
    rows, n = 2, 500
    xs, order = _rows(rng, "normal", rows, n)
    alpha = np.array([0.05, 0.7])
    anchor, offset = _ladder(xs, alpha)
    u = rng.normal(size=(rows, n))
    part = {"head": np.s_[:, : n - 3], "tail": np.s_[:, 3:], "middle": np.s_[:, 50:450]}
    u[part.get(zeros, np.s_[:, :])] = 0.0
    want, want_alpha = _inverse_vjp(xs, order, alpha, anchor, offset, u)
    for kept in (offset, None):  # the forward pass's offsets, or solved again
        got, got_alpha, redo = _ladder_vjp(xs, order, alpha, kept, u)
        assert not redo.any()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_alpha, want_alpha)
    got, got_alpha, redo = _lean_vjp(xs, order, alpha, u)  # (the upward sums carried early)
    assert not redo.any()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_alpha, want_alpha)


def test_ladder_injection_beyond_the_window_is_refused():
    # ladder_vjp hands a row back (redo) when a tie's injection would land beyond the window
    # of injections (a safety net: solved offsets put the point at or above a target at its
    # right point): _inject_in_window then refuses it and injects nothing
    import numba

    @numba.njit
    def inject(r, t, win_up, win_down, B, Bd):
        # (inv_alpha 1, ra = r[0], no shift, cotangent 1, from point 0, F = 0)
        inject_in_window = core.sort._inject_in_window
        return inject_in_window(r, 1.0, r[0], t, 0.0, 1.0, 0, 0, B, Bd, win_up, win_down)

    r = np.arange(100.0)
    window = core.sort.WINDOW
    for t, inside in ((5.5, True), (window - 1.5, True), (window - 0.5, False), (40.0, False)):
        win_up, win_down, B, Bd = np.zeros(window), np.zeros(window), np.zeros(100), np.zeros(100)
        assert inject(r, t, win_up, win_down, B, Bd) == inside
        if inside:  # the points at and below the target: slots of the window
            i = int(np.ceil(t))
            assert win_up[i % window] > 0.0 and win_down[(i - 1) % window] > 0.0
            assert np.count_nonzero(win_up) == 1 and np.count_nonzero(win_down) == 1
        else:
            assert not (win_up.any() or win_down.any() or B.any() or Bd.any())


@pytest.mark.parametrize("shape, row", [((3, 60), 1), ((1, 60), 0), ((60,), 0)])
def test_soft_sort_runs_handed_back_rows_on_sort_vjp(rng, monkeypatch, shape, row):
    # the rule reruns the rows ladder_vjp hands back on sort_vjp: the same gradients (one
    # row's flag is read on its own)
    x = rng.normal(size=shape)
    x.reshape(-1, 60)[row, 10:30] = x.reshape(-1, 60)[row, 10]  # ties
    u = rng.normal(size=x.shape)
    for dtype in (np.float64, np.float32):
        xd, ud = x.astype(dtype), u.astype(dtype)
        want = softorder.vjp(softorder.soft_sort, xd, alpha=0.3)[1](ud)
        kernel = core.sort.ladder_vjp

        def handing_back(*args, kernel=kernel):
            kernel(*args)
            args[-1][row] = 1  # redo: that row

        monkeypatch.setattr(core.sort, "ladder_vjp", handing_back)
        rerun = core.sort.sort_vjp
        calls = []
        monkeypatch.setattr(
            core.sort, "sort_vjp", lambda *a, c=calls, f=rerun: c.append(1) or f(*a)
        )
        got = softorder.vjp(softorder.soft_sort, xd, alpha=0.3)[1](ud)
        monkeypatch.setattr(core.sort, "ladder_vjp", kernel)
        monkeypatch.setattr(core.sort, "sort_vjp", rerun)
        assert calls == [1]
        for g, w in zip(got, want, strict=True):
            assert np.asarray(g).dtype == dtype
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_soft_sort_residuals_and_jvp_solve_the_anchors_again(rng, dtype):
    # the forward pass keeps no anchors: the bridges' residuals and the JVP solve them again,
    # the same bits as sort_forward's
    from softorder._engine.autodiff import rule_named

    x = rng.normal(size=(2, 30)).astype(dtype)
    rule = rule_named("soft_sort")
    ctx = rule.prepare(x=x, alpha=0.2, axis=-1, descending=False)
    rule.forward(ctx)
    residuals = rule.residuals(ctx)
    assert tuple(residuals) == ("order", "anchor", "offset")
    xs = np.take_along_axis(x.astype(np.float64), np.argsort(x, axis=1, kind="stable"), 1)
    anchor, offset = np.empty(xs.shape, np.int32), np.empty(xs.shape)
    core.lapsum.sort_forward(
        xs, np.full(2, 0.2), np.empty(xs.shape), anchor, offset, core.workspace(2, 3, 30)
    )
    np.testing.assert_array_equal(residuals["anchor"], anchor)
    np.testing.assert_array_equal(residuals["offset"].view(np.uint8), offset.view(np.uint8))
    tangent = rng.normal(size=x.shape).astype(dtype)
    out, jvp = softorder.jvp(softorder.soft_sort, (x,), (tangent,), alpha=0.2)
    h = 1e-6
    plus = softorder.soft_sort(x.astype(np.float64) + h * tangent, alpha=0.2)
    minus = softorder.soft_sort(x.astype(np.float64) - h * tangent, alpha=0.2)
    np.testing.assert_allclose(jvp, (plus - minus) / (2 * h), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("descending", [False, True])
def test_soft_sort_of_long_rows_keeps_no_offsets(rng, monkeypatch, dtype, descending):
    # rows of SOLVE_AGAIN_N or more: the forward pass keeps no offsets and the VJP solves
    # them again, the same gradients to the bit (rows made "long" here by lowering the
    # bound: the kernels do not look at it)
    from softorder._engine.autodiff import rule_named

    x = rng.normal(size=(3, 200)).astype(dtype)
    x[1, 50:90] = x[1, 50]  # ties
    x[2, 7] = np.inf
    u = rng.normal(size=x.shape).astype(dtype)
    alpha = np.array([[0.01], [0.3], [30.0]])
    want = softorder.vjp(softorder.soft_sort, x, alpha=alpha, descending=descending)
    monkeypatch.setattr(core.sort, "SOLVE_AGAIN_N", 200)
    rule = rule_named("soft_sort")
    ctx = rule.prepare(x=x, alpha=alpha, axis=-1, descending=descending)
    rule.forward(ctx)
    assert "offset" not in ctx.saved
    got = softorder.vjp(softorder.soft_sort, x, alpha=alpha, descending=descending)
    np.testing.assert_array_equal(got[0], want[0])
    for g, w in zip(got[1](u), want[1](u), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "spread", "clusters"])
def test_ladder_vjp_counts_the_forward_passes_anchors(rng, kind):
    # the VJP's anchors are counted from its own tables (descending_counts, A by its
    # recurrence): they must be the forward pass's (prefix_counts) to the bit, or an offset
    # would be read from the wrong point; and both fused passes' tables must be those of
    # prefix_tables_halves and descending_tables, their counts those of the tables
    import numba

    @numba.njit
    def both(xs, alpha, forward_counts, vjp_counts, tables):
        rows, n = xs.shape
        E, A, B = np.empty(n), np.empty(n), np.empty(n)
        Ev, Bv, Bdv = np.empty(n), np.empty(n), np.empty(n)
        for row in range(rows):
            # the kernels' decays (one pass before the fused ones)
            core.rank.decays(xs[row], 1.0 / alpha[row], E)
            core.rank.decays(xs[row], 1.0 / alpha[row], Ev)
            core.sort.prefix_counts(xs[row], 1.0 / alpha[row], E, (A,), B, 0.5, forward_counts[row])
            core.sort.descending_counts(
                xs[row], 1.0 / alpha[row], Ev, Bv, Bdv, 0.5, vjp_counts[row]
            )
            t = tables[row]
            core.lapsum.prefix_tables_halves(xs[row], 1.0 / alpha[row], t[0], t[1], t[2])
            core.sort.descending_tables(xs[row], 1.0 / alpha[row], t[3], t[4], t[5])
            for i in range(n):
                if (E[i], A[i], B[i], Ev[i], Bv[i], Bdv[i]) != (
                    t[0, i],
                    t[1, i],
                    t[2, i],
                    t[3, i],
                    t[4, i],
                    t[5, i],
                ):
                    t[6, 0] = 1.0

    rows, n = 40, 700
    if kind == "clusters":
        x = np.repeat(rng.normal(size=(rows, n // 50)), 50, axis=1)
        x += rng.normal(size=x.shape) * 1e-9
        xs = np.sort(x, axis=1)
    else:
        xs = _rows(rng, kind, rows, n)[0]
    alpha = np.exp(rng.uniform(np.log(1e-4), np.log(30.0), rows))
    forward_counts, vjp_counts = np.empty((rows, n), np.int64), np.empty((rows, n), np.int64)
    tables = np.zeros((rows, 7, n))
    both(xs, alpha, forward_counts, vjp_counts, tables)
    np.testing.assert_array_equal(vjp_counts, forward_counts)
    assert not tables[:, 6, 0].any()  # (NaN-free rows: != is a bitwise comparison there)
    for row in range(rows):  # the counts of the tables, in Python
        E, A, B = tables[row, :3]
        first = np.ceil(np.arange(n) + 0.5 + 0.5 * (B - A) - 0.5).astype(np.int64)
        want = np.bincount(np.maximum(first[first < n], 0), minlength=n)
        np.testing.assert_array_equal(forward_counts[row], want)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_block_weights_are_target_weights_to_the_bit(rng, dtype):
    # the ladder pullbacks' weights of a target (_usual_weights on the block's rows, G and Z
    # composed as the pullbacks compose them, other_target_weights for the other targets)
    # must be target_weights' own outputs: signed zeros, infinities, equal values and
    # infinite 1 / alpha included, the anchor at either point
    import numba

    from softorder.core.lapsum import other_target_weights, target_weights
    from softorder.core.sort import _BLOCK_ROWS, _SKIP, TBLOCK, _usual_weights

    @numba.njit
    def block_weights(r, inv_alpha, ra, t, an, L, R, aL, adL, bR, bdR):
        """One target's weights as _ladder_pullback takes them (first slot of a block)."""
        n = r.shape[0]
        rows = np.zeros((_BLOCK_ROWS, TBLOCK))
        inside = L >= 0 and R < n
        rows[0, 0] = t
        rows[1, 0] = ra
        rows[2, 0] = r[L] if inside else np.nan
        rows[3, 0] = r[R] if inside else r[an]
        rows[4, 0] = bR
        rows[5, 0] = bdR
        _usual_weights(
            1.0 / inv_alpha,
            inv_alpha,
            rows[0],
            rows[1],
            rows[2],
            rows[3],
            rows[4],
            rows[5],
            rows[6],
            rows[7],
            rows[8],
            rows[9],
            rows[10],
        )
        el = rows[6, 0]
        if el == _SKIP:  # an infinite target: skipped (nothing to pull back)
            return 0, 0.0, 0.0, 0.0, 0.0
        if el >= 0.0:
            G = aL * el + rows[9, 0]
            Z = (rows[8, 0] * aL + adL) * el + rows[10, 0]
            return 1, G, Z, el, rows[7, 0]
        how, G, Z, el, er, _ = other_target_weights(r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR)
        return how, G, Z, el, er

    @numba.njit
    def compare(r, inv_alpha, an, t, tables, got, want):
        n = r.shape[0]
        for k in range(an.shape[0]):
            ra = np.float64(r[an[k]])
            # the ladder's left point, or (odd k) either point beside the anchor
            L = an[k] - 1 if (t[k] <= 0.0 if k % 2 == 0 else k % 4 == 1) else an[k]
            R = L + 1
            a = tables[k, 0] if L >= 0 else 0.0
            ad = tables[k, 1] if L >= 0 else 0.0
            b = tables[k, 2] if R < n else 0.0
            bd = tables[k, 3] if R < n else 0.0
            h1, g1, z1, l1, r1 = block_weights(r, inv_alpha[k], ra, t[k], an[k], L, R, a, ad, b, bd)
            h2, g2, z2, l2, r2, _ = target_weights(r, inv_alpha[k], ra, t[k], L, R, a, ad, b, bd)
            position = ra if t[k] == 0.0 or abs(ra) == np.inf else ra + t[k] / inv_alpha[k]
            if abs(position) == np.inf:  # skipped by the pullbacks, whatever its weights
                h1, g1, z1, l1, r1 = h2, g2, z2, l2, r2
            got[k, 0], got[k, 1], got[k, 2], got[k, 3], got[k, 4] = h1, g1, z1, l1, r1
            want[k, 0], want[k, 1], want[k, 2], want[k, 3], want[k, 4] = h2, g2, z2, l2, r2

    pool = np.array([0.0, -0.0, 1.0, -1.0, 1e-300, -1e-300, 5e-324, 3.0, np.inf, -np.inf])
    for _ in range(20):
        n = int(rng.integers(1, 40))
        r = np.where(rng.random(n) < 0.5, rng.choice(pool, n), rng.normal(size=n))
        r = np.sort(r.astype(dtype))
        m = 2000
        an = rng.integers(0, n, m)
        t = rng.choice(np.array([0.0, -0.0, 1e-12, -1e-12, 0.5, -0.5, 3.0, -3.0, 800.0, -800.0]), m)
        t = np.where(rng.random(m) < 0.5, t, rng.normal(size=m) * 10.0 ** rng.uniform(-6, 3, m))
        inv_alpha = 10.0 ** rng.uniform(-8, 8, m)
        inv_alpha[rng.random(m) < 0.05] = np.inf
        tables = np.abs(rng.normal(size=(m, 4))) + np.array([1.0, 0.0, 1.0, 0.0])
        got = np.empty((m, 5))
        want = np.empty((m, 5))
        compare(r, inv_alpha, an, t, tables, got, want)
        np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("kind", ["normal", "ties", "infinite", "spread"])
@pytest.mark.parametrize("n", [63, 64, 65, 130])
@pytest.mark.parametrize("scale", [1e-6, 1e-3, 0.1, 1e8])
def test_ladder_vjp_blocks_equal_inverse_vjp_bitwise(rng, kind, n, scale):
    # _ladder_pullback's blocks of TBLOCK targets (a short last block), the usual weights
    # computed ahead and the others by other_target_weights: targets far apart (factors of
    # 0 below UNDERFLOW, or between it and exp_main's range: gaps of 600 alpha), close ones
    # and ties, beyond the row's ends (most targets at scale 1e8: alpha far above the
    # values), float64 and float32 cotangents with zeros
    assert core.sort.TBLOCK == 64
    xs, order = _rows(rng, kind, 3, n)
    if kind == "normal":
        xs[2] = np.arange(n) * 600.0 * scale  # exp(-600): outside exp_main's range, above 0
    alpha = np.array([scale, scale * 10.0, scale])
    anchor, offset = _ladder(xs, alpha)
    u = rng.normal(size=(3, n))
    u[:, ::7] = 0.0
    x_bar, alpha_bar = _inverse_vjp(xs, order, alpha, anchor, offset, u)
    u32 = u.astype(np.float32)
    x_bar32, alpha_bar32 = _inverse_vjp(xs, order, alpha, anchor, offset, u32.astype(np.float64))
    for kept in (offset, None):  # the forward pass's offsets, or solved again
        got, got_alpha, redo = _ladder_vjp(xs, order, alpha, kept, u)
        done = redo == 0
        np.testing.assert_array_equal(got[done].view(np.uint64), x_bar[done].view(np.uint64))
        np.testing.assert_array_equal(got_alpha[done], alpha_bar[done])
        got, got_alpha, redo = _ladder_vjp(xs, order, alpha, kept, u32, np.float32)
        done = redo == 0
        want = x_bar32.astype(np.float32)[done].view(np.int32)
        np.testing.assert_array_equal(got[done].view(np.int32), want)
        np.testing.assert_array_equal(got_alpha[done], alpha_bar32[done])


def test_other_target_weights_give_a_usual_target_its_weights(rng):
    # _ladder_pullback sends the usual targets whose factor lies outside exp_main's range
    # (and above UNDERFLOW) to other_target_weights: the same G, Z, el, er to the bit
    import numba

    from softorder.core.lapsum import other_target_weights, target_weights

    @numba.njit
    def compare(r, inv_alpha, t, tables, got, want):
        for k in range(t.shape[0]):
            a, ad, b, bd = tables[k, 0], tables[k, 1], tables[k, 2], tables[k, 3]
            h1, g1, z1, l1, r1, _ = other_target_weights(
                r[k], inv_alpha[k], r[k, 0], t[k], 0, 1, a, ad, b, bd
            )
            h2, g2, z2, l2, r2, _ = target_weights(
                r[k], inv_alpha[k], r[k, 0], t[k], 0, 1, a, ad, b, bd
            )
            got[k, 0], got[k, 1], got[k, 2], got[k, 3], got[k, 4] = h1, g1, z1, l1, r1
            want[k, 0], want[k, 1], want[k, 2], want[k, 3], want[k, 4] = h2, g2, z2, l2, r2

    m = 20000
    gap = 10.0 ** rng.uniform(-3, 3, m)
    r = np.stack([np.zeros(m), gap], axis=1)
    inv_alpha = 10.0 ** rng.uniform(-1, 4, m)
    # targets strictly above the left point (the anchor, t > 0) and at or below the right one
    t = gap * inv_alpha * rng.choice([1e-17, 1e-9, 0.25, 0.5, 0.75, 1.0], m) * rng.random(m)
    t = np.where(t > 0.0, t, 1e-300)
    tables = np.abs(rng.normal(size=(m, 4))) * 3.0 + np.array([1.0, 0.0, 1.0, 0.0])
    got, want = np.empty((m, 5)), np.empty((m, 5))
    compare(r, inv_alpha, t, tables, got, want)
    assert (want[:, 0] == 1).all()
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_soft_sort_of_the_longest_float32_rows_in_two_rows_of_scratch(rng, monkeypatch, dtype):
    # float32 rows of LEAN_N or more: forward in two rows of scratch, VJP in lean_vjp; the
    # rows it hands back (ties at a small alpha: an injection below its window; a count
    # beyond its type, here uint8) take ladder_vjp: the same bits as the short rows' path
    # (rows made "long" here by lowering the bounds: the kernels do not look at them)
    from softorder._engine.autodiff import rule_named

    n = 600
    x = rng.normal(size=(4, n)).astype(dtype)
    x[1] = np.round(x[1] * 2) / 2  # long runs of ties
    x[2, 7] = np.inf
    u = rng.normal(size=x.shape).astype(dtype)
    alpha = np.array([[0.05], [1e-3], [0.3], [1e9]])  # (1e9: every point at one target)
    want = softorder.vjp(softorder.soft_sort, x, alpha=alpha)
    want_grads = want[1](u)
    handed = []
    ladder = core.sort.ladder_vjp

    def spy(xs, *args):
        handed.append(xs.shape[0])
        return ladder(xs, *args)

    monkeypatch.setattr(core.sort, "SOLVE_AGAIN_N", 200)
    monkeypatch.setattr(core.sort, "LEAN_N", 200)
    monkeypatch.setattr(core.sort, "LEAN_COUNTS", np.uint8)
    monkeypatch.setattr(core.sort, "ladder_vjp", spy)
    rule = rule_named("soft_sort")
    ctx = rule.prepare(x=x, alpha=alpha, axis=-1, descending=False)
    rule.forward(ctx)
    assert "offset" not in ctx.saved
    for descending in (False, True):
        if descending:
            want = softorder.vjp(softorder.soft_sort, x, alpha=alpha, descending=True)
            with monkeypatch.context() as m:
                m.setattr(core.sort, "LEAN_N", 1 << 40)
                want_grads = want[1](u)
        handed.clear()
        got = softorder.vjp(softorder.soft_sort, x, alpha=alpha, descending=descending)
        np.testing.assert_array_equal(got[0], want[0])
        grads = got[1](u)
        # float32 rows: rows 1 (ties) and 3 (counts) handed back; float64 rows: not lean
        assert handed == ([2] if dtype == np.float32 else [4])
        for g, w in zip(grads, want_grads, strict=True):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(
                np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8)
            )
        if dtype == np.float32:  # a float64 cotangent: a float64 gradient, the same bits
            g64 = got[1](u.astype(np.float64))
            with monkeypatch.context() as m:
                m.setattr(core.sort, "LEAN_N", 1 << 40)
                w64 = want[1](u.astype(np.float64))
            np.testing.assert_array_equal(g64[0], w64[0])
            np.testing.assert_array_equal(g64[1], w64[1])


def test_lean_counts_refuse_a_count_beyond_their_type(rng):
    # every point of a row with an alpha far above its spread shares one target: 2-byte
    # counts would wrap around at 65536 points; the kernel flags the row instead
    rows, n = 1, 300
    xs = np.sort(rng.normal(size=(rows, n)), axis=1)
    order = np.argsort(rng.normal(size=(rows, n)), axis=1)
    u = rng.normal(size=(rows, n))
    for counts_dtype, alpha, flagged in (
        (np.uint8, 1e9, 1),
        (np.uint16, 1e9, 0),
        (np.uint8, 0.1, 0),
    ):
        got, got_alpha, redo = _lean_vjp(xs, order, np.array([alpha]), u, counts_dtype=counts_dtype)
        assert redo[0] == flagged
        if not flagged:
            anchor, offset = _ladder(xs, np.array([alpha]))
            want, want_alpha = _inverse_vjp(xs, order, np.array([alpha]), anchor, offset, u)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got_alpha, want_alpha)
