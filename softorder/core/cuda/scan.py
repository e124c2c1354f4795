"""The parallel form of every O(n) recurrence of the math doc: a segmented scan of affine maps.

Each recurrence of :mod:`softorder.core` has the form ``y[i] = a_i y[i-1] + c[i]`` along a
sorted row (prefix sums, moments, kernel sums, the merges of :mod:`~softorder.core.kernel_sums`),
with ``a_i = E[i] = exp(-(r[i] - r[i-1]) / alpha)`` read forward and ``E[i+1]`` read backward.
Affine maps compose associatively, ``(p, q) then (a, c) = (p a, a q + c)``, so a row is cut
into tiles of ``THREADS x ITEMS`` elements: each block composes its tile's maps (a sequential
loop per thread, then a shared-memory scan over threads), the tiles' totals are scanned by the
same code one level up, and each block replays its tile from its carry.

* Many short rows (4096 x 1000): one block per row, one launch, no carries.
* One long row (1 x 1e7): 9766 blocks, whose 9766 totals take two more (small) levels.

One thread per row would leave a long row on one thread; a scan serves both regimes with the
same code. Every factor is ``<= 1``, so the composed maps neither overflow nor lose precision.
"""

from __future__ import annotations

import functools

from numba import cuda, float64

from softorder.core.cuda import _launch


@functools.cache
def _kernels(threads: int, items: int):
    tile = threads * items

    @cuda.jit(device=True, inline="always")
    def tile_of(n):
        """``(tile, row)`` of this block: blocks are numbered tile-fastest along one grid axis
        (gridDim.y would cap a batch at 65535 rows).
        """
        count = (n + tile - 1) // tile
        row = cuda.blockIdx.x // count
        return cuda.blockIdx.x - row * count, row

    @cuda.jit(device=True, inline="always")
    def term(a, c, row, lo, n, reverse):
        """The map ``(a_l, c_l)`` of logical position ``lo`` and its physical index."""
        if reverse:
            p = n - 1 - lo
            ai = a[row, p + 1] if lo > 0 else 0.0
        else:
            p = lo
            ai = a[row, p] if lo > 0 else 0.0
        return ai, c[row, p], p

    @_launch.kernel(*[_launch.F2] * 6, "boolean", "boolean")
    def tile_pass(a, c, out, carry, total_p, total_q, reverse, replay):
        """Compose the maps of one tile of one row (:func:`tile_of`); with ``replay``
        write ``out`` from the tile's carry, otherwise store the tile's total map.
        """
        n = c.shape[1]
        t, row = tile_of(n)
        tid = cuda.threadIdx.x
        sp = cuda.shared.array(threads, float64)
        sq = cuda.shared.array(threads, float64)
        start = t * tile + tid * items
        p = 1.0
        q = 0.0
        for k in range(items):
            lo = start + k
            if lo < n:
                ai, ci, _ = term(a, c, row, lo, n, reverse)
                p = p * ai
                q = ai * q + ci
        sp[tid] = p
        sq[tid] = q
        cuda.syncthreads()
        offset = 1
        while offset < threads:
            ep = 1.0
            eq = 0.0
            if tid >= offset:
                ep = sp[tid - offset]
                eq = sq[tid - offset]
            cuda.syncthreads()
            if tid >= offset:
                own_p = sp[tid]
                sp[tid] = ep * own_p
                sq[tid] = own_p * eq + sq[tid]
            cuda.syncthreads()
            offset *= 2
        if replay:
            y = carry[row, t - 1] if t > 0 else 0.0
            if tid > 0:
                y = sp[tid - 1] * y + sq[tid - 1]
            for k in range(items):
                lo = start + k
                if lo < n:
                    ai, ci, phys = term(a, c, row, lo, n, reverse)
                    y = ai * y + ci
                    out[row, phys] = y
        elif tid == threads - 1:
            total_p[row, t] = sp[tid]
            total_q[row, t] = sq[tid]

    @_launch.kernel(_launch.F2, _launch.F1)
    def tile_sums(values, out):
        """Add the sum of one tile of one row (:func:`tile_of`) to ``out[row]``."""
        n = values.shape[1]
        t, row = tile_of(n)
        tid = cuda.threadIdx.x
        s = cuda.shared.array(threads, float64)
        start = t * tile + tid * items
        acc = 0.0
        for k in range(items):
            if start + k < n:
                acc += values[row, start + k]
        s[tid] = acc
        cuda.syncthreads()
        width = threads // 2
        while width > 0:
            if tid < width:
                s[tid] += s[tid + width]
            cuda.syncthreads()
            width //= 2
        if tid == 0:
            cuda.atomic.add(out, row, s[0])

    return tile_pass, tile_sums


@_launch.kernel(_launch.F2, "float64")
def _fill(arr, value):
    idx = cuda.grid(1)
    n = arr.shape[1]
    if idx < arr.shape[0] * n:
        arr[idx // n, idx % n] = value


def fill(arr, value: float) -> None:
    """Set every element of a 2-D device array to ``value``."""
    _launch.for_each(_fill, arr.shape[0] * arr.shape[1], arr, value)


def affine_scan(a, c, out, reverse: bool = False) -> None:
    """``out[:, i] = a[:, i] out[:, i-1] + c[:, i]`` along each row (``out[:, -1] = 0``), or
    with ``reverse`` ``out[:, i] = a[:, i+1] out[:, i+1] + c[:, i]``. All (rows, n); ``out``
    may be ``c``.
    """
    rows, n = c.shape
    if rows == 0 or n == 0:
        return
    tile_pass, _ = _kernels(_launch.threads(), _launch.items())
    count = _launch.tiles(n)
    if count == 1:
        _launch.per_tile(tile_pass, rows, n, a, c, out, out, out, out, reverse, True)
        return
    total_p = _launch.empty((rows, count))
    total_q = _launch.empty((rows, count))
    _launch.per_tile(tile_pass, rows, n, a, c, out, out, total_p, total_q, reverse, False)
    carry = _launch.empty((rows, count))
    affine_scan(total_p, total_q, carry)  # the tiles' totals, in logical (scan) order
    _launch.per_tile(tile_pass, rows, n, a, c, out, carry, total_p, total_q, reverse, True)


def row_sums(values, out) -> None:
    """``out[row] = sum(values[row])`` for (rows, n) ``values`` and a (rows,) ``out``."""
    rows, n = values.shape
    fill(out.reshape(rows, 1), 0.0)
    if n == 0:
        return
    _, tile_sums = _kernels(_launch.threads(), _launch.items())
    _launch.per_tile(tile_sums, rows, n, values, out)
