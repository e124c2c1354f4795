"""The CPU kernels' reused scratch (softorder._engine.scratch): the same bits as fresh scratch
whatever the buffer held before, never a byte of a result or a residual, bounded.

Most tests serve every request from the buffer (``MIN_BYTES`` 0, a large limit) so that small
inputs, and every kernel call of every operation, go through it.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import softorder
from softorder._engine import rules, scratch

ALPHA = 0.7


def _arguments(name, x, rng):
    """(function, extra positional arguments, tangents of them) of operation ``name``."""
    n = x.shape[-1]
    batch = x.shape[:-1]
    if name in ("soft_topk", "log_soft_topk"):
        k = np.full(batch + (2,), [1.5, max(n // 3, 1)])
        return getattr(softorder, name), (k,), (rng.standard_normal(k.shape),)
    if name == "soft_quantile":
        q = np.broadcast_to([0.1, 0.5, 0.9], batch + (3,)).copy()
        return softorder.soft_quantile, (q,), (rng.standard_normal(q.shape),)
    if name == "topk_cross_entropy":
        labels = rng.integers(0, n, size=batch)
        return softorder.topk_cross_entropy, (labels, np.full(3, 1 / 3)), (None, None)
    if name == "permutation_cross_entropy":
        ranks = np.argsort(np.argsort(rng.standard_normal(x.shape), axis=-1), axis=-1) + 1
        return softorder.permutation_cross_entropy, (ranks,), (None,)
    return getattr(softorder, name), (), ()


OPERATIONS = (
    "soft_rank",
    "soft_sort",
    "soft_topk",
    "log_soft_topk",
    "soft_quantile",
    "soft_permutation",
    "topk_cross_entropy",
    "permutation_cross_entropy",
)
# consecutive calls of different sizes and widths (rows x n): each reuses, grows or outgrows
# the buffer the last one left
SHAPES = ((1, 40), (3, 17), (1, 64), (2, 5), (4, 33))


@pytest.fixture
def every_request():
    """Every request served from the buffer; the previous policy restored afterwards."""
    previous_min = scratch.MIN_BYTES
    scratch.MIN_BYTES = 0
    previous = softorder.set_scratch_limit(1 << 30)
    yield
    scratch.MIN_BYTES = previous_min
    softorder.set_scratch_limit(previous)


def _poison() -> None:
    """NaN in the calling thread's buffer: a kernel reading scratch it did not write shows."""
    arena = getattr(scratch._local, "arena", None)
    if arena is not None and arena.buffer is not None:
        arena.buffer.fill(np.nan)


def _run(name, x, seed, poison):
    """Values, gradients (VJP) and directional derivative (JVP) of operation ``name``."""
    rng = np.random.default_rng(seed)
    fn, extra, extra_tangents = _arguments(name, x, rng)
    if poison:
        _poison()
    out, pullback = softorder.vjp(fn, x, *extra, alpha=ALPHA)
    cotangent = rng.standard_normal(np.shape(out)).astype(np.asarray(out).dtype)
    if poison:
        _poison()
    grads = pullback(cotangent)
    if poison:
        _poison()
    tangents = (rng.standard_normal(x.shape).astype(x.dtype), *extra_tangents, 0.3)
    _, out_dot = softorder.jvp(fn, (x, *extra, ALPHA), tangents)
    return [np.asarray(out), *(np.asarray(g) for g in grads), np.asarray(out_dot)]


def _fresh(name, x, seed):
    """The same with fresh scratch for every kernel call (nothing kept between calls)."""
    previous = softorder.set_scratch_limit(0)
    try:
        return _run(name, x, seed, poison=False)
    finally:
        softorder.set_scratch_limit(previous)


def _assert_same_bits(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes(), (a, b)


def _input(shape, dtype, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    x[..., 1] = x[..., 0]  # a tie
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", OPERATIONS)
def test_reused_scratch_gives_the_same_bits(name, dtype, every_request):
    """Values, VJPs and JVPs to the bit as with fresh scratch, over consecutive calls of
    different shapes, with NaN left in the buffer before every call.
    """
    expected = [_fresh(name, _input(s, dtype, i), i) for i, s in enumerate(SHAPES)]
    for i, shape in enumerate(SHAPES):
        _assert_same_bits(_run(name, _input(shape, dtype, i), i, poison=True), expected[i])
    assert scratch.held() > 0  # the buffer served them


@pytest.mark.parametrize("name", OPERATIONS)
def test_scratch_never_outlives_its_kernel_call(name, every_request, monkeypatch):
    """No view of scratch is alive once a call returns, and no result, gradient or residual
    shares memory with the buffer.
    """
    views, contexts = [], []
    take, init = scratch.take, rules.Context.__init__

    def recording(shape):  # every request, whichever route it takes to the buffer
        view = take(shape)
        views.append(weakref.ref(view))
        return view

    def recording_context(self, *args, **kwargs):
        init(self, *args, **kwargs)
        contexts.append(self)

    monkeypatch.setattr(scratch, "take", recording)
    monkeypatch.setattr(rules.Context, "__init__", recording_context)
    x = _input((3, 24), np.float64, 1)
    rng = np.random.default_rng(1)
    fn, extra, _ = _arguments(name, x, rng)
    out, pullback = softorder.vjp(fn, x, *extra, alpha=ALPHA)
    grads = pullback(np.ones_like(out))
    assert views and all(ref() is None for ref in views)
    buffer = scratch._local.arena.buffer
    assert any(ctx.rows.backend is rules.NUMPY for ctx in contexts)
    kept = [out, *grads]
    for ctx in contexts:
        kept += [a for a in ctx.saved.values() if isinstance(a, np.ndarray)]
        kept += [ctx.rows.xs, ctx.rows.order]
    for a in kept:
        assert not np.shares_memory(np.asarray(a), buffer)


def test_two_requests_of_one_call_do_not_overlap(every_request):
    """Scratch still held (two arguments of one kernel call, or a call made while another
    call's scratch is alive) is never handed out again.
    """
    first = scratch.take((2, 3, 50))
    second = scratch.take((2, 1, 70))
    assert first.base is second.base  # both from the buffer
    assert not np.shares_memory(first, second)
    derived = first[:, 0]  # a view made from a view keeps its region too
    del first, second
    third = scratch.take((2, 3, 50))
    assert not np.shares_memory(third, derived)
    del derived, third
    again = scratch.take((2, 3, 50))
    assert again.base is scratch._local.arena.buffer


def test_a_call_inside_a_call_gets_its_own_scratch(every_request):
    """An operation called while a kernel call's scratch is held (what a callback into
    softorder would do) neither writes that scratch nor reads it.
    """
    x = _input((2, 30), np.float64, 3)
    expected = _fresh("soft_sort", x, 3)
    held = scratch.take((2, 4, 30))
    held.fill(1.25)
    got = _run("soft_sort", x, 3, poison=False)
    _assert_same_bits(got, expected)
    assert np.all(held == 1.25)


def test_threads_calling_at_once(every_request):
    """Two threads calling at once, each with its own buffer, get the same bits."""
    cases = [("soft_sort", (3, 40), 0), ("soft_topk", (2, 50), 1)]
    expected = {c: _fresh(c[0], _input(c[1], np.float64, c[2]), c[2]) for c in cases}
    failures = []
    barrier = threading.Barrier(2)

    def loop(case):
        name, shape, seed = case
        try:
            barrier.wait()
            for _ in range(30):
                _assert_same_bits(
                    _run(name, _input(shape, np.float64, seed), seed, True), expected[case]
                )
        except Exception as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=loop, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def _child_sort(queue):
    x = _input((2, 30), np.float64, 4)
    queue.put(_run("soft_sort", x, 4, poison=True))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method: Linux")
def test_forked_child_computes_with_its_own_copy(every_request):
    x = _input((2, 30), np.float64, 4)
    expected = _fresh("soft_sort", x, 4)
    _run("soft_sort", x, 4, poison=False)  # the parent's buffer, inherited by the child
    before = scratch._local.arena.buffer.copy()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_sort, args=(queue,))
    with warnings.catch_warnings():
        # JAX, when an earlier test of the session started it, warns at every fork (its
        # threads); the child here runs only softorder's kernels
        warnings.filterwarnings("ignore", "os.fork\\(\\) was called", RuntimeWarning)
        child.start()
    got = queue.get(timeout=120)
    child.join(timeout=120)
    assert child.exitcode == 0
    _assert_same_bits(got, expected)
    np.testing.assert_array_equal(scratch._local.arena.buffer, before)


def _in_a_new_thread(fn):
    """``fn()`` in a thread of its own (an arena of its own), its exception raised here."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result(timeout=60)


def test_limit_bounds_what_is_kept():
    """Requests over the limit are new arrays, not kept; the buffer never exceeds the limit;
    lowering the limit frees larger buffers of every thread; 0 keeps nothing.
    """
    previous_min, scratch.MIN_BYTES = scratch.MIN_BYTES, 0
    previous = softorder.set_scratch_limit(8 * 1000)
    scratch.release()
    try:
        _in_a_new_thread(_limits)
    finally:
        scratch.MIN_BYTES = previous_min
        softorder.set_scratch_limit(previous)


def _limits():
    kept = scratch.take((1, 2, 400))  # 6400 bytes: kept
    buffer = kept.base
    assert buffer is scratch._local.arena.buffer and buffer.nbytes == 6400
    del kept
    big = scratch.take((1, 3, 400))  # 9600 bytes: a new array, not kept
    assert big.base is None and scratch._local.arena.buffer is buffer
    del big
    assert scratch.held() == 6400

    taken, done, other = threading.Event(), threading.Event(), []

    def second_thread():
        other.append(scratch.take((1, 1, 900)))  # 7200 bytes, in a buffer of its own
        taken.set()
        done.wait(60)

    thread = threading.Thread(target=second_thread)
    thread.start()
    try:
        assert taken.wait(60)
        assert scratch.held() == 6400 + 7200
        assert softorder.set_scratch_limit(7000) == 8 * 1000  # frees the other's
        assert scratch.held() == 6400
        assert np.all(np.isfinite(other[0]) | ~np.isfinite(other[0]))  # its view still valid
        softorder.set_scratch_limit(0)
        assert scratch.held() == 0
        assert scratch.take((1, 1, 10)).base is None
        assert scratch.held() == 0
    finally:
        done.set()
        thread.join()


def test_default_policy():
    """Small requests are plain new arrays; a row of 1e5's scratch is kept, a row of 1e6's
    is not (its calls allocate their own).
    """
    assert scratch.limit() == scratch.DEFAULT_LIMIT_BYTES

    def policy():
        assert scratch.take((1, 2, 1000)).base is None
        assert scratch.take((1, 5, 10**5)).base is not None
        assert scratch.take((1, 1, 10**6)).base is None
        assert scratch.held() == 4 * 10**6

    _in_a_new_thread(policy)


@pytest.mark.parametrize(
    "value, error", [(-1, ValueError), (1.5, TypeError), ("1", TypeError), (True, TypeError)]
)
def test_set_scratch_limit_checks_its_argument(value, error):
    with pytest.raises(error, match="nbytes"):
        softorder.set_scratch_limit(value)
