"""Run a CPU kernel and its GPU twin on the same arguments and compare what they write."""

from __future__ import annotations

import numpy as np
from numba import cuda

from softorder import core


def rows_of(x: np.ndarray):
    """Sorted float64 rows and their argsort, as the NumPy API hands them to the kernels."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    order = np.argsort(x, axis=1)
    return np.take_along_axis(x, order, 1), order


def sample(rng, rows: int, n: int, nan_row: bool = True) -> np.ndarray:
    """Rows with ties, a wide gap, an infinity and (optionally) a NaN row."""
    x = rng.normal(size=(rows, n))
    if n >= 4:
        x[0, 1] = x[0, 0]  # a tie
        x[-1, 2] = 40.0  # far apart compared to alpha
    if rows >= 3 and n >= 3:
        x[1, 0] = np.inf
        if nan_row:
            x[2, 1] = np.nan
    return x


def compare(cpu_kernel, gpu_kernel, args: list, outputs: list[int], rtol=1e-9, atol=1e-11):
    """Call both kernels (GPU arguments copied to the device) and assert the outputs at the
    positions ``outputs`` agree; returns the CPU arguments after the call.
    """
    cpu_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    cpu_kernel(*cpu_args)
    dev_args = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
    gpu_kernel(*dev_args)
    for k in outputs:
        np.testing.assert_allclose(
            dev_args[k].copy_to_host(), cpu_args[k], rtol=rtol, atol=atol, err_msg=f"output {k}"
        )
    return cpu_args


def work(rows: int, width: int, n: int) -> np.ndarray:
    return core.workspace(rows, width, n)
