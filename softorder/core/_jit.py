"""The one place that holds the numba options of every kernel.

All kernels compute in float64 (see ``docs`` / README "float32 strategy"), so each kernel
compiles once; ``cache=True`` keeps the compiled code between processes (set
``NUMBA_CACHE_DIR`` where the package directory is read-only).
"""

from __future__ import annotations

import numba

_OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy", "fastmath": False}


def helper(fn):
    """Compile a per-row or scalar helper that kernels call (no parallelism of its own)."""
    return numba.njit(**_OPTIONS)(fn)


def kernel(fn):
    """Compile a batched kernel that runs its rows in parallel with ``numba.prange``."""
    return numba.njit(parallel=True, **_OPTIONS)(fn)
