"""Soft rank ``rank_i = 1/2 + sum_j F((r_i - r_j) / alpha) = S(r_i) + 1/2``, in (1/2, n + 1/2).

On the sorted row ``rank_i = i + 1 + (B_i - A_i) / 2`` (0-based i, prefix sums of
:mod:`softorder.core.lapsum`). The Jacobian in ``r`` is symmetric,
``d rank_i / d r_l = (delta_il K[1]_i - K_il) / (2 alpha)`` with the Laplace kernel
``K_il = exp(-|r_i - r_l| / alpha)`` and ``K[1] = A + B - 1``, and
``d rank_i / d alpha = -(Ad_i - Bd_i) / (2 alpha)``. So the VJP and the JVP are one formula,
``J v = (v K[1] - K v) / (2 alpha)``: one forward and one backward pass over the sorted row that
carry the prefix sums and the kernel sum of ``v`` together (3 scratch arrays per row instead
of the 6 that separate prefix sums and kernel sums would need; the passes are fused on purpose).
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from softorder.core._jit import helper, inner_helper, kernel
from softorder.core.fast_exp import FAST_EXP, exp_or_zero, needs_libm
from softorder.core.laplace import gap
from softorder.core.rows import (
    AHEAD,
    PREFETCH_FROM,
    gather_finite,
    has_nan,
    prefetch,
    scatter_finite,
)

FORWARD_WORK = 2
#: rows of scratch the rules allocate for the gradients: the GPU twins use three; the CPU
#: kernels keep one intermediate in the output row and leave the third untouched
LINEAR_WORK = 3
#: the CPU VJP's into a float32 ``x_bar`` (:func:`_rank_vjp_narrow`)
NARROW_VJP_WORK = 1


@helper
def decays(r, inv_alpha, E):
    """``E[i] = exp(-gap(r[i], r[i - 1]) / alpha)`` (``E[0] = 0``), ``math.exp``'s values to
    the bit: where :data:`~softorder.core.fast_exp.FAST_EXP`,
    :func:`~softorder.core.fast_exp.exp_main` in a loop LLVM vectorizes (at 0 too, where it
    is 1 exactly), then ``math.exp`` at the decays outside its range (far or infinite gaps;
    none in most rows) in a second pass. A float32 row's values widen exactly as they are
    read.
    """
    n = r.shape[0]
    E[0] = 0.0
    if not FAST_EXP:
        for i in range(1, n):
            E[i] = math.exp(-gap(np.float64(r[i]), np.float64(r[i - 1])) * inv_alpha)
        return
    far = False
    for i in range(1, n):
        x = -gap(np.float64(r[i]), np.float64(r[i - 1])) * inv_alpha
        far |= needs_libm(x)
        E[i] = exp_or_zero(x)
    if far:
        for i in range(1, n):
            x = -gap(np.float64(r[i]), np.float64(r[i - 1])) * inv_alpha
            if needs_libm(x):
                E[i] = math.exp(x)


@helper
def _ranks_halves(E, ranks):
    """The ranks of one sorted row in sorted order (``ranks``) from its decays ``E``
    (:func:`decays`).

    The recurrences of :func:`~softorder.core.lapsum.prefix_sums` with the same operations
    (the same ranks to the bit), in another order: ``A``'s runs up the lower half while
    ``B``'s runs down the upper half, then each finishes the other half, and every rank is
    formed where its second table value is. Two independent recurrences side by side: each
    one's latency hides the other's. ``ranks`` holds ``A`` in the lower half and ``B`` in the
    upper until each rank replaces them.
    """
    n = E.shape[0]
    h = (n + 1) // 2
    ranks[0] = 1.0  # A[0]
    ranks[n - 1] = 1.0  # B[n - 1]
    a = 1.0  # A[i - 1]
    b = 1.0  # B[j + 1]
    j = n - 2
    for i in range(1, h):
        a = 1.0 + E[i] * a
        b = 1.0 + E[j + 1] * b
        ranks[i] = a
        ranks[j] = b
        j -= 1
    if n % 2 == 1:  # A and B of the middle point are both known
        ranks[h - 1] = h - 1 + 1.0 + 0.5 * (b - a)
        j = h - 2
    for i in range(h, n):
        a = 1.0 + E[i] * a
        ranks[i] = i + 1.0 + 0.5 * (ranks[i] - a)
        b = 1.0 + E[j + 1] * b
        ranks[j] = j + 1.0 + 0.5 * (b - ranks[j])
        j -= 1


@kernel
def rank_forward(xs, order, alpha, out, decay, work):
    """``out[row, order[row, i]] = S(xs[row, i]) + 1/2 = i + 1 + (B_i - A_i) / 2``.

    Also writes ``decay[row, i] = exp(-(xs[row, i] - xs[row, i-1]) / alpha)`` (the ``E`` of the
    prefix sums), which the gradients reuse: the exponentials are most of the arithmetic.
    ``work``: (rows, FORWARD_WORK, n). ``out`` may be float32 (the ranks rounded once), and
    so may ``xs`` in every rank kernel (a float32 input's sorted values: each one widens
    exactly, so the results are a float64 row's).
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            # (loops: numba's slice assignments compiled longer on a first call)
            for i in range(n):
                out[row, i] = np.nan
                decay[row, i] = np.nan
            continue
        # the decays in a pass of their own (independent exps: vectorized), then the
        # recurrences, with one row of scratch for A, B and the ranks (the second row of
        # ``work`` is the GPU twin's and stays untouched here)
        E = decay[row]
        decays(r, 1.0 / alpha[row], E)
        ranks = work[row, 0]
        _ranks_halves(E, ranks)
        # scattered, with equal values given equal ranks (equal in exact arithmetic; made so
        # in floating point)
        o = order[row]
        dst = out[row]
        rank = ranks[0]
        dst[o[0]] = rank
        ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
        for i in range(1, n):
            if ahead:  # (a condition the loop does not change: LLVM splits it)
                prefetch(dst, o[i + ahead if i + ahead < n else n - 1])
            if r[i] != r[i - 1]:
                rank = ranks[i]
            dst[o[i]] = rank


@inner_helper
def _add_compensated(total, compensation, term):
    """Neumaier's step: ``total + term`` and the running sum of the rounding errors."""
    new = total + term
    if abs(total) >= abs(term):
        compensation += (total - new) + term
    else:
        compensation += (term - new) + total
    return new, compensation


@helper
def _rank_linear(r, order, alpha, E, v, alpha_v, out, work):
    """``out = J v + (d rank / d alpha) alpha_v`` for one row; returns ``<v, d rank / d alpha>``.

    ``v`` and ``out`` are in the original element order, ``r`` sorted by ``order``, ``E`` the
    decays saved by :func:`rank_forward`. Entries at +-inf neither receive nor pass on anything.
    ``v`` is gathered into sorted order first and the result scattered last: random access
    inside the dependent passes costs several times more (CHANGELOG.md).
    """
    n = r.shape[0]
    inv_alpha = 1.0 / alpha
    scale = 0.5 * inv_alpha
    vs = work[0]  # v in sorted order, then the result in sorted order
    partial = out  # v_i A_i - sum_{j <= i} v_j e_ij (out is written only by the last scatter)
    # Ad_i, kept per element only for a tangent of alpha (the JVP): the VJP needs only
    # <v, Ad>, summed in the first pass, and its second row of scratch stays untouched
    per_element = alpha_v != 0.0
    left_moment = work[1]
    gather_finite(r, order, v, vs)
    a = 1.0
    ad = 0.0
    lv = vs[0]
    partial[0] = 0.0
    if per_element:
        left_moment[0] = 0.0
    v_ad = 0.0  # <v, Ad>, compensated (Neumaier): the difference of the two sums cancels
    c_ad = 0.0
    lo = np.float64(r[0])  # r[i - 1], widened once (a float32 row's values are read once each)
    for i in range(1, n):
        e = E[i]
        ri = np.float64(r[i])
        ad = e * (ad + gap(ri, lo) * inv_alpha * a) if e > 0.0 else 0.0
        lo = ri
        # sum_(j < i) (v_i - v_j) e_ij without the terms j = i: v_i A_i - sum_(j <= i) v_j e_ij
        # would cancel the two v_i and lose the rest once it is below v_i's last bit
        partial[i] = e * (vs[i] * a - lv)
        a = 1.0 + e * a
        lv = vs[i] + e * lv
        if per_element:
            left_moment[i] = ad
        else:
            v_ad, c_ad = _add_compensated(v_ad, c_ad, vs[i] * ad)
    b = 1.0
    bd = 0.0
    rv = 0.0
    v_next = 0.0
    dot = 0.0
    v_bd = 0.0  # <v, Bd>
    c_bd = 0.0
    hi = 0.0  # r[i + 1]
    for i in range(n - 1, -1, -1):
        vi = vs[i]
        ri = np.float64(r[i])
        right = 0.0  # sum_(j > i) (v_i - v_j) e_ij, as the left part
        if i < n - 1:
            e = E[i + 1]
            bd = e * (bd + gap(hi, ri) * inv_alpha * b) if e > 0.0 else 0.0
            right = e * (vi * b - (v_next + rv))
            b = 1.0 + e * b
            rv = e * (v_next + rv)
        hi = ri
        v_next = vi
        result = (partial[i] + right) * scale  # v_i is used up
        if per_element:
            d_alpha = -(left_moment[i] - bd) * scale
            dot += vi * d_alpha
            result += d_alpha * alpha_v
        else:
            v_bd, c_bd = _add_compensated(v_bd, c_bd, vi * bd)
        vs[i] = result
    if not per_element:
        dot = -((v_ad - v_bd) + (c_ad - c_bd)) * scale
    scatter_finite(r, order, vs, out)
    return dot


@helper
def _rank_vjp_narrow(r, order, alpha, E, v, out, partial):
    """:func:`_rank_linear` of a VJP (no tangent of alpha) with a float32 cotangent ``v`` and
    a float32 gradient ``out``: the same operations on the same values, with the sorted
    cotangent (exact in float32) kept in ``out``, the partial sums and then the gradient in
    sorted order in ``partial`` (float64, n), which is scattered into ``out`` once spent.
    """
    n = r.shape[0]
    inv_alpha = 1.0 / alpha
    scale = 0.5 * inv_alpha
    vs = out
    gather_finite(r, order, v, vs)
    a = 1.0
    ad = 0.0
    lv = np.float64(vs[0])
    partial[0] = 0.0
    v_ad = 0.0
    c_ad = 0.0
    lo = np.float64(r[0])  # r[i - 1], widened once (a float32 row's values are read once each)
    for i in range(1, n):
        e = E[i]
        vi = np.float64(vs[i])
        ri = np.float64(r[i])
        ad = e * (ad + gap(ri, lo) * inv_alpha * a) if e > 0.0 else 0.0
        lo = ri
        partial[i] = e * (vi * a - lv)  # without the terms j = i (_rank_linear)
        a = 1.0 + e * a
        lv = vi + e * lv
        v_ad, c_ad = _add_compensated(v_ad, c_ad, vi * ad)
    b = 1.0
    bd = 0.0
    rv = 0.0
    v_next = 0.0
    v_bd = 0.0
    c_bd = 0.0
    hi = 0.0  # r[i + 1]
    for i in range(n - 1, -1, -1):
        vi = np.float64(vs[i])
        ri = np.float64(r[i])
        right = 0.0
        if i < n - 1:
            e = E[i + 1]
            bd = e * (bd + gap(hi, ri) * inv_alpha * b) if e > 0.0 else 0.0
            right = e * (vi * b - (v_next + rv))
            b = 1.0 + e * b
            rv = e * (v_next + rv)
        hi = ri
        v_next = vi
        partial[i] = (partial[i] + right) * scale
        v_bd, c_bd = _add_compensated(v_bd, c_bd, vi * bd)
    scatter_finite(r, order, partial, out)
    return -((v_ad - v_bd) + (c_ad - c_bd)) * scale


@kernel
def rank_vjp(xs, order, alpha, decay, v, x_bar, alpha_bar, work):
    """Cotangent ``v`` (rows, n) -> ``x_bar`` (rows, n) and ``alpha_bar`` (rows,).

    ``work``: (rows, LINEAR_WORK, n). :func:`rank_vjp_narrow` writes a float32 ``x_bar``.
    """
    rows, n = xs.shape
    for row in prange(rows):
        if has_nan(xs[row]):
            # (loops: numba's slice assignments compiled longer on a first call)
            for i in range(n):
                x_bar[row, i] = np.nan
            alpha_bar[row] = np.nan
            continue
        alpha_bar[row] = _rank_linear(
            xs[row], order[row], alpha[row], decay[row], v[row], 0.0, x_bar[row], work[row]
        )


@kernel
def rank_vjp_narrow(xs, order, alpha, decay, v, x_bar, alpha_bar, work):
    """:func:`rank_vjp` of a float32 cotangent ``v`` into a float32 ``x_bar`` (else
    ``ValueError``): the float64 gradient rounded once, with only the first row of ``work``
    (:data:`NARROW_VJP_WORK`; :func:`_rank_vjp_narrow`). A float32 input's gradient without
    a float64 copy of the cotangent. A kernel of its own, so that :func:`rank_vjp`'s first
    call does not compile it.
    """
    rows, n = xs.shape
    if x_bar.itemsize != 4 or v.itemsize != 4:
        raise ValueError("softorder: rank_vjp_narrow takes a float32 v and x_bar")
    for row in prange(rows):
        if has_nan(xs[row]):
            # (loops: numba's slice assignments compiled longer on a first call)
            for i in range(n):
                x_bar[row, i] = np.nan
            alpha_bar[row] = np.nan
            continue
        alpha_bar[row] = _rank_vjp_narrow(
            xs[row], order[row], alpha[row], decay[row], v[row], x_bar[row], work[row, 0]
        )


@kernel
def rank_jvp(xs, order, alpha, decay, x_dot, alpha_dot, out, work):
    """Tangents ``x_dot`` (rows, n), ``alpha_dot`` (rows,) -> tangent of the ranks (rows, n).

    ``work``: (rows, LINEAR_WORK, n).
    """
    rows, n = xs.shape
    for row in prange(rows):
        if has_nan(xs[row]):
            # (loops: numba's slice assignments compiled longer on a first call)
            for i in range(n):
                out[row, i] = np.nan
            continue
        _rank_linear(
            xs[row],
            order[row],
            alpha[row],
            decay[row],
            x_dot[row],
            alpha_dot[row],
            out[row],
            work[row],
        )
