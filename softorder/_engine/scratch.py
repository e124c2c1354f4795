"""Scratch of the CPU kernels, reused from one call to the next on the same thread.

Every kernel call takes ``(rows, width, n)`` float64 scratch. A fresh allocation of a few MB
is mapped afresh by the C library (its mmap threshold moves with what the process freed
before), and the kernel then page-faults through all of it on every call. :func:`take` hands
out views of one buffer per thread instead, which the next call on that thread reuses.

Policy:

- Requests smaller than :data:`MIN_BYTES` get ``np.empty``: the C library serves them from
  its heap, usually without faulting, and a view costs more than ``np.empty`` of a small array.
- A thread keeps at most :func:`limit` bytes (:data:`DEFAULT_LIMIT_BYTES` unless
  :func:`set_scratch_limit` changed it); a larger request gets ``np.empty``, which is not
  kept. A thread's buffer goes when the thread ends, or when the limit is lowered below its
  size (``set_scratch_limit(0)`` frees every thread's buffer).
- A region is handed out again only when nothing refers to the buffer any more but the
  thread's own arena: every view of a NumPy array holds a reference to the array that owns the
  memory (NumPy collapses views of views to that owner), so as long as a view handed out
  earlier, or anything made from it, is alive (two scratch arguments of one kernel call, a
  call made while another call's scratch is held, a view that escaped into a result), the
  next request is served after the regions in use, or by ``np.empty`` when they fill the
  buffer. Correctness never depends on the callers giving scratch back.
- A forked child inherits its parent's buffer copy-on-write: its writes are its own.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

import numpy as np

#: smallest request (bytes) served from the thread's buffer
MIN_BYTES = 1 << 18
#: the default of :func:`limit`: the scratch of any one call on a row of 1e5 fits (5 rows at
#: most); a row of 1e6, where reused scratch saved no measurable time, allocates its own
DEFAULT_LIMIT_BYTES = 1 << 22
#: regions start on 64-byte boundaries (8 float64)
_ALIGN = 8

_limit = DEFAULT_LIMIT_BYTES


class _Arena:
    """One thread's buffer. Its lock makes a request and another thread's :func:`release`
    exclude each other (views already handed out keep their memory either way).
    """

    __slots__ = ("buffer", "used", "high", "lock", "__weakref__")

    def __init__(self) -> None:
        self.buffer: np.ndarray | None = None  # 1-D float64, owns its memory
        self.used = 0  # elements handed out since the buffer was last free (64-byte aligned)
        self.high = 0  # the most elements handed out at once: what the buffer grows to
        self.lock = threading.Lock()


_local = threading.local()
_arenas: weakref.WeakSet = weakref.WeakSet()  # every thread's (a thread's goes with it)
_arenas_lock = threading.Lock()  # a thread adding its arena while another lists them

# references to the buffer while :func:`_take` checks it: the arena's slot, the local name
# and getrefcount's argument; any more are views handed out earlier (or made from them)
_FREE_REFS = 3


def _new_arena() -> _Arena:
    arena = _Arena()
    _local.arena = arena
    with _arenas_lock:
        _arenas.add(arena)
    return arena


def _every_arena() -> list[_Arena]:
    with _arenas_lock:
        return list(_arenas)


def _after_fork_in_child() -> None:
    # a lock another thread held at the fork would stay held in the child
    global _arenas_lock
    _arenas_lock = threading.Lock()
    for arena in list(_arenas):
        arena.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def take(shape: tuple) -> np.ndarray:
    """An uninitialised float64 array of ``shape`` (C order) for one kernel call: a view of
    the calling thread's buffer, or a new array (see the module's policy).
    """
    size = 1
    for d in shape:
        size *= d
    if 8 * size < MIN_BYTES or 8 * size > _limit:
        return np.empty(shape)
    arena = getattr(_local, "arena", None) or _new_arena()
    lock = arena.lock
    if not lock.acquire(False):  # held by a release in another thread (or a signal handler
        return np.empty(shape)  # that called softorder during this thread's request)
    try:
        view = _take(arena, size)
    finally:
        lock.release()
    return np.empty(shape) if view is None else view.reshape(shape)


def _take(arena: _Arena, size: int) -> np.ndarray | None:
    """``size`` elements of ``arena``'s buffer, or ``None`` for a new array (under the lock)."""
    limit = _limit  # read again: set_scratch_limit may have lowered it meanwhile
    if 8 * size > limit:
        return None
    buffer = arena.buffer
    used = 0 if buffer is None or sys.getrefcount(buffer) == _FREE_REFS else arena.used
    end = used + size
    if buffer is None or end > buffer.shape[0] or buffer.nbytes > limit:
        if used:  # regions in use: this request is served apart, and next time fits
            arena.high = max(arena.high, end)
            return None
        grown = max(end, arena.high)
        if 8 * grown > limit:
            grown = end
        arena.buffer = buffer = None  # the old buffer goes before the new one is made
        arena.buffer = buffer = np.empty(grown)
    arena.used = end + (-end) % _ALIGN
    arena.high = max(arena.high, end)
    return buffer[used:end]


def limit() -> int:
    """The most bytes of scratch one thread keeps between calls."""
    return _limit


def set_scratch_limit(nbytes: int) -> int:
    """Set how many bytes of scratch each thread keeps between calls of the CPU kernels.

    The CPU kernels (NumPy arrays, CPU tensors, JAX on the CPU) work in float64 scratch of a
    few rows of ``n`` per call. Each thread keeps the scratch of its last calls, up to this
    many bytes, for its next call: a fresh allocation of a few MB may be mapped afresh by the
    C library and page-faulted through on every call. A call that needs more allocates it
    afresh and does not keep it. Results never share memory with the scratch. Device arrays
    (CUDA) never use it.

    Parameters
    ----------
    nbytes : int
        The new limit per thread, in bytes (default 4 MiB: a call on a row of 1e5 fits).
        ``0`` keeps nothing between calls and frees every thread's scratch now; a lower
        limit frees the scratch of each thread that keeps more.

    Returns
    -------
    int
        The previous limit, for restoring it.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> previous = softorder.set_scratch_limit(0)  # keep no scratch between calls
    >>> softorder.soft_rank(np.array([0.5, -1.0, 3.0]), alpha=0.01)
    array([2., 1., 3.])
    >>> softorder.set_scratch_limit(previous) == 0
    True
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"nbytes must be an integer; got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0; got {nbytes}")
    global _limit
    previous, _limit = _limit, int(nbytes)
    for arena in _every_arena():
        with arena.lock:
            if arena.buffer is not None and arena.buffer.nbytes > _limit:
                arena.buffer, arena.high = None, 0
    return previous


def release() -> None:
    """Drop every thread's buffer and what it grew to (views still in use keep their memory
    until they go): the next request allocates what it needs.
    """
    for arena in _every_arena():
        with arena.lock:
            arena.buffer, arena.high = None, 0


def held() -> int:
    """Bytes of every thread's buffer together."""
    buffers = [a.buffer for a in _every_arena()]
    return sum(b.nbytes for b in buffers if b is not None)
