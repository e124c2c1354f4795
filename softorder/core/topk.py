"""Soft top-k (smallest k) and its logarithm, for m values of k per row in one call.

``b = S^-1(k)``, ``p_i = F((b - r_i) / alpha)`` (so ``sum_i p_i = k``), ``log p_i = log F(...)``.
Writing ``y_i = h(z_i)`` with ``z_i = (b - r_i) / alpha`` and ``h = F`` or ``log F``,
``kappa_i = h'(z_i) / alpha`` and ``omega_i / G = db / dr_i`` (relative to the nearest point):

    dy_i = kappa_i [ sum_l omega_l / G dr_l - dr_i + dk / G_abs + (Z / G - z_i) dalpha ]

Both products cost O(n) per k, i.e. O(m n) per row: the size of the output itself.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange, types

from softorder.core._jit import SymbolCalls, helper, inner_helper, kernel
from softorder.core.fast_exp import FAST_EXP, exp_or_zero, needs_libm
from softorder.core.laplace import (
    INF,
    cdf,
    hazard,
    log_cdf,
    offset_z,
    rel_weight,
    shifted_hazard,
)
from softorder.core.lapsum import (
    TABLES,
    TABLES_WITH_MOMENTS,
    moment_tables,
    prefix_sums_halves,
    solve_targets_ab,
    target_sums,
)
from softorder.core.rows import (
    AHEAD,
    PREFETCH_FROM,
    gather,
    gather_finite,
    has_nan,
    prefetch,
    scatter,
)

#: the tables (the GPU twin's); the CPU forward fills only ``A`` (in the first row of its
#: output) and ``B`` (:func:`~softorder.core.lapsum.solve_targets_ab`), then writes each
#: target's row in sorted order into the spent ``B`` and scatters it at once: a random-order
#: write per element inside the loop was a cache miss each at n = 1e6
FORWARD_WORK = TABLES
#: the tables with moments and :func:`gradient_scratch` (the tangent in sorted order goes to
#: the spent ``E``)
GRADIENT_WORK = TABLES_WITH_MOMENTS + 5
#: the relative weights of a target, a row the CPU VJP leaves untouched (it keeps the gradient
#: in the row of ``x_bar``) and the cotangent in sorted order (the VJP needs no tables)
VJP_WORK = 3
#: the CPU VJP's into a float32 ``x_bar`` (one target per row): the relative weights alone
ONE_TARGET_VJP_WORK = 1
#: the GPU twin's VJP (:func:`softorder.core.cuda.topk.topk_vjp`): the tables with moments and
#: the gradient
GPU_VJP_WORK = TABLES_WITH_MOMENTS + 1


@helper
def gradient_scratch(work, n):
    """``z``, ``kappa``, ``omega``, ``kappa_k`` and one more length-n vector after the tables."""
    k = TABLES_WITH_MOMENTS
    return work[k, :n], work[k + 1, :n], work[k + 2, :n], work[k + 3, :n], work[k + 4, :n]


@helper
def finite_row(r, inv_alpha):
    """Whether the sorted row ``r`` (no NaN) and ``inv_alpha`` are finite: then
    :func:`finite_z` is :func:`~softorder.core.laplace.offset_z` for its finite targets.
    """
    return abs(r[0]) != INF and abs(r[r.shape[0] - 1]) != INF and inv_alpha != INF


@helper
def finite_z(r_anchor, r_i, inv_alpha, t):
    """:func:`~softorder.core.laplace.offset_z` of finite values, ``inv_alpha`` and ``t``
    (:func:`finite_row`) without its cases, the same value to the bit: its distance,
    ``gap(r_anchor, r_i)`` or ``-gap(r_i, r_anchor)``, is ``r_anchor - r_i`` (rounding to
    nearest is symmetric), +0.0 for equal values (``+ 0.0`` turns the ``-0.0`` of
    ``-0.0 - 0.0`` into +0.0 and leaves any other value as it is), and ``z`` is NaN only
    from ``inf - inf``. The forward's membership passes took a tenth longer through
    ``offset_z``'s branches (256 x 1000).
    """
    return ((r_anchor - r_i) + 0.0) * inv_alpha + t


@kernel
def topk_forward(xs, order, alpha, w, worder, log, out, anchor, offset, work):
    """Memberships (or their logs when ``log``) ``out`` (rows, m, n) for targets ``w`` (rows, m);
    stores the targets as ``(anchor, offset)`` (rows, m) for the gradients. ``work``: (rows,
    FORWARD_WORK, n) scratch.
    """
    rows, n = xs.shape
    m = w.shape[1]
    if m == 0:  # nothing to write; target 0's row of ``out``, the scratch below, is not there
        return
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            # (loops: numba's slice assignments compiled longer on a first call)
            for j in range(m):
                anchor[row, j] = 0
                offset[row, j] = np.nan
                for i in range(n):
                    out[row, j, i] = np.nan
            continue
        inv_alpha = 1.0 / alpha[row]
        A = out[row, 0]  # written by the first scatter, once the targets are solved
        B = work[row, 0, :n]
        _call_prefix_sums(r, inv_alpha, A, B)
        _call_solve(r, inv_alpha, A, B, w[row], worder[row], anchor[row], offset[row])
        sorted_out = B  # spent once the targets are solved
        fast = FAST_EXP and not log and finite_row(r, inv_alpha)
        for j in range(m):
            ra = r[anchor[row, j]]
            t = offset[row, j]
            if fast and abs(t) != INF:
                # cdf(z): 0.5 exp(z) for z <= 0, 1 - 0.5 exp(-z) above, from exp(-|z|)
                _call_exp_pass(r, ra, t, inv_alpha, 0.0, sorted_out)
                for i in range(n):
                    h = 0.5 * sorted_out[i]
                    z_pos = finite_z(ra, r[i], inv_alpha, t) > 0.0
                    sorted_out[i] = 1.0 - h if z_pos else h
            else:
                for i in range(n):
                    z = offset_z(ra, r[i], inv_alpha, t)
                    sorted_out[i] = log_cdf(z) if log else cdf(z)
            scatter(order[row], sorted_out, out[row, j])


@helper
def target_scales(r, inv_alpha, A, B, Ad, Bd, anchor, t, log):
    """The per-target factors of :func:`target_terms`: ``(shift, 1 / G, db/dalpha, common)``
    (``1 / G`` is 0 for a target at infinite distance, where ``G == 0``).
    """
    shift, G, Z = target_sums(r, inv_alpha, A, B, Ad, Bd, anchor, t)
    inv_g = 1.0 / G if G > 0.0 else 0.0
    common = 2.0 * math.exp(shift) * inv_g if log and G > 0.0 else 0.0
    return shift, inv_g, Z * inv_g, common


@inner_helper
def element_terms(z, shift, inv_g, inv_alpha, log):
    """``(kappa, omega, kappa_k)`` of one element at distance ``z`` from a target with factors
    ``shift``, ``inv_g`` (:func:`target_scales`); all 0 at infinite ``z`` or ``inv_g == 0``
    (``G >= 1`` otherwise: the nearest point weighs 1).
    """
    if abs(z) == INF or inv_g == 0.0:
        return 0.0, 0.0, 0.0
    omega = rel_weight(z, shift) * inv_g
    if log:
        return hazard(z) * inv_alpha, omega, 2.0 * shifted_hazard(z, shift) * inv_g
    return 0.5 * math.exp(-abs(z)) * inv_alpha, omega, omega


@helper
def target_terms(r, alpha, tables, anchor, t, log, z, kappa, omega, kappa_k):
    """Per element of one target: ``z``, ``kappa = h'(z) / alpha``, ``omega = db/dr_i`` and
    ``kappa_k = kappa * db/dk`` (all 0 at infinite z); returns ``(db/dalpha, common)``.

    ``db/dk = 2 alpha exp(shift) / G`` overflows for well-separated values, so ``kappa_k`` is
    formed per element: ``omega`` for top-k, a shifted hazard for logs. For logs every element
    with ``z <= 0`` has the same ``kappa_k = common = 2 exp(shift) / G``, which may be inf:
    callers that sum over elements sum their cotangents first (so opposite cotangents cancel
    to 0 instead of giving inf - inf).
    """
    E, A, B, Ad, Bd, S = tables
    n = r.shape[0]
    inv_alpha = 1.0 / alpha
    shift, inv_g, zg, common = target_scales(r, inv_alpha, A, B, Ad, Bd, anchor, t, log)
    ra = r[anchor]
    for i in range(n):
        zi = offset_z(ra, r[i], inv_alpha, t)
        z[i] = zi
        kappa[i], omega[i], kappa_k[i] = element_terms(zi, shift, inv_g, inv_alpha, log)
    return zg, common


@inner_helper
def _neighbours(r, inv_alpha, anchor, t):
    """``(L, R, zl, zr)``: the two points around a target ``(anchor, t)`` and their ``z``
    (``inf`` / ``-inf`` beyond the row's ends).
    """
    n = r.shape[0]
    if t <= 0.0:
        R = anchor
        L = anchor - 1
    else:
        L = anchor
        R = anchor + 1
    zl = offset_z(r[anchor], r[L], inv_alpha, t) if L >= 0 else INF
    zr = offset_z(r[anchor], r[R], inv_alpha, t) if R < n else -INF
    return L, R, zl, zr


@helper
def shift_and_nearest(r, inv_alpha, anchor, t):
    """``(shift, nearest)`` of a target ``(anchor, t)``, from its two neighbouring points:
    ``shift = min_i |z_i|`` (as :func:`~softorder.core.lapsum.target_sums` finds it) and
    the index of a point at that distance (relative weight 1; the left one of two at that
    distance); ``(inf, -1)`` for a target at infinite distance from every point (``G == 0``:
    all its terms are 0). One helper for both: each helper is a compilation of its own on a
    first call.
    """
    L, R, zl, zr = _neighbours(r, inv_alpha, anchor, t)
    if zl == INF and zr == -INF:
        return INF, -1
    if -zr < zl:  # min(zl, -zr), no builtin compiled (``helper``)
        return -zr, R
    return zl, L


@helper
def nearest_point(r, inv_alpha, anchor, t):
    """The ``nearest`` of :func:`shift_and_nearest` alone: the index of a point at the
    shift's distance of a target ``(anchor, t)``, -1 for a target at infinite distance from
    every point.
    """
    L, R, zl, zr = _neighbours(r, inv_alpha, anchor, t)
    if zl == INF and zr == -INF:
        return -1
    return R if -zr < zl else L  # shift_and_nearest's choice


#: Below this ``G`` (sum of the relative weights) the nearest point carries more than half of
#: it, and the gradient kernels form that point's terms apart (:func:`anchor_term`): with ``k``
#: an integer the two sides of the target weigh the same, so ``G >= 2`` there.
NEAR_SHARE_G = 2.0


@inner_helper
def anchor_term(e_a, rest, Z, inv_g):
    """The nearest point's term of ``x_bar`` for one target, ``omega_a phi - v_a kappa_a``, and
    the target's term of ``alpha_bar``, ``sum_i v_i kappa_i (Z / G - z_i)``, from the sums over
    the other points ``rest = (G_rest, phi_rest, phi_z_rest, D, v_a kappa_a)``
    (:func:`_rest_sums`, ``D = sum_(l != a) e_l (z_l - z_a)``):
    ``(e_a phi_rest - v_a kappa_a G_rest) / G`` and
    ``phi_rest Z / G - phi_z_rest + v_a kappa_a D / G``.

    Where that point carries nearly all of ``G`` (a fractional k, the other points far off)
    the differences of nearly equal numbers lost every bit of its terms: the Jacobian's
    diagonal is ``kappa_a (omega_a - 1) = -kappa_a G_rest / G``, its alpha column
    ``kappa_a (Z / G - z_a) = kappa_a D / G``.
    """
    g_rest, phi_rest, phi_z_rest, d_rest, vk_a = rest
    x_term = e_a * (phi_rest * inv_g) - vk_a * (g_rest * inv_g)
    return x_term, phi_rest * (Z * inv_g) - phi_z_rest + vk_a * (d_rest * inv_g)


#: Below this ``shift`` the VJP forms ``exp(-|z|)`` as ``exp(shift - |z|) exp(-shift)`` (one
#: ``exp`` per element instead of two); ``exp(-shift)`` is a normal number there.
ONE_EXP_SHIFT = 700.0


@helper
def _exp_pass(r, ra, t, inv_alpha, shift, out):
    """``out[i] = math.exp(shift - |z_i|)`` to the bit, ``z_i = finite_z(ra, r[i], inv_alpha,
    t)`` (:func:`finite_row` and a finite ``t``; ``shift`` finite, at most every ``|z_i|``):
    :func:`~softorder.core.fast_exp.exp_main` in a loop LLVM vectorizes (at 0 too, where it is
    1 exactly), then ``math.exp`` at the elements outside its range (none for most rows) in a
    second pass. The VJPs' relative weights (1 at ``|z_i| == shift``, 0 at infinity, as
    ``math.exp`` gives them) and, with ``shift = 0``, the forward's ``exp(-|z|)``: one helper,
    compiled once for both.
    """
    n = r.shape[0]
    far = False
    for i in range(n):
        x = shift - abs(finite_z(ra, r[i], inv_alpha, t))
        far |= needs_libm(x)
        out[i] = exp_or_zero(x)
    if far:
        for i in range(n):
            x = shift - abs(finite_z(ra, r[i], inv_alpha, t))
            if needs_libm(x):
                out[i] = math.exp(x)


_F, _F1 = types.float64, types.Array(types.float64, 1, "C")
_L1 = types.Array(types.int64, 1, "C")
#: per-row and per-target helpers the kernels call by symbol: compiled once, not again inside
#: each kernel (inlined, they lengthened the first call's compilation; figures in
#: CHANGELOG.md). gather and scatter stay linked in: called by symbol, once per target, they
#: slowed short rows with several targets
_TOPK_CALLS = SymbolCalls(
    # r, ra, t, inv_alpha, shift, out
    exp_pass=(_exp_pass, (_F1, _F, _F, _F, _F, _F1)),
    # r, inv_alpha, A, B
    prefix_sums=(prefix_sums_halves, (_F1, _F, _F1, _F1)),
    # r, inv_alpha, A, B, w, worder, anchor, offset (one row's)
    solve=(solve_targets_ab, (_F1, _F, _F1, _F1, _F1, _L1, _L1, _F1)),
    # r, inv_alpha, anchor, t
    shift_and_nearest=(shift_and_nearest, (_F1, _F, types.int64, _F)),
)
_call_solve = _TOPK_CALLS.solve
_call_shift_and_nearest = _TOPK_CALLS.shift_and_nearest
_call_exp_pass = _TOPK_CALLS.exp_pass
_call_prefix_sums = _TOPK_CALLS.prefix_sums


def topk_vjp(xs, order, alpha, anchor, offset, log, v, x_bar, w_bar, alpha_bar, work):
    """Cotangent ``v`` (rows, m, n) -> ``x_bar`` (rows, n), ``w_bar`` (rows, m), ``alpha_bar``.

    ``work``: (rows, VJP_WORK, n). No Lap-sum tables: per target, one pass forms each
    element's relative weight ``e_i = exp(shift - |z_i|)``, the next sums ``G = sum e_i`` and
    ``Z = sum z_i e_i`` (the sums of :func:`~softorder.core.lapsum.target_sums`) beside the
    cotangent's sums, so ``1 / G`` enters after it; ``exp(-|z_i|)`` of ``kappa`` is
    ``e_i exp(-shift)`` (:data:`ONE_EXP_SHIFT`). Each target's ``omega_i phi = e_i phi / G``
    is added in the next target's first pass, the last one's in the scatter. Where the
    target's nearest point carries more than half of ``G`` (``G <`` :data:`NEAR_SHARE_G`: a
    fractional k), one more pass sums the terms of the other points, from which that point's
    terms are formed (:func:`anchor_term`).

    ``x_bar`` (float64) holds the gradient in sorted order until the scatter; with one
    target it may be ``v`` itself. :func:`topk_vjp_narrow` writes a float32 ``x_bar``.

    Two kernels: :func:`_vjp_one` for one target per row (a scalar ``k``, and
    every call of the JAX bridge's handler), :func:`_vjp_several` for any number; a first
    call compiles only the one it needs (the one-target kernel compiles in about three
    quarters of the time; figures in CHANGELOG.md). ``serial`` and ``parallel`` are those of
    the one-target kernel (which raises ``ValueError`` for other counts): what the JAX
    bridge's handler calls by symbol.
    """
    run = _vjp_one if anchor.shape[1] == 1 else _vjp_several
    run(xs, order, alpha, anchor, offset, log, v, x_bar, w_bar, alpha_bar, work)


@kernel
def _vjp_several(xs, order, alpha, anchor, offset, log, v, x_bar, w_bar, alpha_bar, work):
    """:func:`topk_vjp` of any number of targets per row."""
    rows, n = xs.shape
    m = anchor.shape[1]
    for row in prange(rows):
        r = xs[row]
        o = order[row]
        if has_nan(r):
            # (loops: numba's slice assignments compiled longer on a first call)
            for i in range(n):
                x_bar[row, i] = np.nan
            for j in range(w_bar.shape[1]):
                w_bar[row, j] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        vs = work[row, 2, :n]  # the cotangent in sorted order
        # the last target's e_i, whose omega_i phi is still to add; with one target it goes
        # where v_i was (read first, never again)
        e = work[row, 0, :n] if m > 1 else vs
        # the gradient in sorted order goes to the row of x_bar, which the cotangent (when it
        # is that row: the rules pass one target's own cotangent copy) has left once
        # gathered; summed with the last target's terms into vs, it is scattered at the end
        rbar = x_bar[row]
        fresh = True  # rbar holds nothing yet
        pg = 0.0  # phi / G of the target in e
        pend = -1  # its nearest point where that is formed apart (anchor_term): its value
        fix = 0.0
        abar = 0.0
        for j in range(m):
            t = offset[row, j]
            an = anchor[row, j]
            shift, near = _call_shift_and_nearest(r, inv_alpha, an, t)
            w_bar[row, j] = 0.0
            if shift == INF:
                continue  # G == 0: every term of this target is 0
            ra = r[an]
            one_exp = shift < ONE_EXP_SHIFT
            decay = math.exp(-shift) if one_exp else 0.0
            gather(o, v[row, j], vs)  # (a separate pass: random reads inside the loop cost more)
            # the relative weights first, in a pass of their own: in the pass that sums them,
            # each call of exp spilled its six accumulators. They wait in rbar while it holds
            # nothing (e may be vs), else in e, once rbar has taken the previous target's
            # omega_i phi
            if not fresh:
                for i in range(n):
                    rbar[i] = rbar[i] + e[i] * pg
                if pend >= 0:
                    rbar[pend] = fix
            acc_near = 0.0 if fresh else rbar[near]
            _relative_weights(r, ra, t, inv_alpha, shift, rbar if fresh else e)
            G = 0.0
            Z = 0.0
            phi = 0.0
            phi_z = 0.0
            k_bar = 0.0  # times 1 / G
            v_common = 0.0  # log: cotangents of the elements whose kappa_k is `common`
            for i in range(n):
                vi = vs[i]
                if fresh:
                    ei = rbar[i]
                    acc = 0.0
                    e[i] = ei
                else:
                    ei = e[i]
                    acc = rbar[i]
                zi = offset_z(ra, r[i], inv_alpha, t)
                vk, G, Z, phi, phi_z, k_bar, v_common = _pullback_step(
                    vi, zi, ei, decay, one_exp, inv_alpha, log, G, Z, phi, phi_z, k_bar, v_common
                )
                rbar[i] = acc - vk  # (acc itself where vk is 0)
            pg, w_bar[row, j], alpha_term = _target_factors(
                G, Z, phi, phi_z, k_bar, v_common, shift
            )
            pend = -1
            if G < NEAR_SHARE_G:
                if fresh:  # (rbar holds 0 - v_i kappa_i; v may have been vs, or x_bar)
                    rest = _rest_sums(
                        r, o, ra, t, inv_alpha, decay, one_exp, log, e, None, rbar, near
                    )
                else:  # (m > 1: v is apart from x_bar, and vs from e)
                    rest = _rest_sums(
                        r, o, ra, t, inv_alpha, decay, one_exp, log, e, v[row, j], None, near
                    )
                pend = near
                x_term, alpha_term = anchor_term(e[near], rest, Z, 1.0 / G)
                fix = acc_near + x_term
            abar += alpha_term
            fresh = False
        alpha_bar[row] = abar
        if fresh:
            for i in range(n):
                x_bar[row, i] = 0.0
            continue
        for i in range(n):
            vs[i] = rbar[i] + e[i] * pg
        if pend >= 0:
            vs[pend] = fix
        xb = x_bar[row]
        ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
        for i in range(n):
            if ahead:  # (a condition the loop does not change: LLVM splits it)
                prefetch(xb, o[i + ahead if i + ahead < n else n - 1])
            xb[o[i]] = 0.0 if abs(r[i]) == INF else vs[i]  # (no cotangent reaches +-inf)


@kernel
def _vjp_one(xs, order, alpha, anchor, offset, log, v, x_bar, w_bar, alpha_bar, work):
    """:func:`topk_vjp` of one target per row (else ``ValueError``): :func:`_vjp_several`'s
    operations with ``m = 1``, in the same order, so the same bits; its relative weights go
    where the cotangent was (read first, never again). The multi-target bookkeeping of
    :func:`_vjp_several` (the previous target's terms, kept apart) is not compiled here.
    """
    rows, n = xs.shape
    if anchor.shape[1] != 1:
        raise ValueError("softorder: _vjp_one takes one target per row")
    for row in prange(rows):
        r = xs[row]
        o = order[row]
        if has_nan(r):
            # (loops: numba's slice assignments compiled longer on a first call)
            for i in range(n):
                x_bar[row, i] = np.nan
            w_bar[row, 0] = np.nan
            alpha_bar[row] = np.nan
            continue
        inv_alpha = 1.0 / alpha[row]
        t = offset[row, 0]
        an = anchor[row, 0]
        shift, nearest = _call_shift_and_nearest(r, inv_alpha, an, t)
        w_bar[row, 0] = 0.0
        if shift == INF:  # G == 0: every term is 0
            for i in range(n):
                x_bar[row, i] = 0.0
            alpha_bar[row] = 0.0
            continue
        ra = r[an]
        one_exp = shift < ONE_EXP_SHIFT
        decay = math.exp(-shift) if one_exp else 0.0
        vs = work[row, 2, :n]  # the cotangent in sorted order, then the relative weights
        gather(o, v[row, 0], vs)
        # the relative weights wait in the row of x_bar (v itself may be that row: gathered)
        rbar = x_bar[row]
        _relative_weights(r, ra, t, inv_alpha, shift, rbar)
        G = 0.0
        Z = 0.0
        phi = 0.0
        phi_z = 0.0
        k_bar = 0.0  # times 1 / G
        v_common = 0.0  # log: cotangents of the elements whose kappa_k is `common`
        for i in range(n):
            vi = vs[i]
            ei = rbar[i]
            vs[i] = ei
            zi = offset_z(ra, r[i], inv_alpha, t)
            vk, G, Z, phi, phi_z, k_bar, v_common = _pullback_step(
                vi, zi, ei, decay, one_exp, inv_alpha, log, G, Z, phi, phi_z, k_bar, v_common
            )
            rbar[i] = 0.0 - vk  # (_vjp_several's acc - vk with acc = 0)
        pg, w_bar[row, 0], alpha_term = _target_factors(G, Z, phi, phi_z, k_bar, v_common, shift)
        near = -1
        fix = 0.0
        if G < NEAR_SHARE_G:  # (_vjp_several's, as with its first target)
            near = nearest
            rest = _rest_sums(r, o, ra, t, inv_alpha, decay, one_exp, log, vs, None, rbar, near)
            x_term, alpha_term = anchor_term(vs[near], rest, Z, 1.0 / G)
            fix = 0.0 + x_term
        alpha_bar[row] = 0.0 + alpha_term  # (_vjp_several's sum over one target)
        for i in range(n):
            vs[i] = rbar[i] + vs[i] * pg
        if near >= 0:
            vs[near] = fix
        ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
        for i in range(n):
            if ahead:  # (a condition the loop does not change: LLVM splits it)
                prefetch(rbar, o[i + ahead if i + ahead < n else n - 1])
            rbar[o[i]] = 0.0 if abs(r[i]) == INF else vs[i]  # (no cotangent reaches +-inf)


@inner_helper
def _relative_weights(r, ra, t, inv_alpha, shift, weights):
    """A target's relative weights ``exp(shift - |z_i|)`` at every point of the sorted row
    ``r`` (0 at an infinite distance, 1 exactly where ``|z_i|`` is the shift) into ``weights``:
    the top-k VJP kernels' one copy of this pass, the vectorized ``exp`` where the row and the
    target are finite. Called once per target, so passing the arrays costs nothing that counts.
    """
    if FAST_EXP and finite_row(r, inv_alpha) and abs(t) != INF:
        _call_exp_pass(r, ra, t, inv_alpha, shift, weights)
    else:
        for i in range(r.shape[0]):
            az = abs(offset_z(ra, r[i], inv_alpha, t))
            weights[i] = 0.0 if az == INF else 1.0 if az == shift else math.exp(shift - az)


@inner_helper
def _pullback_step(vi, zi, ei, decay, one_exp, inv_alpha, log, G, Z, phi, phi_z, k_bar, v_common):
    """One element's step of the top-k VJP kernels' summing pass (cotangent ``vi``, distance
    ``zi``, relative weight ``ei``): returns its ``v_i kappa_i`` (0 where it adds no term) and
    the sums ``G, Z, phi, phi_z, k_bar, v_common`` with its terms added. The kernels' one copy
    of the per-element arithmetic, inlined into each (the same operations in the same order).
    """
    if abs(zi) == INF:
        return 0.0, G, Z, phi, phi_z, k_bar, v_common
    G += ei
    Z += zi * ei
    if vi == 0.0:  # (kappa may underflow where kappa_k does not: keep going)
        return 0.0, G, Z, phi, phi_z, k_bar, v_common
    if log:
        if zi <= 0.0:
            vk = vi * inv_alpha  # hazard 1
            v_common += vi
        else:
            h = 0.5 * (ei * decay if one_exp else math.exp(-zi))
            q = 1.0 / (1.0 - h)
            vk = vi * (h * q * inv_alpha)
            k_bar += vi * (ei * q)
    else:
        ez = ei * decay if one_exp else math.exp(-abs(zi))
        vk = vi * (0.5 * ez * inv_alpha)
        k_bar += vi * ei
    return vk, G, Z, phi + vk, phi_z + vk * zi, k_bar, v_common


@helper
def _rest_sums(r, o, ra, t, inv_alpha, decay, one_exp, log, e, v, terms, near):
    """:func:`anchor_term`'s sums over the points other than ``near``, from the relative
    weights ``e`` and each point's ``v_i kappa_i``: read from ``terms`` (``0 - v_i kappa_i``,
    where the summing pass left them and nothing else yet), or, with ``terms`` None, formed
    anew (:func:`_element_vk`, the summing pass's arithmetic) from the cotangent ``v`` (in
    the order of the input; float32 or float64). Each ``v_i kappa_i`` is ``0 + v_i kappa_i``
    (a zero is +0.0) either way, so the kernels' sums agree to the bit. ``o``, ``v`` and the
    decay arguments are read only when ``terms`` is None (each case a specialization).
    """
    za = offset_z(ra, r[near], inv_alpha, t)
    g_rest = 0.0
    phi_rest = 0.0
    phi_z_rest = 0.0
    d_rest = 0.0
    vk_near = 0.0
    for i in range(r.shape[0]):
        zi = offset_z(ra, r[i], inv_alpha, t)
        az = abs(zi)
        if az == INF:  # (no terms at infinite distance; never the nearest point)
            continue
        vk = 0.0
        # (one test or the other, pruned by the types: None or an array)
        if terms is not None:
            vk = 0.0 - terms[i]
        if v is not None:
            vi = np.float64(v[o[i]])
            if vi != 0.0:
                vk = 0.0 + _element_vk(vi, zi, az, e[i], decay, one_exp, inv_alpha, log)
        if i == near:
            vk_near = vk
        else:
            ei = e[i]
            g_rest += ei
            phi_rest += vk
            phi_z_rest += vk * zi
            d_rest += ei * (zi - za)
    return g_rest, phi_rest, phi_z_rest, d_rest, vk_near


@inner_helper
def _target_factors(G, Z, phi, phi_z, k_bar, v_common, shift):
    """A target's factors from its sums (:func:`_pullback_step`): ``(phi / G, w_bar, its term
    of alpha_bar)``; ``k_bar`` is summed times ``1 / G``, ``v_common`` (log) apart.
    """
    inv_g = 1.0 / G
    k_bar *= inv_g
    if v_common != 0.0:
        k_bar += v_common * (2.0 * math.exp(shift) * inv_g)
    return phi * inv_g, k_bar, phi * (Z * inv_g) - phi_z


topk_vjp.serial, topk_vjp.parallel = _vjp_one.serial, _vjp_one.parallel


@kernel
def topk_vjp_narrow(xs, order, alpha, anchor, offset, log, v, x_bar, w_bar, alpha_bar, work):
    """:func:`topk_vjp` of one target per row (else ``ValueError``) into a float32 ``x_bar``
    (the float64 gradient rounded once), ``v`` float32 or float64: no row of the gradient,
    only the first row of ``work`` (:data:`ONE_TARGET_VJP_WORK`; :func:`_one_target_vjp`).
    A float32 input's gradient without its float64 copy. A kernel of its own, so that
    :func:`topk_vjp`'s first call does not compile it.
    """
    rows, n = xs.shape
    if anchor.shape[1] != 1:
        raise ValueError("softorder: topk_vjp_narrow takes one target per row")
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            # (loops: numba's slice assignments compiled longer on a first call)
            for i in range(n):
                x_bar[row, i] = np.nan
            for j in range(w_bar.shape[1]):
                w_bar[row, j] = np.nan
            alpha_bar[row] = np.nan
            continue
        alpha_bar[row] = _one_target_vjp(
            r,
            order[row],
            1.0 / alpha[row],
            anchor[row, 0],
            offset[row, 0],
            log,
            v[row, 0],
            x_bar[row],
            w_bar[row],
            work[row, 0, :n],
        )


@helper
def _one_target_vjp(r, o, inv_alpha, an, t, log, v, xb, w_bar, e):
    """One row of :func:`topk_vjp` with one target: writes ``xb`` (the row of ``x_bar``) and
    ``w_bar[0]``, returns ``alpha_bar``. The operations of the general loop, without its row
    of the gradient: the first passes keep each ``e_i`` and sum the terms;
    the last gathers the cotangent again, forms each element's term of the sums anew
    (the same arithmetic; no ``exp`` below :data:`ONE_EXP_SHIFT`) and writes it, with its
    ``omega_i phi``, straight to its place in ``xb``. Scratch: ``e`` (n). ``v`` and ``xb``
    may be float32 (the float64 gradient, rounded once); ``xb`` may be ``v`` itself (each
    element is read before it is written).
    """
    n = r.shape[0]
    w_bar[0] = 0.0
    shift, nearest = shift_and_nearest(r, inv_alpha, an, t)
    if shift == INF:  # G == 0: every term of this target is 0
        for i in range(n):
            xb[i] = 0.0
        return 0.0
    ra = r[an]
    one_exp = shift < ONE_EXP_SHIFT
    decay = math.exp(-shift) if one_exp else 0.0
    # the relative weights in a pass of their own, as in topk_vjp (an exp in the pass that
    # sums them spilled its accumulators); that pass gathers the cotangent as it goes
    if FAST_EXP and finite_row(r, inv_alpha) and abs(t) != INF:
        _exp_pass(r, ra, t, inv_alpha, shift, e)
    else:
        for i in range(n):
            az = abs(offset_z(ra, r[i], inv_alpha, t))
            e[i] = 0.0 if az == INF else 1.0 if az == shift else math.exp(shift - az)
    G = 0.0
    Z = 0.0
    phi = 0.0
    phi_z = 0.0
    k_bar = 0.0  # times 1 / G
    ahead = AHEAD if n >= PREFETCH_FROM else 0  # (0: the row stays in the caches)
    v_common = 0.0  # log: cotangents of the elements whose kappa_k is `common`
    # the passes below in one loop per case (the same operations): with the case tested in
    # the loop, top-k's VJP took a fifth longer (256 x 1000, float32)
    if log:
        for i in range(n):
            zi = offset_z(ra, r[i], inv_alpha, t)
            az = abs(zi)
            if az == INF:
                continue
            ei = e[i]
            if ahead:  # (a condition the loop does not change: LLVM splits it)
                prefetch(v, o[i + ahead if i + ahead < n else n - 1])
            vi = np.float64(v[o[i]])
            G += ei
            Z += zi * ei
            if vi == 0.0:
                continue  # (kappa may underflow where kappa_k does not: keep going)
            if zi <= 0.0:
                vk = vi * inv_alpha  # hazard 1
                v_common += vi
            else:
                h = 0.5 * (ei * decay if one_exp else math.exp(-zi))
                q = 1.0 / (1.0 - h)
                vk = vi * (h * q * inv_alpha)
                k_bar += vi * (ei * q)
            phi += vk
            phi_z += vk * zi
    else:
        for i in range(n):
            zi = offset_z(ra, r[i], inv_alpha, t)
            az = abs(zi)
            if az == INF:
                continue
            ei = e[i]
            if ahead:  # (a condition the loop does not change: LLVM splits it)
                prefetch(v, o[i + ahead if i + ahead < n else n - 1])
            vi = np.float64(v[o[i]])
            G += ei
            Z += zi * ei
            if vi == 0.0:
                continue
            ez = ei * decay if one_exp else math.exp(-az)
            vk = vi * (0.5 * ez * inv_alpha)
            k_bar += vi * ei
            phi += vk
            phi_z += vk * zi
    inv_g = 1.0 / G
    pg = phi * inv_g
    k_bar *= inv_g
    if v_common != 0.0:
        k_bar += v_common * (2.0 * math.exp(shift) * inv_g)
    w_bar[0] = k_bar
    alpha_term = phi * (Z * inv_g) - phi_z
    near = -1
    fix = 0.0
    if G < NEAR_SHARE_G:  # (topk_vjp's; v is read before xb is written)
        near = nearest
        rest = _rest_sums(r, o, ra, t, inv_alpha, decay, one_exp, log, e, v, None, near)
        x_term, alpha_term = anchor_term(e[near], rest, Z, inv_g)
        fix = 0.0 + x_term
    if log:
        _one_target_terms(r, o, inv_alpha, ra, t, True, decay, one_exp, pg, v, xb, e)
    else:
        _one_target_terms(r, o, inv_alpha, ra, t, False, decay, one_exp, pg, v, xb, e)
    if near >= 0 and abs(r[near]) != INF:  # (no cotangent reaches +-inf)
        xb[o[near]] = fix
    return 0.0 + alpha_term


@inner_helper
def _one_target_terms(r, o, inv_alpha, ra, t, log, decay, one_exp, pg, v, xb, e):
    """The last pass of :func:`_one_target_vjp`: each element's term, with its ``omega_i phi``
    (``pg``), straight to its place in ``xb``. Inlined twice, with ``log`` a constant in each.
    """
    for i in range(r.shape[0]):
        oi = o[i]
        if abs(r[i]) == INF:
            xb[oi] = 0.0  # (no cotangent reaches +-inf)
            continue
        vi = np.float64(v[oi])
        zi = offset_z(ra, r[i], inv_alpha, t)
        az = abs(zi)
        ei = e[i]
        term = 0.0  # what the general loop keeps in its row of the gradient
        if az != INF and vi != 0.0:
            term = 0.0 - _element_vk(vi, zi, az, ei, decay, one_exp, inv_alpha, log)
        xb[oi] = term + ei * pg


@inner_helper
def _element_vk(vi, zi, az, ei, decay, one_exp, inv_alpha, log):
    """``v_i kappa_i`` of one element of :func:`topk_vjp`'s loop (``ei`` its relative weight)."""
    if log:
        if zi <= 0.0:
            return vi * inv_alpha  # hazard 1
        h = 0.5 * (ei * decay if one_exp else math.exp(-zi))
        q = 1.0 / (1.0 - h)
        return vi * (h * q * inv_alpha)
    ez = ei * decay if one_exp else math.exp(-az)
    return vi * (0.5 * ez * inv_alpha)


@kernel
def topk_jvp(xs, order, alpha, anchor, offset, log, x_dot, w_dot, alpha_dot, out, work):
    """Tangents ``x_dot`` (rows, n), ``w_dot`` (rows, m), ``alpha_dot`` (rows,) -> (rows, m, n).

    ``work``: (rows, GRADIENT_WORK, n) scratch.
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            # (loops: numba's slice assignments compiled longer on a first call)
            for j in range(m):
                for i in range(n):
                    out[row, j, i] = np.nan
            continue
        a = alpha[row]
        tables = moment_tables(r, 1.0 / a, work[row])
        z, kappa, omega, kappa_k, rdot = gradient_scratch(work[row], n)
        gather_finite(r, order[row], x_dot[row], rdot)
        sorted_out = work[row, 0, :n]  # E: the gradients do not read it
        for j in range(m):
            zg, common = target_terms(
                r, a, tables, anchor[row, j], offset[row, j], log, z, kappa, omega, kappa_k
            )
            bdot = 0.0
            for i in range(n):
                bdot += omega[i] * rdot[i]
            # omega_near - 1 as minus the sum of the other omegas where the nearest point
            # carries more than half of G (anchor_term)
            near = nearest_point(r, 1.0 / a, anchor[row, j], offset[row, j])
            bdot_rest = 0.0
            omega_rest = 0.0
            zg_near = 0.0  # Z / G - z_near as sum_(l != near) omega_l (z_l - z_near)
            if near >= 0 and omega[near] > 1.0 / NEAR_SHARE_G:
                for i in range(n):
                    if i != near and omega[i] != 0.0:  # (0 at infinite distance)
                        bdot_rest += omega[i] * rdot[i]
                        omega_rest += omega[i]
                        zg_near += omega[i] * (z[i] - z[near])
            else:
                near = -1
            ad = alpha_dot[row]
            wd = w_dot[row, j]
            for i in range(n):
                k = kappa[i]
                val = 0.0
                if k != 0.0:
                    if i == near:
                        val = k * (bdot_rest - omega_rest * rdot[i] + zg_near * ad)
                    else:
                        val = k * (bdot - rdot[i] + (zg - z[i]) * ad)
                if wd != 0.0:
                    val += wd * kappa_k[i]
                sorted_out[i] = val
            scatter(order[row], sorted_out, out[row, j])
