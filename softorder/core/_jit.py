"""The one place that holds the numba options of every kernel.

All kernels compute in float64 (README, "float32"), so each kernel compiles once;
``cache=True`` keeps the compiled code between processes (set ``NUMBA_CACHE_DIR`` where the
package directory is read-only).
"""

from __future__ import annotations

import functools

import numba

_OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy", "fastmath": False}

#: Below this many rows or elements a kernel runs on the calling thread alone. Waking the
#: thread pool costs more than it saves on small inputs, and on a busy machine (data loaders,
#: another process) OpenMP's barrier turned a 0.4 ms single-row call into 16 ms at the 90th
#: percentile, against 0.4 ms on one thread (measured on 2 cores, n = 1e4).
MIN_PARALLEL_ROWS = 2
MIN_PARALLEL_ELEMENTS = 32768

_parallel = [True]


def set_parallel(enabled: bool) -> bool:
    """Let large batched calls run their rows on numba's thread pool (the default), or keep
    every kernel on the calling thread; returns the previous setting.

    The PyTorch bridge turns it off when imported: PyTorch's OpenMP threads and numba's spin
    against each other. With both pools active on 2 cores, 256 x 1000 ``soft_rank`` forward +
    backward took 56 ms, and a 1 MB ``torch.clone`` between calls 7.7 ms; on one thread, 7.6 ms
    and 0.1 ms.

    Examples
    --------
    >>> from softorder import core
    >>> previous = core.set_parallel(False)
    >>> core.set_parallel(previous)
    False
    """
    previous = _parallel[0]
    _parallel[0] = bool(enabled)
    return previous


def helper(fn):
    """Compile a per-row or scalar helper that kernels call (no parallelism of its own)."""
    return numba.njit(**_OPTIONS)(fn)


def inner_helper(fn):
    """Compile a small helper called once per element with array arguments, inlined into its
    callers: a call that passes arrays costs their reference counting, which made
    ``target_sums`` 3x slower called than written in place (63 ns against 20 ns).
    """
    return numba.njit(inline="always", **_OPTIONS)(fn)


def kernel(fn):
    """Compile a batched kernel whose first argument is the ``(rows, n)`` input.

    Rows run in parallel with ``numba.prange`` when the input is large enough
    (:data:`MIN_PARALLEL_ROWS`, :data:`MIN_PARALLEL_ELEMENTS`) and :func:`set_parallel` allows
    it, on the calling thread otherwise.
    The compiled dispatcher is ``kernel.compiled``.
    """
    compiled = numba.njit(parallel=True, **_OPTIONS)(fn)

    @functools.wraps(fn)
    def run(xs, *args):
        if _parallel[0] and xs.shape[0] >= MIN_PARALLEL_ROWS and xs.size >= MIN_PARALLEL_ELEMENTS:
            return compiled(xs, *args)
        threads = numba.get_num_threads()
        numba.set_num_threads(1)  # thread-local: other threads' calls are unaffected
        try:
            return compiled(xs, *args)
        finally:
            numba.set_num_threads(threads)

    run.compiled = compiled
    return run
