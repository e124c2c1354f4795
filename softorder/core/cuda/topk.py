"""GPU form of :mod:`softorder.core.topk`: soft top-k memberships (or their logs) for m values
of k per row, and their gradient products. Same arguments as the CPU kernels.

Parallel form (n the row length, m the number of k values of a row, few):

* the Lap-sum tables are affine scans (:func:`~softorder.core.cuda.lapsum.row_tables`);
* per target, one thread per (row, target): its inverse and its factors ``(shift, 1 / G,
  db/dalpha, common)`` (:func:`softorder.core.topk.target_scales`);
* per element of the (rows, m, n) output, one thread: memberships, tangents, and the terms of
  each target's sums over the row, which are :func:`~softorder.core.cuda.scan.row_sums` of a
  (rows * m, n) array;
* the cotangent of a row: one thread per element, looping over the row's m targets.

The per-element mathematics is :func:`softorder.core.topk.element_terms`, compiled as a device
function, so both targets compute the same terms.
"""

from __future__ import annotations

import math

from numba import cuda

from softorder.core import topk as cpu
from softorder.core.cuda import _launch
from softorder.core.cuda._launch import F1, F2, F3, I2
from softorder.core.cuda.lapsum import row_tables, solve_targets
from softorder.core.cuda.rows import element, gather_finite, nan_row, nan_rows, scatter
from softorder.core.cuda.scan import row_sums
from softorder.core.laplace import INF, cdf, log_cdf, offset_z
from softorder.core.lapsum import TABLES_WITH_MOMENTS

_cdf = _launch.device(cdf)
_log_cdf = _launch.device(log_cdf)
_offset_z = _launch.device(offset_z)
_target_scales = _launch.device(cpu.target_scales)
_element_terms = _launch.device(cpu.element_terms)
_nearest_point = _launch.device(cpu.nearest_point)

#: Per-target factors, the first axis of the ``factors`` (5, rows, m) array: ``NEAR`` is the
#: index of the nearest point (:func:`softorder.core.topk.nearest_point`; -1 where the target
#: is at infinite distance), whose terms are formed apart (:func:`softorder.core.topk.anchor_term`).
SHIFT, INV_G, ZG, COMMON, NEAR = range(5)
#: Per-target sums of the VJP, the first axis of its ``sums`` (9, rows * m) array: then
#: ``phi``, ``phi_z`` and ``sum omega`` without the nearest point a, ``D / G = sum_(l != a)
#: omega_l (z_l - z_a)`` and ``v_a kappa_a`` (:func:`softorder.core.topk.anchor_term`).
PHI, PHI_Z, K_BAR, V_COMMON, PHI_REST, PHI_Z_REST, OMEGA_REST, D_REST, VK_NEAR = range(9)
#: Per-target sums of the JVP, the first axis of its ``bdot`` (4, rows * m) array: ``bdot`` and,
#: without the nearest point, ``bdot``, ``sum omega`` and ``D / G``.
BDOT, BDOT_REST, BDOT_OMEGA_REST, BDOT_D_REST = range(4)


@cuda.jit(device=True, inline="always")
def _target_element(shape):
    """``(row, j, i, inside)`` of this thread for a (rows, m, n) elementwise launch."""
    idx = cuda.grid(1)
    m = shape[1]
    n = shape[2]
    row = idx // (m * n)
    rest = idx - row * (m * n)
    j = rest // n
    return row, j, rest - j * n, idx < shape[0] * m * n


@cuda.jit(device=True, inline="always")
def _near_z(xs, alpha, anchor, offset, factors, row, j):
    """``(a, z_a)`` of target ``j``'s nearest point (``a = -1``, ``z_a = 0`` where there is
    none: a target at infinite distance).
    """
    near = int(factors[NEAR, row, j])
    za = 0.0
    if near >= 0:
        r = xs[row]
        za = _offset_z(r[anchor[row, j]], r[near], 1.0 / alpha[row], offset[row, j])
    return near, za


@cuda.jit(device=True, inline="always")
def _terms_at(xs, alpha, anchor, offset, log, factors, row, j, i):
    """``(z, kappa, omega, kappa_k)`` of sorted element ``i`` for target ``j`` of ``row``: one
    step of the loop of :func:`softorder.core.topk.target_terms`.
    """
    r = xs[row]
    inv_alpha = 1.0 / alpha[row]
    z = _offset_z(r[anchor[row, j]], r[i], inv_alpha, offset[row, j])
    kappa, omega, kappa_k = _element_terms(
        z, factors[SHIFT, row, j], factors[INV_G, row, j], inv_alpha, log
    )
    return z, kappa, omega, kappa_k


@_launch.kernel(F2, I2, F1, I2, F2, "boolean", F3)
def _memberships(xs, order, alpha, anchor, offset, log, out):
    """One thread per element of ``out`` (rows, m, n): ``F(z)`` or ``log F(z)``."""
    row, j, i, inside = _target_element(out.shape)
    if inside:
        if nan_row(xs, row):
            out[row, j, i] = math.nan
            return
        r = xs[row]
        z = _offset_z(r[anchor[row, j]], r[i], 1.0 / alpha[row], offset[row, j])
        out[row, j, order[row, i]] = _log_cdf(z) if log else _cdf(z)


@_launch.kernel(F2, F1, F2, F2, F2, F2, I2, F2, "boolean", F3)
def _target_factors(xs, alpha, A, B, Ad, Bd, anchor, offset, log, factors):
    """One thread per target: its factors into ``factors[:, row, j]`` (0 in NaN rows)."""
    row, j, inside = element(anchor.shape)
    if inside:
        shift = inv_g = zg = common = 0.0
        near = -1
        if not nan_row(xs, row):
            inv_alpha = 1.0 / alpha[row]
            shift, inv_g, zg, common = _target_scales(
                xs[row],
                inv_alpha,
                A[row],
                B[row],
                Ad[row],
                Bd[row],
                anchor[row, j],
                offset[row, j],
                log,
            )
            if shift != INF:
                near = _nearest_point(xs[row], inv_alpha, anchor[row, j], offset[row, j])
        factors[SHIFT, row, j] = shift
        factors[INV_G, row, j] = inv_g
        factors[ZG, row, j] = zg
        factors[COMMON, row, j] = common
        factors[NEAR, row, j] = near


def _factors(xs, alpha, tables, anchor, offset, log):
    """The (5, rows, m) per-target factors (indexed by ``SHIFT, INV_G, ZG, COMMON, NEAR``)."""
    E, A, B, Ad, Bd, S = tables
    factors = _launch.empty((5,) + tuple(anchor.shape))
    _launch.for_each(
        _target_factors, anchor.size, xs, alpha, A, B, Ad, Bd, anchor, offset, log, factors
    )
    return factors


@_launch.kernel(F2, I2, F1, I2, F2, "boolean", F3, F3, F3)
def _vjp_terms(xs, order, alpha, anchor, offset, log, factors, v, terms):
    """One thread per element of ``v`` (rows, m, n): its terms of the target's sums (the first
    axis of ``sums``) into ``terms[:, row * m + j, i]``.
    """
    row, j, i, inside = _target_element(v.shape)
    if inside:
        phi = phi_z = k_bar = v_common = omega = d = 0.0
        vi = v[row, j, order[row, i]]
        near = -1
        if not nan_row(xs, row):
            z, kappa, omega, kappa_k = _terms_at(xs, alpha, anchor, offset, log, factors, row, j, i)
            near, za = _near_z(xs, alpha, anchor, offset, factors, row, j)
            if omega != 0.0:  # (0 at infinite distance)
                d = omega * (z - za)
            if vi != 0.0 and abs(z) != INF:  # (kappa may underflow where kappa_k does not)
                phi = vi * kappa
                phi_z = phi * z
                if log and z <= 0.0:
                    v_common = vi  # the elements whose kappa_k is `common`
                else:
                    k_bar = vi * kappa_k
        rj = row * anchor.shape[1] + j
        terms[PHI, rj, i] = phi
        terms[PHI_Z, rj, i] = phi_z
        terms[K_BAR, rj, i] = k_bar
        terms[V_COMMON, rj, i] = v_common
        rest = i != near
        terms[PHI_REST, rj, i] = phi if rest else 0.0
        terms[PHI_Z_REST, rj, i] = phi_z if rest else 0.0
        terms[OMEGA_REST, rj, i] = omega if rest else 0.0
        terms[D_REST, rj, i] = d if rest else 0.0
        terms[VK_NEAR, rj, i] = 0.0 if rest else phi


@_launch.kernel(F3, F2, F2, F2)
def _vjp_targets(factors, sums, w_bar, alpha_terms):
    """One thread per target: ``w_bar`` and the target's part of alpha's cotangent."""
    row, j, inside = element(w_bar.shape)
    if inside:
        rj = row * w_bar.shape[1] + j
        k_bar = sums[K_BAR, rj]
        v_common = sums[V_COMMON, rj]
        w_bar[row, j] = k_bar + v_common * factors[COMMON, row, j] if v_common != 0.0 else k_bar
        # Z / G - z_a of the nearest point as D / G (softorder.core.topk.anchor_term)
        alpha_terms[row, j] = (
            sums[PHI_REST, rj] * factors[ZG, row, j]
            - sums[PHI_Z_REST, rj]
            + sums[VK_NEAR, rj] * sums[D_REST, rj]
        )


@_launch.kernel(F2, I2, F1, I2, F2, "boolean", F3, F3, F2, F2)
def _vjp_points(xs, order, alpha, anchor, offset, log, factors, v, sums, rbar):
    """One thread per element of the sorted row, looping over the row's m targets (few):
    ``rbar_i = sum_j (omega_ij phi_j - v_ij kappa_ij)``, at each target's nearest point from
    the sums without it (:func:`softorder.core.topk.anchor_term`).
    """
    row, i, inside = element(rbar.shape)
    if inside:
        acc = 0.0
        if not nan_row(xs, row):
            m = anchor.shape[1]
            oi = order[row, i]
            for j in range(m):
                z, kappa, omega, _ = _terms_at(xs, alpha, anchor, offset, log, factors, row, j, i)
                vi = v[row, j, oi]
                vk = vi * kappa if vi != 0.0 and abs(z) != INF else 0.0
                rj = row * m + j
                if i == factors[NEAR, row, j]:
                    # omega phi_rest - vk (1 - omega), 1 - omega summed over the other points
                    acc += omega * sums[PHI_REST, rj] - vk * sums[OMEGA_REST, rj]
                else:
                    acc -= vk
                    acc += omega * sums[PHI, rj]
        rbar[row, i] = acc


@_launch.kernel(F2, F1, I2, F2, "boolean", F3, F2, F3)
def _jvp_terms(xs, alpha, anchor, offset, log, factors, rdot, terms):
    """One thread per (row, target, element) of ``terms`` (4, rows * m, n): ``omega_ij rdot_i``
    and, 0 at the target's nearest point a, ``omega_ij rdot_i``, ``omega_ij`` and
    ``omega_ij (z_ij - z_aj)``.
    """
    rj, i, inside = element(terms.shape[1:])
    if inside:
        m = anchor.shape[1]
        row = rj // m
        j = rj - row * m
        value = omega = d = 0.0
        near = -1
        if not nan_row(xs, row):
            z, _, omega, _ = _terms_at(xs, alpha, anchor, offset, log, factors, row, j, i)
            value = omega * rdot[row, i]
            near, za = _near_z(xs, alpha, anchor, offset, factors, row, j)
            if omega != 0.0:  # (0 at infinite distance)
                d = omega * (z - za)
        rest = i != near
        terms[BDOT, rj, i] = value
        terms[BDOT_REST, rj, i] = value if rest else 0.0
        terms[BDOT_OMEGA_REST, rj, i] = omega if rest else 0.0
        terms[BDOT_D_REST, rj, i] = d if rest else 0.0


@_launch.kernel(F2, I2, F1, I2, F2, "boolean", F3, F2, F2, F2, F1, F3)
def _tangents(xs, order, alpha, anchor, offset, log, factors, bdot, rdot, w_dot, alpha_dot, out):
    """One thread per element of ``out`` (rows, m, n):
    ``kappa (bdot - rdot_i + (db/dalpha - z) alpha_dot) + w_dot kappa_k``, at the target's
    nearest point with ``bdot - rdot_i`` from the sums without it.
    """
    row, j, i, inside = _target_element(out.shape)
    if inside:
        if nan_row(xs, row):
            out[row, j, i] = math.nan
            return
        z, kappa, omega, kappa_k = _terms_at(xs, alpha, anchor, offset, log, factors, row, j, i)
        value = 0.0
        if kappa != 0.0:
            rj = row * anchor.shape[1] + j
            if i == factors[NEAR, row, j]:
                db = bdot[BDOT_REST, rj] - bdot[BDOT_OMEGA_REST, rj] * rdot[row, i]
                dz = bdot[BDOT_D_REST, rj]  # Z / G - z, with no difference of near numbers
            else:
                db = bdot[BDOT, rj] - rdot[row, i]
                dz = factors[ZG, row, j] - z
            value = kappa * (db + dz * alpha_dot[row])
        wd = w_dot[row, j]
        if wd != 0.0:
            value += wd * kappa_k
        out[row, j, order[row, i]] = value


def topk_forward(xs, order, alpha, w, worder, log: bool, out, anchor, offset, work) -> None:
    """GPU :func:`softorder.core.topk.topk_forward` (``worder`` is not needed).

    Tables (scans), one thread per target (inverse), one thread per element of ``out``.
    """
    tables = row_tables(xs, alpha, False, work)
    solve_targets(xs, alpha, tables, w, anchor, offset)
    _launch.for_each(_memberships, out.size, xs, order, alpha, anchor, offset, log, out)


def topk_vjp(xs, order, alpha, anchor, offset, log: bool, v, x_bar, w_bar, alpha_bar, work) -> None:
    """GPU :func:`softorder.core.topk.topk_vjp`.

    Tables (scans); per-target factors; per-element terms of ``v`` (rows, m, n) summed per
    target by one ``row_sums``; per-target ``w_bar`` and alpha terms (summed per row); one
    thread per element for ``x_bar``, looping over the m targets.
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    tables = row_tables(xs, alpha, True, work)
    factors = _factors(xs, alpha, tables, anchor, offset, log)
    terms = _launch.empty((9, rows * m, n))
    _launch.for_each(_vjp_terms, v.size, xs, order, alpha, anchor, offset, log, factors, v, terms)
    sums = _launch.empty((9, rows * m))
    row_sums(terms.reshape(9 * rows * m, n), sums.reshape(9 * rows * m))
    alpha_terms = _launch.empty((rows, m))
    _launch.for_each(_vjp_targets, anchor.size, factors, sums, w_bar, alpha_terms)
    row_sums(alpha_terms, alpha_bar)
    rbar = work[:, TABLES_WITH_MOMENTS, :]
    _launch.for_each(
        _vjp_points, xs.size, xs, order, alpha, anchor, offset, log, factors, v, sums, rbar
    )
    scatter(xs, order, rbar, x_bar, finite=True)
    nan_rows(xs, w_bar, alpha_bar)


def topk_jvp(
    xs, order, alpha, anchor, offset, log: bool, x_dot, w_dot, alpha_dot, out, work
) -> None:
    """GPU :func:`softorder.core.topk.topk_jvp`.

    Tables (scans); per-target factors; ``db = sum_i omega_i rdot_i`` per target (and the sums
    without its nearest point) as one ``row_sums`` of a (4 rows m, n) array; one thread per
    element of ``out``.
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    tables = row_tables(xs, alpha, True, work)
    rdot = work[:, TABLES_WITH_MOMENTS, :]
    gather_finite(xs, order, x_dot, rdot)
    factors = _factors(xs, alpha, tables, anchor, offset, log)
    terms = _launch.empty((4, rows * m, n))
    _launch.for_each(_jvp_terms, rows * m * n, xs, alpha, anchor, offset, log, factors, rdot, terms)
    bdot = _launch.empty((4, rows * m))
    row_sums(terms.reshape(4 * rows * m, n), bdot.reshape(4 * rows * m))
    _launch.for_each(
        _tangents,
        out.size,
        xs,
        order,
        alpha,
        anchor,
        offset,
        log,
        factors,
        bdot,
        rdot,
        w_dot,
        alpha_dot,
        out,
    )


__all__ = ["topk_forward", "topk_jvp", "topk_vjp"]
