"""Gradients of the inverse values: soft sort (``w = k - 1/2``) and soft quantile (``w = q n``).

The forward pass is :func:`softorder.core.lapsum.inverse_kernel`. With ``b_j = S^-1(w_j)``:

    db_j/dr_i = e_ji / E_j,   db_j/dw_j = 1 / G_j,
    db_j/dalpha = sum_i e_ji (b_j - r_i) / (alpha E_j)

(``e_ji = exp(-|b_j - r_i| / alpha)``). Both products are one merge of the sorted row with the
sorted targets, O(n + m) per row.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import prange, types

from softorder.core import fast_exp, fast_log
from softorder.core._jit import CallOnDemand, SymbolCalls, helper, inner_helper, kernel
from softorder.core.fast_exp import FAST_EXP, exp_or_zero, needs_libm
from softorder.core.kernel_sums import (
    _first_at_or_above,
    carry_both_ways,
    carry_injections,
    inject_exact,
)
from softorder.core.laplace import INF, exp_nonpositive, gap, offset_z
from softorder.core.lapsum import (
    SMALL_E,
    TABLES_WITH_MOMENTS,
    empty,
    inverse_pullback,
    inverse_pushforward,
    invert_far,
    moment_step_down,
    moment_step_up,
    moment_tables,
    other_target_weights,
    stack_rows,
    target_position,
    target_weights,
)
from softorder.core.rank import decays as _row_decays
from softorder.core.rows import gather_finite, has_nan, scatter_finite

#: rows of scratch: the tables and the gradient (the CPU kernel keeps the gradient in the row
#: of ``S`` and the pullback's upward injections in the last row)
VJP_WORK = TABLES_WITH_MOMENTS + 1
#: rows of scratch of soft sort's VJP (:func:`sort_vjp`): E, B, Bd, the upward injections and
#: the gradient (``A`` and ``Ad`` are kept in registers: :func:`sort_row_vjp`)
SORT_VJP_WORK = 5
#: the tables and the tangent (the CPU kernel keeps it in the row of ``S``: one row untouched)
JVP_WORK = TABLES_WITH_MOMENTS + 1
#: With at most n / FEW_TARGETS targets per row (soft quantile) the VJP (:func:`few_inverse_vjp`)
#: fills its tables only at two points per target (:func:`few_tables`) and keeps the upward
#: injections as a list (:func:`few_pullback`): ``E`` and the row of ``x_bar`` resident instead
#: of 7 rows of n and ``x_bar`` (at n = 1e6, 48 MB less).
FEW_TARGETS = 8
#: the rows of ``work`` of :func:`few_inverse_vjp`
FEW_VJP_WORK = 1
#: and at most this many (:func:`~softorder.core.lapsum.neighbour_sums` sorts them by
#: insertion)
MAX_FEW_TARGETS = 64
#: the longest row whose few-target pullback runs its two carrying passes beside each other
#: (:func:`_carry_beside`): their scratch of n / 2 becomes resident, which at n = 1e6 would
#: cost a float32 row's bytes; longer rows run them one after the other
CARRY_BESIDE_N = 1 << 16


_F, _B, _I = types.float64, types.boolean, types.int64
_F1, _F2 = types.Array(_F, 1, "C"), types.Array(_F, 2, "C")
_L1 = types.Array(types.int64, 1, "C")
#: the per-row helpers of :func:`sort_vjp` and :func:`inverse_vjp`, called by symbol:
#: compiled once, not again inside each kernel (the first call's compilation)
_VJP_CALLS = SymbolCalls(
    # r, inv_alpha, work
    moment_tables=(moment_tables, (_F1, _F, _F2)),
    # r, a, tables, anchor, offset, u, rbar, w_bar, injections up and down, two flags
    inverse_pullback=(
        inverse_pullback,
        (_F1, _F, types.UniTuple(_F1, 6), _L1, _F1, _F1, _F1, _F1, _F1, _F1, _B, _B),
    ),
)
_call_moment_tables = _VJP_CALLS.moment_tables
_call_inverse_pullback = _VJP_CALLS.inverse_pullback


@kernel
def inverse_vjp(xs, order, alpha, anchor, offset, worder, u, x_bar, w_bar, alpha_bar, work, twork):
    """Cotangent ``u`` (rows, m) on the targets -> ``x_bar`` (rows, n; original element order),
    ``w_bar`` (rows, m) and ``alpha_bar`` (rows,). Scratch: ``work`` (rows, VJP_WORK, n),
    ``twork`` (rows, PULLBACK_WORK, m; only the GPU twin uses it). A ``w_bar`` of width 0 asks
    for no ``w_bar`` (soft sort discards it; it costs an ``exp`` per target). ``x_bar`` may be
    ``u`` itself (soft sort): each row of ``u`` is read before that row of ``x_bar`` is written.
    :func:`few_inverse_vjp` is the same VJP, lighter for a few targets.
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    want_wbar = w_bar.shape[1] == m
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            w_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        w = work[row]
        tables = _call_moment_tables(r, 1.0 / a, w)
        inj_up = w[TABLES_WITH_MOMENTS, :n]
        rbar = w[3, :n]  # S: the gradients do not read it
        rbar[:] = 0.0
        alpha_bar[row] = _call_inverse_pullback(
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            u[row],
            rbar,
            w_bar[row],
            inj_up,
            rbar,
            want_wbar,
            True,
        )
        scatter_finite(r, order[row], rbar, x_bar[row])


@kernel
def sort_vjp(xs, order, alpha, anchor, offset, u, x_bar, alpha_bar, work):
    """Soft sort's :func:`inverse_vjp` (n targets, no ``w_bar``): cotangent ``u`` (rows, n) ->
    ``x_bar`` (rows, n; original element order) and ``alpha_bar`` (rows,), the same values to
    the bit, with two rows of scratch fewer: ``work`` (rows, :data:`SORT_VJP_WORK`, n).
    ``x_bar`` may be ``u`` itself. ``u`` may be float32 (read as it is) and ``x_bar`` float32
    (the float64 gradient rounded once): a float32 input's gradient without a float64 copy of
    its cotangent or a float64 row of results.

    :func:`~softorder.core.lapsum.inverse_pullback` with the tables of
    :func:`~softorder.core.lapsum.moment_tables` split by direction: ``E``, ``B``, ``Bd`` in
    rows (:func:`descending_tables`), ``A``, ``Ad`` by their recurrences in registers,
    advanced to each target's left point ``L`` as the targets come. Soft sort's targets
    ascend, so ``L`` never falls more than 2 below the largest ``L`` so far
    (:func:`~softorder.core.lapsum.solve_ladder`: ``L`` is ``J - 2``, ``J - 1`` or ``J`` for a
    non-decreasing count ``J``): the values at the last three points are kept, and any other
    ``L`` restarts the recurrence (right, only slower). The same operations in the same
    order, so the same values to the bit.

    A kernel of its own: :func:`inverse_vjp` also compiles the few-targets path
    (:func:`few_tables`), which n targets never take, into soft sort's first call.
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        w = work[row]
        inv_alpha = 1.0 / alpha[row]
        E = w[0, :n]
        B = w[1, :n]
        Bd = w[2, :n]
        inj_up = w[3, :n]
        rbar = w[4, :n]  # the downward injections, then the gradient in sorted order
        _call_descending_tables(r, inv_alpha, E, B, Bd)
        inj_up[:] = 0.0
        rbar[:] = 0.0
        alpha_bar[row] = _sort_pullback(
            r, alpha[row], inv_alpha, E, B, Bd, anchor[row], offset[row], u[row], inj_up, rbar
        )
        _call_sort_carry(E, inj_up, rbar, rbar, True)
        scatter_finite(r, order[row], rbar, x_bar[row])


@helper
def _sort_pullback(r, alpha, inv_alpha, E, B, Bd, anchor, offset, u, inj_up, inj_down):
    """The loop over the targets of :func:`sort_vjp`: injects each target into ``inj_up``,
    ``inj_down`` and returns ``alpha_bar``, the operations of
    :func:`~softorder.core.lapsum.inverse_pullback` with ``A[L]``, ``Ad[L]`` from their
    recurrences (``u`` float32 or float64: compiled for each).
    """
    n = r.shape[0]
    m = anchor.shape[0]
    p = 0  # A, Ad at p (a0, ad0), p - 1 and p - 2
    a0 = 1.0
    ad0 = 0.0
    a1 = 0.0
    ad1 = 0.0
    a2 = 0.0
    ad2 = 0.0
    alpha_bar = 0.0
    for j in range(m):
        an = anchor[j]
        t = offset[j]
        uj = u[j]
        ra = r[an]
        position = ra if t == 0.0 or abs(ra) == INF else ra + alpha * t  # target_position
        if uj == 0.0 or abs(position) == INF:
            continue
        L = an - 1 if t <= 0.0 else an
        R = L + 1
        aL = 0.0
        adL = 0.0
        if L >= 0:
            if L < p - 2:
                p = 0
                a0 = 1.0
                ad0 = 0.0
            while p < L:
                p += 1
                e = E[p]
                d = gap(r[p], r[p - 1])
                a2 = a1
                ad2 = ad1
                a1 = a0
                ad1 = ad0
                a0 = 1.0 + e * a1  # moment_step_up
                ad0 = e * (ad1 + d * inv_alpha * a1) if e > 0.0 else 0.0
            aL = a0 if L == p else a1 if L == p - 1 else a2
            adL = ad0 if L == p else ad1 if L == p - 1 else ad2
        how, G, Z, el, er, sh = target_weights(
            r,
            inv_alpha,
            ra,
            t,
            L,
            R,
            aL,
            adL,
            B[R] if R < n else 0.0,
            Bd[R] if R < n else 0.0,
        )
        if how == 0:
            continue
        cj = uj / G
        if how == 1:
            if R < n:
                inj_up[R] += cj * er
            if L >= 0:
                inj_down[L] += cj * el
        else:
            inject_exact(r, inv_alpha, ra, t, sh, cj, R, inj_up, inj_down)
        alpha_bar += uj * Z / G
    return alpha_bar


@helper
def descending_tables(r, inv_alpha, E, B, Bd):
    """``E``, ``B``, ``Bd`` of :func:`~softorder.core.lapsum.moment_tables` (the same
    operations on the same values: the same bits): the decays in their pass
    (:func:`~softorder.core.rank.decays`, ``exp`` in a loop LLVM vectorizes), then the
    descending recurrences (:func:`_descending_from_decays`); :func:`sort_row_vjp`
    computes ``A`` and ``Ad`` where it reads them.
    """
    _row_decays(r, inv_alpha, E)
    _descending_from_decays(r, inv_alpha, E, B, Bd)


@helper
def _descending_from_decays(r, inv_alpha, E, B, Bd):
    """``B`` and ``Bd`` of :func:`descending_tables` from the decays ``E``
    (:func:`~softorder.core.rank.decays`): the recurrences alone (the permutation loss's
    ladder VJP computes its decays itself).
    """
    n = r.shape[0]
    B[n - 1] = 1.0
    Bd[n - 1] = 0.0
    b = 1.0
    bd = 0.0
    for k in range(n - 2, -1, -1):
        i = np.uint64(k)  # (unsigned: no wraparound)
        d = gap(r[i + np.uint64(1)], r[i])
        e = E[i + np.uint64(1)]
        bd = e * (bd + d * inv_alpha * b) if e > 0.0 else 0.0
        b = 1.0 + e * b
        B[i] = b
        Bd[i] = bd


#: the per-row helpers of :func:`sort_vjp`, called by symbol
_SORT_VJP_CALLS = SymbolCalls(
    # r, inv_alpha, E, B, Bd
    descending_tables=(descending_tables, (_F1, _F, _F1, _F1, _F1)),
    # E, injections up and down, out, fresh_out
    carry_injections=(carry_injections, (_F1, _F1, _F1, _F1, _B)),
)
_call_descending_tables = _SORT_VJP_CALLS.descending_tables
_call_sort_carry = _SORT_VJP_CALLS.carry_injections


@kernel
def inverse_jvp(
    xs, order, alpha, anchor, offset, worder, x_dot, w_dot, alpha_dot, out, work, twork
):
    """Tangents ``x_dot`` (rows, n; original order), ``w_dot`` (rows, m), ``alpha_dot`` (rows,)
    -> tangent of the targets ``out`` (rows, m). Scratch: ``work`` (rows, JVP_WORK, n),
    ``twork`` (rows, PUSHFORWARD_WORK, m).
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :] = np.nan
            continue
        a = alpha[row]
        tables = moment_tables(r, 1.0 / a, work[row])
        rdot = work[row, 3, :n]  # S: the gradients do not read it (row 6 stays untouched)
        gather_finite(r, order[row], x_dot[row], rdot)
        inverse_pushforward(
            r,
            a,
            tables,
            anchor[row],
            offset[row],
            worder[row],
            rdot,
            w_dot[row],
            alpha_dot[row],
            out[row],
            twork[row],
        )


def few_targets(m: int, n: int) -> bool:
    """Whether ``m`` targets per row of ``n`` are few (:data:`FEW_TARGETS`): the VJP is then
    :func:`few_inverse_vjp`'s.
    """
    return m * FEW_TARGETS <= n and m <= MAX_FEW_TARGETS


#: :func:`~softorder.core.kernel_sums._first_at_or_above`, the search of a target in a tie
#: or a rounding, as :func:`few_pullback` calls it: compiled the first time a row of
#: :func:`few_inverse_vjp` meets such a target; the rows before hand their row back
#: (:func:`_then_linked`)
TIE_SEARCH = CallOnDemand(_first_at_or_above, _I, float64=(_F1, _F, _F, _F, _I))
_call_tie_search = TIE_SEARCH.call


def _then_linked(on_demand: str, kernel):
    """A kernel whose last argument ``redo_only`` runs it on the rows it handed back alone,
    and that hands back the rows that need the helper of the
    :class:`~softorder.core._jit.CallOnDemand` named ``on_demand`` before it is linked: the
    function it decorates (the documented call, without ``redo_only``) runs the kernel on
    every row, then, if it handed a row back while the helper was not yet linked for the
    rows' dtype, links it and runs the kernel again on those rows.

    The helpers are the rare paths of the pullbacks (:data:`OTHER_TARGET`,
    :data:`TIE_SEARCH`: ties and rounding, e.g. integer values at a small alpha), whose
    compilation lengthened every first call with an empty cache (CHANGELOG.md): a process
    compiles one only when a row first needs it, once. The kernel returns the count of the
    rows it handed back, and so does the function (the rows still handed back, for other
    reasons, go to its caller's general path); ``serial`` and ``parallel`` are the kernel's,
    ``kernel`` the kernel itself.
    """

    def wrap(documented):
        @functools.wraps(documented)
        def run(*args):
            helper = globals()[on_demand]  # (by name: defined below some kernels it serves)
            key = args[0].dtype.name
            linked = helper.linked(key)
            handed = kernel(*args, False)
            if handed and not linked:
                helper.link(key)
                handed = kernel(*args, True)
            return handed

        run.serial = kernel.serial
        run.parallel = kernel.parallel
        run.kernel = kernel
        return run

    return wrap


@kernel
def _few_inverse_vjp(
    xs, order, alpha, anchor, offset, worder, u, x_bar, w_bar, alpha_bar, work, twork, redo_only
):
    """:func:`few_inverse_vjp`'s kernel (``redo_only``: :func:`_then_linked`; the rows it
    hands back get a NaN ``alpha_bar``).
    """
    rows, n = xs.shape
    m = anchor.shape[1]
    want_wbar = w_bar.shape[1] == m
    handed = 0
    for row in prange(rows):
        if redo_only and alpha_bar[row] == alpha_bar[row]:
            continue
        r = xs[row]
        if has_nan(r):
            # (loops: numba's slice assignments compiled longer on a first call)
            for i in range(n):
                x_bar[row, i] = np.nan
            for j in range(w_bar.shape[1]):
                w_bar[row, j] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        E = work[row, 0, :n]
        tables = _call_few_tables(r, 1.0 / a, anchor[row], offset[row], E, x_bar[row])
        ab, done = _call_few_pullback(
            r, a, tables, anchor[row], offset[row], u[row], x_bar[row], w_bar[row], want_wbar
        )
        if not done:
            alpha_bar[row] = np.nan
            handed += 1
            continue
        alpha_bar[row] = ab
        scatter_finite(r, order[row], E, x_bar[row])
    return handed


@_then_linked("TIE_SEARCH", _few_inverse_vjp)
def few_inverse_vjp(
    xs, order, alpha, anchor, offset, worder, u, x_bar, w_bar, alpha_bar, work, twork
):
    """:func:`inverse_vjp` of a few targets (:func:`few_targets`), the same values to the
    bit: the tables only at the targets' points (:func:`few_tables`), the upward injections
    as a list (:func:`few_pullback`). ``work`` (rows, >= 1, n): ``E``; the marks, then the
    gradient in sorted order, go in the row of ``x_bar`` (never ``u``: it has m < n columns)
    and the gradient's last pass into the spent ``E``, from where it is scattered into
    ``x_bar``. ``worder`` and ``twork`` are not read. A kernel of its own, so that a first call
    compiles only the path it takes; targets in ties or roundings call the search of
    :data:`TIE_SEARCH`, compiled when a row first needs it.
    """


@helper
def few_tables(r, inv_alpha, anchor, offset, E, marks):
    """The tables of :func:`~softorder.core.lapsum.moment_tables` as the
    pullback of a few targets reads them: ``E`` whole, ``A``, ``Ad`` at each target's left
    point and ``B``, ``Bd`` at its right one, by the same recurrences (the same values to the
    bit). The rest of those arrays is never written, so its pages never become resident: at
    n = 1e6, 32 MB less than the full tables. ``marks`` (n) marks the points read (1: left,
    2: right, 3: both); the caller reuses it.
    """
    n = r.shape[0]
    m = anchor.shape[0]
    # allocated here, not rows of work: NumPy asks for transparent huge pages on large
    # arrays, where one write makes 2 MB resident; these are written at a few points only
    A = empty((n,), np.float64)
    B = empty((n,), np.float64)
    Ad = empty((n,), np.float64)
    Bd = empty((n,), np.float64)
    for i in range(n):  # (a loop: numba's slice assignment compiled longer on a first call)
        marks[i] = 0.0
    for j in range(m):
        left = anchor[j] - 1 if offset[j] <= 0.0 else anchor[j]
        if left >= 0 and (marks[left] == 0.0 or marks[left] == 2.0):
            marks[left] += 1.0
        if left + 1 < n and marks[left + 1] < 2.0:
            marks[left + 1] += 2.0
    E[0] = 0.0
    a = 1.0
    ad = 0.0
    for i in range(n):
        if i > 0:
            E[i], a, ad = moment_step_up(gap(r[i], r[i - 1]), inv_alpha, a, ad)
        if marks[i] == 1.0 or marks[i] == 3.0:
            A[i] = a
            Ad[i] = ad
    b = 1.0
    bd = 0.0
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            b, bd = moment_step_down(r, i, E[i + 1], inv_alpha, b, bd)
        if marks[i] >= 2.0:
            B[i] = b
            Bd[i] = bd
    return E, A, B, Ad, Bd, marks


@helper
def few_pullback(r, alpha, tables, anchor, offset, u, rbar, wbar, want_wbar):
    """:func:`~softorder.core.lapsum.inverse_pullback` of a few targets into a fresh
    ``rbar``, which also takes the downward injections, with the upward ones kept as a list
    (at most one per target) instead of a row of n: the same operations in the same order,
    so the same values to the bit. The last pass leaves the gradient (sorted order) in ``E``
    (``tables[0]``; each ``E[i]`` is read just before its slot is written) and ``rbar`` is
    spent. Returns ``(alpha_bar, done)``: ``done`` false, nothing usable written, where a
    target meets a tie or a rounding before :data:`TIE_SEARCH` is linked.

    Each target's weights come from :func:`~softorder.core.lapsum.other_target_weights`,
    called (the usual target's weights to the bit, as
    :func:`~softorder.core.lapsum.target_weights` gives them): with a few targets per row the
    call costs nothing that counts, where ``target_weights`` inlined was a tenth of this
    helper's compilation on a first call.
    """
    E, A, B, Ad, Bd, S = tables
    n = r.shape[0]
    m = anchor.shape[0]
    inv_alpha = 1.0 / alpha
    # the point of each target's upward injection (n: none), and after the last one n: the
    # carrying passes stop at it without testing the list's end
    up_at = empty((m + 1,), np.int64)
    up = empty((m,), np.float64)
    up_at[m] = n
    for i in range(n):  # (a loop: numba's slice assignment compiled longer on a first call)
        rbar[i] = 0.0
    alpha_bar = 0.0
    for j in range(m):
        up_at[j] = n
        up[j] = 0.0
        an = anchor[j]
        t = offset[j]
        uj = u[j]
        if want_wbar:
            wbar[j] = 0.0
        ra = r[an]
        position = ra if t == 0.0 or abs(ra) == INF else ra + alpha * t  # target_position
        if uj == 0.0 or abs(position) == INF:
            continue
        L = an - 1 if t <= 0.0 else an
        R = L + 1
        how, G, Z, el, er, sh = other_target_weights(
            r,
            inv_alpha,
            ra,
            t,
            L,
            R,
            A[L] if L >= 0 else 0.0,
            Ad[L] if L >= 0 else 0.0,
            B[R] if R < n else 0.0,
            Bd[R] if R < n else 0.0,
        )
        if how == 0:
            continue
        cj = uj / G
        if how == 1:
            if R < n:
                up_at[j] = R
                up[j] = cj * er
            if L >= 0:
                rbar[L] += cj * el
        else:  # ties or rounding: inject_exact's two points (compiled when first needed)
            linked, i = _call_tie_search(r, inv_alpha, ra, t, R)
            if not linked:
                return alpha_bar, False
            if i < n:
                up_at[j] = i
                up[j] = cj * exp_nonpositive(sh + offset_z(ra, r[i], inv_alpha, t))
            if i > 0:
                rbar[i - 1] += cj * exp_nonpositive(sh - offset_z(ra, r[i - 1], inv_alpha, t))
        if want_wbar:
            wbar[j] = uj * 2.0 * alpha * math.exp(sh) / G
        alpha_bar += uj * Z / G
    # carry_injections: the downward pass in rbar, then the upward one with the list sorted
    # by point (stably, in place: the injections at one point add up in the order of the
    # targets)
    for j in range(1, m):
        at = up_at[j]
        value = up[j]
        k = j
        while True:  # (a loop's condition is compiled twice, a test in the loop once)
            if k == 0 or up_at[k - 1] <= at:
                break
            up_at[k] = up_at[k - 1]
            up[k] = up[k - 1]
            k -= 1
        up_at[k] = at
        up[k] = value
    if n <= CARRY_BESIDE_N:
        # the spent B (written at a few points, never read again) holds the lower half's
        # upward sums
        _carry_beside(E, rbar, up_at, up, B)
        return alpha_bar, True
    acc = 0.0
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            acc *= E[i + 1]
        acc += rbar[i]
        rbar[i] = acc
    acc = 0.0
    p = 0
    for i in range(n):
        if i > 0:
            acc *= E[i]
        injected = 0.0  # (a row of injections holds 0 at the other points: the same sums)
        while True:
            if up_at[p] != i:
                break
            injected += up[p]
            p += 1
        acc += injected
        E[i] = rbar[i] + acc
    return alpha_bar, True


#: :func:`few_inverse_vjp`'s helpers, called by symbol: compiled once, not linked into the
#: kernel and optimized again there (a first call of soft_quantile's VJP)
_FEW_CALLS = SymbolCalls(
    # r, inv_alpha, anchor, offset, E, marks
    tables=(few_tables, (_F1, _F, _L1, _F1, _F1, _F1)),
    # r, alpha, tables, anchor, offset, u, rbar, wbar, want_wbar
    pullback=(few_pullback, (_F1, _F, types.UniTuple(_F1, 6), _L1, _F1, _F1, _F1, _F1, _B)),
)
_call_few_tables = _FEW_CALLS.tables
_call_few_pullback = _FEW_CALLS.pullback


@inner_helper
def _carry_beside(E, rbar, up_at, up, S):
    """:func:`few_pullback`'s two passes (the downward one in ``rbar``, then the upward one
    into ``E``) in one loop, the upward pass at ``k`` beside the downward one at ``n - 1 - k``,
    so that the latency of each accumulator's chain hides the other's: the same operations on
    the same values, so the same sums to the bit. The upward sums of the lower half wait in
    ``S`` (length >= n / 2, rows written at every point: :data:`CARRY_BESIDE_N`) until the
    downward pass has reached them; each ``E[i]`` is overwritten only after both passes read
    it. ``up_at``, ``up``: the upward injections sorted by point, ``up_at`` ending with n.
    """
    n = E.shape[0]
    h = (n + 1) // 2
    down = 0.0
    acc = 0.0
    p = 0
    # one loop (one copy of each pass to compile): the downward pass at i = n - 1 - k, the
    # upward at k, its sums into S below h and, above, into E with the lower half's as the
    # downward pass passes them
    for k in range(n):
        i = n - 1 - k
        if k > 0:
            down *= E[i + 1]
        down += rbar[i]
        rbar[i] = down
        if i + 1 < h:  # E[i + 1] read by both passes (only once k >= h)
            E[i + 1] = rbar[i + 1] + S[i + 1]
        if k > 0:
            acc *= E[k]
        injected = 0.0
        while True:
            if up_at[p] != k:
                break
            injected += up[p]
            p += 1
        acc += injected
        if k < h:
            S[k] = acc
        else:
            E[k] = rbar[k] + acc
    E[0] = rbar[0] + S[0]


# --- soft sort's CPU passes: the VJP counts the anchors again, and reads the offsets the
# forward pass kept or, for long rows, solves them again (issue 13: memory)

#: rows of scratch of :func:`ladder_forward` (E, A, B) and of :func:`ladder_vjp` (E, B, Bd;
#: the injections go into the rows of B and Bd behind the ascending targets)
LADDER_WORK = 3
#: rows at least this long keep no offsets from soft sort's forward pass: :func:`ladder_vjp`
#: solves them again (8 bytes per element less between the passes, for more time in the VJP,
#: which shorter rows, whose time is nearer its target, do not pay: CHANGELOG.md)
SOLVE_AGAIN_N = 1 << 16
#: injections kept aside while their points' ``B``, ``Bd`` may still be read
#: (:func:`_ladder_pullback`): a power of 2, moved into the rows BATCH at a time
WINDOW = 16
BATCH = 8
#: the targets of :func:`_ladder_pullback` whose usual weights are computed at once, in a loop
#: LLVM vectorizes (:func:`_usual_weights`), and the rows of their scratch: each target's
#: offset, ``r`` at its anchor, ``L`` and ``R``, ``B`` and ``Bd`` at ``R``; then its factor
#: ``el`` (or a code below 0), ``er``, ``zl`` and the terms of ``G`` and ``Z`` at ``R``
TBLOCK = 64
_BLOCK_ROWS = 11
#: the codes in the row of ``el``: a target skipped (its value is infinite), one whose
#: weights come from :func:`~softorder.core.lapsum.other_target_weights`
_SKIP = -2.0
_OTHER = -1.0


@inner_helper
def _count(counts, i, b, a, w0):
    """Count point ``i`` (``B[i]`` is ``b``, ``A[i]`` is ``a``) for
    :func:`~softorder.core.lapsum.solve_ladder`: ``counts[q]`` is the number of points whose
    first target ``w0 + q`` at or above their ``S`` is ``q``.
    """
    first = math.ceil(i + 0.5 + 0.5 * (b - a) - w0)
    if first < counts.shape[0]:
        counts[np.uint64(first if first > 0 else 0)] += 1  # (unsigned: no wraparound)


@helper
def prefix_counts(r, inv_alpha, E, A, B, w0, counts):
    """:func:`~softorder.core.lapsum.prefix_tables_halves` (the same ``E``, ``A``, ``B`` to the
    bit) and the counts of the ladder's targets (:func:`_count`) in one pass: each point is
    counted in the second half, where one of its two sums comes from the recurrence running
    there and the other from the row the first half wrote (the middle point of an odd row
    after the first half). ``E`` holds the decays already (the caller's pass of
    :func:`~softorder.core.rank.decays`: libm's values, the inlined ``exp`` vectorized; one
    ``exp`` at a time beside the recurrences bound their loop). ``r`` float32 or float64
    (each value widened exactly).

    ``A`` is a tuple: ``(A,)``, the row that takes the table ``A``, or ``()`` (soft sort's
    forward on long float32 rows, :func:`_narrow_values`): then ``A``'s lower half waits in
    the slots of ``B`` until ``B``'s recurrence reaches them (:func:`descending_counts`'
    order), the same ``B`` and counts to the bit, no ``A`` kept. Numba knows a tuple's
    length when it compiles (``len(A)`` a constant), so each specialization compiles only its
    own path; a test of ``A is None`` is pruned only where ``A`` is None, and the other
    path's statements, typed for a row ``A``, lengthened soft sort's first call.
    """
    n = r.shape[0]
    counts[:] = 0
    if n == 0:
        return
    h = (n + 1) // 2
    if len(A) == 0:
        B[0] = 1.0  # A[0]
    else:
        A[0][0] = 1.0
    B[n - 1] = 1.0
    a = 1.0
    b = 1.0
    j = n - 2
    for i in range(1, h):
        a = 1.0 + E[i] * a
        if len(A) == 0:
            B[i] = a  # A[i] (at the middle of an odd row, overwritten by B just below)
        else:
            A[0][i] = a
        ju = np.uint64(j)  # (unsigned: no wraparound)
        b = 1.0 + E[ju + np.uint64(1)] * b
        B[ju] = b
        j -= 1
    if n % 2 == 1:  # the middle point, both of whose sums the first half computed
        _count(counts, h - 1, b, a, w0)
    for i in range(h, n):
        a = 1.0 + E[i] * a
        if len(A) != 0:
            A[0][i] = a
        _count(counts, i, B[i], a, w0)
        ju = np.uint64(j)
        if len(A) == 0:
            a_j = B[ju]  # (read before B's recurrence overwrites it)
        b = 1.0 + E[ju + np.uint64(1)] * b
        B[ju] = b
        if len(A) != 0:
            a_j = A[0][ju]
        _count(counts, j, b, a_j, w0)
        j -= 1


@helper
def descending_counts(r, inv_alpha, E, B, Bd, w0, counts):
    """:func:`descending_tables` and the counts of :func:`prefix_counts` (``A`` by its
    recurrence) in one pass, in the order of :func:`prefix_counts`: ``A``'s recurrence up the
    lower half beside ``B``'s and ``Bd``'s down the upper half, then the other way round, each
    point counted where its second sum is computed. The same operations on the same values as
    ``descending_tables`` and the ladder's counts, so the same ``E``, ``B``, ``Bd`` and counts
    to the bit; ``A`` of the lower half waits in the slots of ``Bd`` until ``Bd``'s
    recurrence reaches them. ``E`` holds the decays already, as for :func:`prefix_counts`.
    ``r`` float32 or float64 (each value widened exactly).
    """
    n = r.shape[0]
    counts[:] = 0
    if n == 0:
        return
    h = (n + 1) // 2
    Bd[0] = 1.0  # A[0]
    B[n - 1] = 1.0
    Bd[n - 1] = 0.0
    a = 1.0
    b = 1.0
    bd = 0.0
    j = n - 2
    for i in range(1, h):
        a = 1.0 + E[i] * a
        Bd[i] = a  # A[i] (at the middle of an odd row, overwritten by Bd just below)
        ju = np.uint64(j)  # (unsigned: no wraparound)
        d = gap(np.float64(r[ju + np.uint64(1)]), np.float64(r[ju]))
        f = E[ju + np.uint64(1)]
        bd = f * (bd + d * inv_alpha * b) if f > 0.0 else 0.0
        b = 1.0 + f * b
        B[ju] = b
        Bd[ju] = bd
        j -= 1
    if n % 2 == 1:  # the middle point, both of whose sums the first half computed
        _count(counts, h - 1, b, a, w0)
    for i in range(h, n):
        a = 1.0 + E[i] * a
        _count(counts, i, B[i], a, w0)
        ju = np.uint64(j)  # (unsigned: no wraparound)
        d = gap(np.float64(r[ju + np.uint64(1)]), np.float64(r[ju]))
        f = E[ju + np.uint64(1)]
        a_j = Bd[ju]
        bd = f * (bd + d * inv_alpha * b) if f > 0.0 else 0.0
        b = 1.0 + f * b
        B[ju] = b
        Bd[ju] = bd
        _count(counts, j, b, a_j, w0)
        j -= 1


@inner_helper
def ladder_anchor(n, w, J):
    """The anchor :func:`~softorder.core.lapsum.solve_ladder` gives the target ``w`` in
    interval ``J`` (``J - w`` decides it: its inverse anchors at ``J`` for ``w >= J``), by
    selects: a branch on the target's side of its interval was mispredicted often.
    """
    an = J - np.int64(w - J < 0.0)
    an = an if J > 0 else 0
    return an if J < n else n - 1


@inner_helper
def _ladder_ratio(J, n, w, a, b, e, d):
    """:func:`~softorder.core.lapsum.solve_ladder`'s operations for the target ``w`` in
    interval ``J`` of a row of ``n``, from scalars (an inlined helper taking the tables
    would pay their reference counting at every target): ``a = A[J - 1]`` (for ``J > 0``),
    ``b = B[J]`` (for ``J < n``), ``e = E[J]`` and ``d = gap(r[J], r[J - 1]) / alpha``
    (read only for ``e < SMALL_E``). Returns ``(code, t)``: a ratio ``t`` and its anchor as
    the code, whose log :data:`~softorder.core.fast_log.take_logs` takes, or a final offset
    ``t`` with the code ``-1 - anchor``. :func:`_ladder_values` and :func:`_ladder_pullback`
    both solve with it, so the same offsets to the bit.
    """
    if J == 0:
        return -1, math.log(2.0 * w / b)
    if J == n:
        return -n, -math.log(2.0 * (n - w) / a)
    if e < SMALL_E:
        an, t = invert_far(a, b, d, w - J, J)
        return -1 - an, t
    c = w - J
    d = math.sqrt(c * c + a * b * e)
    up = c >= 0.0
    num = c + d if up else a
    den = b if up else d - c
    an = J if up else J - 1
    t = num / den
    if not (t >= fast_log.TINY and t < INF):  # (never: A, B >= 1, E >= SMALL_E)
        return -1 - an, math.log(t)
    return an, t


@inner_helper
def _solve_block(r, inv_alpha, E, B, counts, q0, kn, w0, J, PA, pa, ring, codes, ratios):
    """Solve the targets ``w0 + q`` for ``q`` from ``q0`` to ``q0 + kn - 1`` from their
    counts, as :func:`_ladder_values` does (:func:`_ladder_ratio`, then the logs,
    :data:`~softorder.core.fast_log.take_logs`), into ``codes`` and ``ratios``
    (:data:`TBLOCK`): ``A`` at ``J - 1`` by its recurrence, :data:`BATCH` points at a time,
    kept for :data:`WINDOW` points in ``ring``, ``E`` and ``B`` read at ``J``. ``J`` is the
    interval so far, ``A`` known at the points up to ``PA - 1`` (``pa = A[PA - 1]``).
    Returns the new ``(J, PA, pa)``. :func:`_narrow_values`, :func:`_ladder_pullback`
    (without kept offsets) and :func:`_lean_pullback` all solve with it: the same anchors
    and offsets to the bit.
    """
    n = r.shape[0]
    mask = WINDOW - 1
    for k in range(kn):
        q = q0 + k
        J += np.int64(counts[np.uint64(q)])  # (a narrow count widened)
        while PA < J:  # A up to J - 1, BATCH points at a time (_moments_up_to's A)
            for i in range(PA, PA + BATCH):
                if i < n:
                    pa = 1.0 + E[np.uint64(i)] * pa if i > 0 else 1.0
                    ring[i & mask] = pa
            PA += BATCH
        # (indices that are never negative as unsigned: no wraparound to compile)
        uJ = np.uint64(J if J < n else n - 1)
        eJ = E[uJ] if J > 0 else 0.0
        far = (eJ < SMALL_E) & (J > 0) & (J < n)
        dJ = gap(np.float64(r[uJ]), np.float64(r[uJ - np.uint64(1)])) if far else 0.0
        aJ = ring[(J - 1) & mask] if J > 0 else 1.0
        codes[k], ratios[k] = _ladder_ratio(J, n, w0 + q, aJ, B[uJ], eJ, dJ * inv_alpha)
    fast_log.take_logs(codes[:kn], ratios[:kn])
    return J, PA, pa


@helper
def _ladder_values(r, alpha, inv_alpha, E, A, B, w0, counts, offset, ratios, out, values):
    """The targets ``w0 + q`` of one row from their counts (:func:`prefix_counts`): each
    one's anchor and offset (:func:`_ladder_ratio`, the logs in a pass of their own,
    :data:`~softorder.core.fast_log.take_logs`), then, with ``values``, its value
    :func:`~softorder.core.lapsum.target_position` into ``out[q]`` (rounded once for a
    float32 ``out``), else its anchor into ``counts[q]``. ``counts`` may be ``out`` itself
    seen as integers: each slot is read before it is written.

    The offsets go into ``offset`` (``sort_forward``'s, and what :func:`ladder_vjp` reads);
    where it is None (long rows: the VJP solves them again), the targets come
    :data:`TBLOCK` at a time, their offsets in ``ratios`` (:data:`TBLOCK`) and their anchors
    on the stack (a pass over the whole row, as with ``offset``, measured faster where it
    can). Exactly one of ``offset`` and ``ratios`` is None: numba prunes the path of the
    other by its type, so that each specialization compiles only its own.
    """
    n = r.shape[0]
    m = out.shape[0]
    J = 0
    if offset is not None:
        for q in range(m):
            J += counts[q]
            # (indices that are never negative as unsigned: no wraparound to compile)
            uJ = np.uint64(J if J < n else n - 1)
            e = E[uJ] if J > 0 else 0.0
            far = (e < SMALL_E) & (J > 0) & (J < n)
            d = gap(np.float64(r[uJ]), np.float64(r[uJ - np.uint64(1)])) if far else 0.0
            a = A[np.uint64(J - 1)] if J > 0 else 1.0
            counts[q], offset[q] = _ladder_ratio(J, n, w0 + q, a, B[uJ], e, d * inv_alpha)
        fast_log.take_logs(counts, offset)
        if values:
            for q in range(m):
                out[q] = target_position(r, alpha, counts[q], offset[q])
    if ratios is not None:
        codes = stack_rows(1, TBLOCK, np.int64)[0]
        for q0 in range(0, m, TBLOCK):
            kn = TBLOCK if m - q0 >= TBLOCK else m - q0
            for k in range(kn):
                q = q0 + k
                J += counts[q]
                uJ = np.uint64(J if J < n else n - 1)
                e = E[uJ] if J > 0 else 0.0
                far = (e < SMALL_E) & (J > 0) & (J < n)
                d = gap(np.float64(r[uJ]), np.float64(r[uJ - np.uint64(1)])) if far else 0.0
                a = A[np.uint64(J - 1)] if J > 0 else 1.0
                codes[k], ratios[k] = _ladder_ratio(J, n, w0 + q, a, B[uJ], e, d * inv_alpha)
            fast_log.take_logs(codes[:kn], ratios[:kn])
            for k in range(kn):
                q = q0 + k
                if values:
                    out[q] = target_position(r, alpha, codes[k], ratios[k])
                else:
                    counts[q] = codes[k]


@kernel
def ladder_forward(xs, alpha, out, counts, offset, ratios, wide, work, values):
    """Soft sort (:func:`~softorder.core.lapsum.sort_forward`'s values and offsets, the same
    to the bit) without anchors: ``out`` (rows, n) float32 or float64, ``counts`` the same
    memory seen as integers of its width (int32 or int64: each row's counts, then its
    anchors wait in its slots, :func:`_ladder_values`), ``offset`` (rows, n) for the
    offsets and ``ratios`` None, or for none (soft sort's forward on long rows:
    :func:`ladder_vjp` or :func:`lean_vjp` solves them again) ``offset`` None and
    ``ratios`` (rows, :data:`TBLOCK`), through which they pass; ``work`` (rows,
    :data:`LADDER_WORK`, n): ``E``, ``A``, ``B``, or with ``ratios`` (rows,
    :data:`LEAN_FORWARD_WORK` * n): ``E`` and ``B`` only, side by side (:func:`prefix_counts`
    without ``A``, :func:`_narrow_values`: soft sort's forward on rows of :data:`LEAN_N` or
    more). ``work.ndim`` is a constant when numba compiles, so each specialization compiles
    one of the two paths only (a long float64 row's first call compiled the two-row path
    too, a long float32 row's the other). The VJP counts the anchors again. Without
    ``values`` the anchors stay in ``counts`` (``sort_forward``'s, for what reads them).

    ``xs`` may be float32 (a float32 input's sorted values: each one widens exactly, so the
    results are a float64 row's): ``wide`` is then ``work`` seen as (rows, ``width * n``),
    whose last ``n`` slots of a row (a row the counting pass writes after the decays) take
    the widened row for the decays; for float64 ``xs`` it is ``xs`` itself.
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            if values:
                out[row, :] = np.nan
            else:
                counts[row, :] = 0  # (sort_forward's anchors of a NaN row)
            if offset is not None:
                offset[row, :] = np.nan
            continue
        rw = wide[row, wide.shape[1] - n :]
        if xs.itemsize == 4:
            for i in range(n):
                rw[i] = r[i]
        a = alpha[row]
        c = counts[row, :n]
        if work.ndim == 2:  # (a constant: this path or the other, pruned by the type)
            E = work[row, :n]
            B = work[row, n : 2 * n]
            _call_row_decays(rw, 1.0 / a, E)
            prefix_counts(rw, 1.0 / a, E, (), B, 0.5, c)
            _narrow_values(r, a, 1.0 / a, E, B, 0.5, c, ratios[row], out[row], values)
            continue
        E = work[row, 0]
        A = work[row, 1]
        B = work[row, 2]
        _call_row_decays(rw, 1.0 / a, E)
        prefix_counts(rw, 1.0 / a, E, (A,), B, 0.5, c)
        # (one call or the other, pruned by the types: None or an array)
        if offset is not None:
            _ladder_values(r, a, 1.0 / a, E, A, B, 0.5, c, offset[row], None, out[row], values)
        if ratios is not None:
            _ladder_values(r, a, 1.0 / a, E, A, B, 0.5, c, None, ratios[row], out[row], values)


@kernel
def _ladder_vjp(xs, order, alpha, offset, ring, u, x_bar, counts, alpha_bar, work, redo, redo_only):
    """:func:`ladder_vjp`'s kernel (``redo_only``: :func:`_then_linked`)."""
    rows, n = xs.shape
    handed = 0
    for row in prange(rows):
        if redo_only and redo[row] == 0:
            continue
        redo[row] = 0
        r = xs[row]
        if has_nan(r):
            x_bar[row, :] = np.nan
            alpha_bar[row] = np.nan
            continue
        w = work[row]
        a = alpha[row]
        inv_alpha = 1.0 / a
        E = w[0, :n]
        B = w[1, :n]
        Bd = w[2, :n]
        c = counts[row, :n]
        _row_decays(r, inv_alpha, E)
        descending_counts(r, inv_alpha, E, B, Bd, 0.5, c)
        # (one call or the other, pruned by the types: None or an array)
        if offset is not None:
            ab, done = _ladder_pullback(
                r, a, inv_alpha, E, B, Bd, c, offset[row], None, u[row], 0.5
            )
        if ring is not None:
            ab, done = _ladder_pullback(r, a, inv_alpha, E, B, Bd, c, None, ring[row], u[row], 0.5)
        if not done:
            redo[row] = 1
            handed += 1
            continue
        alpha_bar[row] = ab
        _call_carry_both_ways(E, B, Bd)
        o = order[row]
        xb = x_bar[row]
        for i in range(n):  # the gradient: the two sums (scatter_finite of their totals)
            xb[np.uint64(o[i])] = Bd[i] + B[i] if abs(r[i]) != INF else 0.0
    return handed


@_then_linked("OTHER_TARGET", _ladder_vjp)
def ladder_vjp(xs, order, alpha, offset, ring, u, x_bar, counts, alpha_bar, work, redo):
    """Soft sort's VJP (:func:`sort_vjp`'s values, the same to the bit) with the anchors of
    :func:`ladder_forward` counted again (:func:`descending_counts`), and its offsets read
    from ``offset`` (rows, n), or, where it is None, solved again (:func:`_ladder_pullback`)
    with ``ring`` (rows, :data:`WINDOW`): exactly one of the two is None (each path a
    specialization of its own: numba prunes the other by the types). ``u`` (rows, n) float32
    or float64, ``x_bar`` (rows, n) of the same dtype, never ``u``; ``counts``: ``x_bar``'s
    memory seen as integers of its width (the counts wait there until the gradient is
    scattered into it); ``work`` (rows, :data:`LADDER_WORK`, n): ``E``, ``B``, ``Bd``
    (:func:`descending_counts`), then the injections in the rows of ``B`` and ``Bd``
    (:func:`_ladder_pullback`), then their carried sums
    (:func:`~softorder.core.kernel_sums.carry_both_ways`), whose totals are scattered into
    ``x_bar``. A row whose ties throw an injection beyond the window gets ``redo[row] = 1``
    and an unwritten ``x_bar`` row: the caller runs :func:`sort_vjp` on it (a kernel
    compiled only when a row needs it).

    ``xs`` may be float32 (:func:`ladder_forward`): :func:`descending_counts` widens each
    value as it reads it. Rows with rare targets call :func:`_other_target`, compiled when a
    row first needs it (:func:`_then_linked`).
    """


@inner_helper
def _pullback_windows():
    """The windows of :func:`_ladder_pullback` and :func:`_lean_pullback` (:data:`WINDOW`
    points each): the upward and downward injections (zero), and ``A`` and ``Ad``
    (:func:`_moments_up_to`).
    """
    win_up = empty((WINDOW,), np.float64)
    win_down = empty((WINDOW,), np.float64)
    for i in range(WINDOW):
        win_up[i] = 0.0
        win_down[i] = 0.0
    a_win = empty((WINDOW,), np.float64)
    ad_win = empty((WINDOW,), np.float64)
    return win_up, win_down, a_win, ad_win


@helper
def _ladder_pullback(r, alpha, inv_alpha, E, B, Bd, counts, offset, ring, u, w0):
    """:func:`_sort_pullback` of the targets ``w0 + q`` solved from their counts, with the
    injections in the rows of ``B`` (upward) and ``Bd`` (downward) instead of rows of their
    own, and ``A``, ``Ad`` computed :data:`BATCH` points at a time and kept for
    :data:`WINDOW` points. Returns ``(alpha_bar, done)``.

    The interval ``J`` of the targets never decreases, and a target's points are
    ``L >= J - 2`` and ``R = L + 1``; so with ``M`` the largest ``L`` so far, ``B`` and ``Bd``
    are read no more at the points up to ``M - 2``: those slots take their points'
    injections, moved there from a window of :data:`WINDOW` points. Every injection is added
    in the targets' order, as in :func:`_sort_pullback`, so the sums are the same to the bit.
    At the end every slot not yet moved takes its window entry, or 0 beyond the window
    (targets skipped for a zero cotangent leave table values there otherwise). A tie that
    sends an injection beyond the window stops the loop with ``done`` false (``B``, ``Bd``
    then hold neither tables nor injections).

    The targets come :data:`TBLOCK` at a time, in three passes: the first takes each one's
    offset from ``offset`` (its anchor :func:`ladder_anchor`), or, where ``offset`` is
    None, solves it as :func:`_ladder_values` does (:func:`_ladder_ratio`: from ``A`` at
    ``J - 1``, by its recurrence, kept in the window row ``ring``, and ``E`` and ``B`` at
    ``J``, which no injection has reached: the same anchors and offsets to the bit), then
    reads what each needs at its points into the block's rows; the second computes the usual
    target's weights from those rows alone (:func:`_usual_weights`: no reads beside them, so LLVM
    vectorizes it), with the terms of ``G`` and ``Z`` at ``R`` (``B[R]`` and ``Bd[R]`` are
    read ahead before the injections of the block's earlier targets overwrite a slot, but
    those go to the points below ``F <= M - 1 <= R``); the third adds the injections in the
    targets' order, ``A`` and ``Ad`` from their recurrence (a target beyond a row's end, the
    most of them for an alpha far above the row's spread, has one point to inject at). The
    other targets (ties, rounding, a factor outside ``exp_main``'s range) take
    :func:`_other_target` through :data:`OTHER_TARGET` (the rare path, compiled when a row
    first needs it), or, while it is not linked, stop the loop with ``done`` false.
    """
    n = r.shape[0]
    win_up, win_down, a_win, ad_win = _pullback_windows()
    # the block's rows (TBLOCK), on the stack
    b_t, b_ra, b_rl, b_rr, b_br, b_bdr, b_el, b_er, b_zl, b_gr, b_zr = stack_rows(
        _BLOCK_ROWS, TBLOCK, np.float64
    )
    left = stack_rows(1, TBLOCK, np.int64)[0]
    mask = WINDOW - 1
    M = 1  # the largest L so far (at least 1)
    F = 0  # the points below F hold their injections; the window those from F on
    P = 0  # A, Ad are known at the points up to P - 1, kept from P - WINDOW on
    a = 1.0
    ad = 0.0
    lo = np.float64(r[0])  # r[P - 1] once P > 0
    alpha_bar = 0.0
    codes = stack_rows(1, TBLOCK, np.int64)[0]
    ratios = stack_rows(1, TBLOCK, np.float64)[0]
    PA = 0  # A is known at the points up to PA - 1 (ring: from PA - WINDOW on)
    pa = 1.0
    J = 0
    for q0 in range(0, n, TBLOCK):
        kn = TBLOCK if n - q0 >= TBLOCK else n - q0
        if offset is not None:  # (this path or the other, pruned by the types)
            for k in range(kn):  # each target's points and the values there
                q = q0 + k
                # (indices that are never negative as unsigned: no wraparound to compile)
                uq = np.uint64(q)
                J += counts[uq]
                an = ladder_anchor(n, w0 + q, J)
                t = offset[uq]
                _target_points(r, B, Bd, an, t, k, left, b_t, b_ra, b_rl, b_rr, b_br, b_bdr)
        if ring is not None:  # each target solved (_ladder_values' operations)
            J, PA, pa = _solve_block(
                r, inv_alpha, E, B, counts, q0, kn, w0, J, PA, pa, ring, codes, ratios
            )
            for k in range(kn):  # each target's points and the values there
                an, t = codes[k], ratios[k]
                _target_points(r, B, Bd, an, t, k, left, b_t, b_ra, b_rl, b_rr, b_br, b_bdr)
        _usual_weights(
            alpha, inv_alpha, b_t, b_ra, b_rl, b_rr, b_br, b_bdr, b_el, b_er, b_zl, b_gr, b_zr
        )
        for k in range(kn):  # the injections, in the targets' order
            uj = np.float64(u[np.uint64(q0 + k)])
            el = b_el[k]
            if uj == 0.0 or el == _SKIP:
                continue
            L = left[k]
            R = L + 1
            if L < M - 2:  # (never, for counts of a ladder)
                return alpha_bar, False
            M = L if L > M else M
            F = _move_to_rows(F, M, B, Bd, win_up, win_down)
            P, a, ad, lo = _moments_up_to(L, P, r, E, inv_alpha, a, ad, lo, a_win, ad_win)
            aL = a_win[L & mask] if L >= 0 else 0.0
            adL = ad_win[L & mask] if L >= 0 else 0.0
            if el >= 0.0:  # the usual target: target_weights' G and Z
                G = aL * el + b_gr[k]
                Z = (b_zl[k] * aL + adL) * el + b_zr[k]
                cj = uj / G
                # (a target beyond a row's end has one point)
                if R < n:
                    win_up[R & mask] += cj * b_er[k]
                if L >= 0:
                    if L < F:
                        Bd[np.uint64(L)] += cj * el
                    else:
                        win_down[L & mask] += cj * el
                alpha_bar += uj * Z / G
                continue
            ra, t, bR, bdR = b_ra[k], b_t[k], b_br[k], b_bdr[k]
            linked, found = _call_other_target(
                r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR, uj, F, B, Bd, win_up, win_down, False
            )
            code, term = found
            if not linked or code == _BEYOND:
                return alpha_bar, False
            if code == _ADDED:
                alpha_bar += term
    for i in range(F, n):
        inside = i < F + WINDOW
        B[np.uint64(i)] = win_up[i & mask] if inside else 0.0
        Bd[np.uint64(i)] = win_down[i & mask] if inside else 0.0
    return alpha_bar, True


@inner_helper
def _move_to_rows(F, M, B, Bd, win_up, win_down):
    """A ladder pullback's window moved into the rows :data:`BATCH` points at a time: ``B``,
    ``Bd`` at the points up to ``M - 2`` are read no more, so their injections go there.
    Returns the new ``F`` (the points below it hold their injections).
    """
    mask = WINDOW - 1
    while F + BATCH <= M - 1:
        for i in range(F, F + BATCH):
            B[np.uint64(i)] = win_up[i & mask]  # (unsigned: no wraparound)
            Bd[np.uint64(i)] = win_down[i & mask]
            win_up[i & mask] = 0.0
            win_down[i & mask] = 0.0
        F += BATCH
    return F


@inner_helper
def _moments_up_to(L, P, r, E, inv_alpha, a, ad, lo, a_win, ad_win):
    """``A`` and ``Ad`` of a ladder pullback by their recurrences
    (:func:`~softorder.core.lapsum.moment_step_up`) up to point ``L``, :data:`BATCH` points at
    a time (a loop over the points passed, a random count per target, was mispredicted about
    once per target), kept in the window rows ``a_win``, ``ad_win``. ``P``: the first point
    not computed yet; ``a``, ``ad``, ``lo``: ``A``, ``Ad`` and ``r`` at ``P - 1`` (``r`` may be
    float32: each value widened once). Returns them updated.
    """
    n = r.shape[0]
    mask = WINDOW - 1
    while P <= L:
        for i in range(P, P + BATCH):
            if i < n:
                hi = np.float64(r[np.uint64(i)])
                e = E[np.uint64(i)] if i > 0 else 0.0
                d = gap(hi, lo) if i > 0 else 0.0
                ad = e * (ad + d * inv_alpha * a) if e > 0.0 else 0.0
                a = 1.0 + e * a if i > 0 else 1.0
                a_win[i & mask] = a
                ad_win[i & mask] = ad
                lo = hi
        P += BATCH
    return P, a, ad, lo


@inner_helper
def _target_points(r, B, Bd, an, t, k, left, b_t, b_ra, b_rl, b_rr, b_br, b_bdr):
    """The first pass of a ladder pullback (:func:`_ladder_pullback`, the permutation loss's)
    for the target anchored at ``an`` with offset ``t``, slot ``k`` of its block: its left
    point ``L`` into ``left``, and the values :func:`_usual_weights` reads into the block's
    rows; beyond a row's end, ``r[L]`` is ``-inf`` or ``r[R]`` ``+inf`` (the distances
    :func:`~softorder.core.lapsum.other_target_weights` takes there), ``B[R]`` and ``Bd[R]``
    zero.
    """
    n = r.shape[0]
    L = an - 1 if t <= 0.0 else an
    # (indices that are never negative as unsigned: no wraparound to compile)
    R = np.uint64(L + 1 if L + 1 < n else an)
    left[k] = L
    b_t[k] = t
    b_ra[k] = r[np.uint64(an)]
    # beyond a row's end, a point at -inf or +inf: its distance is other_target_weights' there
    b_rl[k] = r[np.uint64(L)] if L >= 0 else -INF
    b_rr[k] = r[R] if L + 1 < n else INF
    b_br[k] = B[R] if L + 1 < n else 0.0
    b_bdr[k] = Bd[R] if L + 1 < n else 0.0


@inner_helper
def _usual_weights(
    alpha, inv_alpha, b_t, b_ra, b_rl, b_rr, b_br, b_bdr, b_el, b_er, b_zl, b_gr, b_zr
):
    """The second pass of :func:`_ladder_pullback` over its block of targets: the usual
    target's weights from the block's rows (:data:`TBLOCK`) alone, with the operations of
    :func:`~softorder.core.lapsum.target_weights`, so its values to the bit (the caller
    composes ``G`` and ``Z`` from them as ``target_weights`` does); each target's code in the
    row of ``el``. A loop LLVM vectorizes (no other array to check for overlap, no remainder:
    a short last block's extra slots hold values never used), ``exp`` included
    (:func:`~softorder.core.fast_exp.exp_main`). The permutation loss's pullback uses it too.

    The usual target's distances are ``(ra - r_i) / alpha + t``, without
    :func:`~softorder.core.laplace.offset_z`'s branches, for targets with a finite ``ra`` and
    ``t`` (the pullbacks skip the others: their value is infinite; a NaN-free row's forward
    gives no NaN offset) anchored at ``L`` or ``R``: ``ra - r_i`` is offset_z's gap to the
    bit (``-(r_i - ra)`` rounds to ``ra - r_i``) but for ``-0`` at a point equal to ``ra``,
    where ``z`` is then a zero of the other sign or ``t``; offset_z mends only a NaN ``z``,
    which finite ``ra`` and ``t`` meet only as an infinite ``1 / alpha`` times a zero gap,
    NaN in both, and a NaN fails both tests. So the same targets are usual, with the same
    outputs: a zero ``zl`` is not usual, and a zero ``zr`` of the other sign needs
    ``t = +-0`` with the anchor at ``L``, whose ``zl`` is then a zero
    (``tests/test_sort_vjp.py``).

    A target beyond a row's end (an infinite ``zl`` or ``zr``: :func:`_target_points`) with
    its point on the far side is usual too: ``other_target_weights`` gives it the factors 0
    and 1 at its two sides, as here, and its zero term's finite stand-ins (``zl`` or the
    term at ``R`` 0) add 0 to ``Z`` as its sums leave it.
    """
    for k in range(TBLOCK):
        t = b_t[k]
        ra = b_ra[k]
        zl = (ra - b_rl[k]) * inv_alpha + t
        zr = (ra - b_rr[k]) * inv_alpha + t
        x = -abs(zl + zr)
        # the usual target, whose factor is fast_exp.exp's: exp_main in its range, and 0
        # below UNDERFLOW; the few usual targets between (or at |x| < 2^-54) take
        # other_target_weights, whose operations give the same weights
        usual = (zl > 0.0) & (zl != INF) & (zr <= 0.0) & (zr != -INF)
        # beyond a row's end (or past a point at -inf or +inf): its factors 0 and 1, no exp
        left_end = (zl == INF) & (zr <= 0.0) & (zr != -INF)
        right_end = (zr == -INF) & (zl > 0.0) & (zl != INF)
        if fast_exp.FAST_EXP:
            usual = usual & (fast_exp.in_range(x) | (x < fast_exp.UNDERFLOW))
            e = fast_exp.exp_or_zero(x)
        else:
            e = math.exp(x)
        left_nearer = zl <= -zr
        el = 1.0 if left_nearer else e
        er = e if left_nearer else 1.0
        position = ra if (t == 0.0) | (abs(ra) == INF) else ra + alpha * t  # target_position
        code = el if usual | left_end | right_end else _OTHER
        b_el[k] = _SKIP if abs(position) == INF else code
        bR = b_br[k]
        b_er[k] = er
        b_zl[k] = 0.0 if left_end else zl  # (a term of factor 0: finite, so it adds 0)
        b_gr[k] = bR * er
        b_zr[k] = 0.0 if right_end else (zr * bR - b_bdr[k]) * er


#: what :func:`_other_target` did: nothing to pull back, its injections added (its term of
#: ``alpha_bar`` to add), or a tie beyond the window (the row takes the general path)
_NOTHING = 0
_ADDED = 1
_BEYOND = 2


@helper
def _other_target(
    r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR, u, F, B, D, win_up, win_down, carried
):
    """A target of a ladder pullback other than the usual one (:func:`_ladder_pullback`,
    :func:`_lean_pullback`, the permutation loss's): its weights by
    :func:`~softorder.core.lapsum.other_target_weights` (ties, rounding, a factor outside
    ``exp_main``'s range) from ``bR = B[R]`` and ``bdR = Bd[R]`` (0 beyond the row's end: the
    values the caller's first pass read, :func:`_target_points`), its injections of cotangent
    ``u`` upward into ``B`` and downward into ``D`` below ``F`` or into the window, ties and
    rounding by :func:`_inject_in_window`; the operations the pullbacks had in their loops,
    so the same bits. With ``carried`` (:func:`_lean_pullback`: ``B`` below ``F`` holds
    carried sums), :data:`_BEYOND` also where a tie's upward injection lands below ``F``.
    Returns ``(code, term)``: :data:`_NOTHING`, :data:`_ADDED` with the term of ``alpha_bar``
    (``u * Z / G``) to add, or :data:`_BEYOND`. Called through :data:`OTHER_TARGET`:
    compiled on its own when a row first needs it (the rare path), and one function, not a
    wrapper around another (each compiled function lengthens a first call).
    """
    n = r.shape[0]
    mask = WINDOW - 1
    how, G, Z, el, er, shift = other_target_weights(r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR)
    if how == 0:
        return _NOTHING, 0.0
    c = u / G
    if how == 1:
        if R < n:
            win_up[R & mask] += c * er
        if L >= 0:
            if L < F:
                D[L] += c * el
            else:
                win_down[L & mask] += c * el
        return _ADDED, u * Z / G
    if carried and _first_at_or_above(r, inv_alpha, ra, t, R) < F:
        return _BEYOND, 0.0
    if not _inject_in_window(r, inv_alpha, ra, t, shift, c, R, F, B, D, win_up, win_down):
        return _BEYOND, 0.0
    return _ADDED, u * Z / G


def _other_target_types(row):
    """:func:`_other_target`'s argument types for rows of ``row``'s type."""
    return (row, _F, _F, _F, _I, _I, _F, _F, _F, _F, _F, _I, _F1, _F1, _F1, _F1, _B)


#: :func:`_other_target` called by the ladder pullbacks, compiled (for float64 or float32
#: rows) the first time a row of that dtype meets a rare target: the rows before hand their
#: row back (:func:`_then_linked`)
OTHER_TARGET = CallOnDemand(
    _other_target,
    types.Tuple((types.int64, _F)),
    float64=_other_target_types(_F1),
    float32=_other_target_types(types.Array(types.float32, 1, "C")),
)
_call_other_target = OTHER_TARGET.call


@helper
def _inject_in_window(r, inv_alpha, ra, t, shift, c, start, F, B, Bd, win_up, win_down):
    """:func:`~softorder.core.kernel_sums.inject_exact` for :func:`_ladder_pullback` (ties or
    rounding): each of its two injections into the row (``B`` upward, ``Bd`` downward)
    below ``F`` or into the window from ``F`` on. False, injecting nothing, when the point
    at or above the target lies beyond the window. A helper of its own: the rare case
    written into the loop made its first compilation a third longer.
    """
    n = r.shape[0]
    mask = WINDOW - 1
    i = _first_at_or_above(r, inv_alpha, ra, t, start)
    if i >= F + WINDOW:
        return False
    if i < n:
        up = c * exp_nonpositive(shift + offset_z(ra, r[i], inv_alpha, t))
        if i < F:
            B[i] += up
        else:
            win_up[i & mask] += up
    if i > 0:
        down = c * exp_nonpositive(shift - offset_z(ra, r[i - 1], inv_alpha, t))
        if i - 1 < F:
            Bd[i - 1] += down
        else:
            win_down[(i - 1) & mask] += down
    return True


# --- soft sort's long float32 rows in less memory (issue 13): the forward pass keeps no
# table ``A`` (its lower half waits in the slots of ``B``, and the targets take it from its
# recurrence), the VJP keeps no decays (each one computed again where it is read) and counts
# the anchors in 2 bytes each, and its two rows are separate arrays, so that the row of
# ``Bd`` goes before the gradient's array comes

#: float32 rows at least this long take soft sort's forward pass in two rows of scratch and
#: its VJP in two rows and 2-byte counts (:func:`lean_vjp`), at n = 1e6 about 8 bytes per
#: element less at each pass's peak (issue 13: at most 8 times a float32 input's bytes),
#: for a few per cent more time per pass (a decay computed twice, ``A`` and ``Bd`` by their
#: recurrences where they are read), which shorter rows, where the bytes are few, do not
#: pay (CHANGELOG.md)
LEAN_N = 1 << 18
#: rows of scratch of :func:`ladder_forward` for soft sort's forward pass on rows of
#: :data:`LEAN_N` or more (its ``ratios`` path), side by side in a row of ``2 n``: ``E`` and
#: ``B`` (:func:`prefix_counts` without ``A``)
LEAN_FORWARD_WORK = 2
#: ``Bd`` is kept at every BD_STEP-th point by :func:`lean_vjp` (:func:`lean_counts`)
BD_STEP = 64
#: the type of :func:`lean_vjp`'s counts: a row with a count beyond it goes to
#: :func:`sort_vjp` (``redo``), which more than 65535 points sharing one target need
LEAN_COUNTS = np.uint16


@helper
def _narrow_values(r, alpha, inv_alpha, E, B, w0, counts, ratios, out, values):
    """:func:`_ladder_values` without kept offsets and without the row of ``A``
    (:func:`prefix_counts` without ``A``): the targets :data:`TBLOCK` at a time, their offsets in
    ``ratios``, ``A`` at ``J - 1`` from its recurrence kept for :data:`WINDOW` points (the
    VJP's :func:`_lean_pullback` solves them so): the same anchors, offsets and values.
    """
    m = out.shape[0]
    ring = empty((WINDOW,), np.float64)
    codes = stack_rows(1, TBLOCK, np.int64)[0]
    PA = 0  # A is known at the points up to PA - 1 (ring: from PA - WINDOW on)
    pa = 1.0
    J = 0
    for q0 in range(0, m, TBLOCK):
        kn = TBLOCK if m - q0 >= TBLOCK else m - q0
        J, PA, pa = _solve_block(
            r, inv_alpha, E, B, counts, q0, kn, w0, J, PA, pa, ring, codes, ratios
        )
        for k in range(kn):
            q = q0 + k
            if values:
                out[q] = target_position(r, alpha, codes[k], ratios[k])
            else:
                counts[q] = codes[k]


@inner_helper
def _count_narrow(counts, i, b, a, w0):
    """:func:`_count` into counts of a narrow type: False where a count wraps around."""
    first = math.ceil(i + 0.5 + 0.5 * (b - a) - w0)
    if first < counts.shape[0]:
        at = np.uint64(first if first > 0 else 0)  # (unsigned: no wraparound)
        counts[at] += 1
        return counts[at] != 0
    return True


@inner_helper
def _keep_bd(marks, j, bd):
    """Keep ``Bd[j]`` where ``j`` is a multiple of :data:`BD_STEP` (:func:`lean_counts`)."""
    if j % BD_STEP == 0:
        marks[np.uint64(j // BD_STEP)] = bd


@helper
def lean_counts(r, inv_alpha, E, B, marks, w0, counts):
    """:func:`descending_counts` without the row of ``Bd``: the same ``B`` and counts to the
    bit (the same recurrences in the same order), ``A``'s lower half waiting in the slots of
    ``B`` (:func:`prefix_counts` without ``A``), and ``Bd`` kept at every :data:`BD_STEP`-th point
    only (``marks[c] = Bd[c * BD_STEP]``), from which :func:`_bd_block` computes it again.
    ``counts`` of a narrow type (:data:`LEAN_COUNTS`); False where a count does not fit it
    (the counts are then incomplete).
    """
    n = r.shape[0]
    counts[:] = 0
    if n == 0:
        return True
    fits = True
    h = (n + 1) // 2
    B[0] = 1.0  # A[0]
    B[n - 1] = 1.0
    _keep_bd(marks, n - 1, 0.0)
    a = 1.0
    b = 1.0
    bd = 0.0
    j = n - 2
    for i in range(1, h):
        a = 1.0 + E[i] * a
        B[i] = a  # A[i] (at the middle of an odd row, overwritten by B just below)
        ju = np.uint64(j)  # (unsigned: no wraparound)
        d = gap(np.float64(r[ju + np.uint64(1)]), np.float64(r[ju]))
        f = E[ju + np.uint64(1)]
        bd = f * (bd + d * inv_alpha * b) if f > 0.0 else 0.0
        b = 1.0 + f * b
        B[ju] = b
        _keep_bd(marks, j, bd)
        j -= 1
    if n % 2 == 1:
        fits &= _count_narrow(counts, h - 1, b, a, w0)
    for i in range(h, n):
        a = 1.0 + E[i] * a
        fits &= _count_narrow(counts, i, B[i], a, w0)
        ju = np.uint64(j)
        d = gap(np.float64(r[ju + np.uint64(1)]), np.float64(r[ju]))
        f = E[ju + np.uint64(1)]
        a_j = B[ju]
        bd = f * (bd + d * inv_alpha * b) if f > 0.0 else 0.0
        b = 1.0 + f * b
        B[ju] = b
        _keep_bd(marks, j, bd)
        fits &= _count_narrow(counts, j, b, a_j, w0)
        j -= 1
    return fits


@helper
def _bd_block(R, r, inv_alpha, E, B, marks, block, c0, lo):
    """``Bd`` for :func:`_lean_pullback` at ``R < n``, computed again by its recurrence
    (:func:`descending_counts`' operations, so its value to the bit) from the kept value
    at the next multiple of :data:`BD_STEP` (or 0 at the row's last point) down to ``R``,
    into ``block`` (``Bd`` at the points from ``c0``, computed down to ``lo``; the caller
    reads ``block[R - c0]``). It reads ``E`` and ``B`` above ``R`` only: slots the pullback
    has not overwritten. Called once per block (a call per target paid the arrays'
    reference counting at every target). Returns the new ``(c0, lo)``.
    """
    n = r.shape[0]
    c = R - R % BD_STEP
    if c != c0:  # another block: from its top (kept in marks), or from the row's last point
        c0 = c
        if c + BD_STEP < n:
            lo = c + BD_STEP
        else:
            lo = n - 1
            block[np.uint64(lo - c)] = 0.0
    if R < lo:
        bd = block[np.uint64(lo - c0)] if lo - c0 < BD_STEP else marks[np.uint64(lo // BD_STEP)]
        for j in range(lo - 1, R - 1, -1):
            ju = np.uint64(j)  # (unsigned: no wraparound)
            d = gap(np.float64(r[ju + np.uint64(1)]), np.float64(r[ju]))
            f = E[ju + np.uint64(1)]
            bd = f * (bd + d * inv_alpha * B[ju + np.uint64(1)]) if f > 0.0 else 0.0
            block[np.uint64(j - c0)] = bd
        lo = R
    return c0, lo


@inner_helper
def _carry_to_rows(F, M, E, B, win_up, win_down, up):
    """:func:`_move_to_rows` for :func:`_lean_pullback`, carrying the upward injections as
    they leave the window (:func:`~softorder.core.kernel_sums.carry_both_ways`' upward
    pass, the same operations in the same order: no injection reaches a point below ``F``
    any more): their carried sums into ``B``, the downward injections into the slots of
    ``E``, each slot's decay read first. Returns the new ``F`` and the carry ``up``.
    """
    mask = WINDOW - 1
    while F + BATCH <= M - 1:
        for i in range(F, F + BATCH):
            ui = np.uint64(i)  # (unsigned: no wraparound)
            if i > 0:
                up *= E[ui]
            up += win_up[i & mask]
            B[ui] = up
            E[ui] = win_down[i & mask]
            win_up[i & mask] = 0.0
            win_down[i & mask] = 0.0
        F += BATCH
    return F, up


@helper
def _lean_pullback(r, alpha, inv_alpha, E, B, marks, counts, u, negate, w0):
    """:func:`_ladder_pullback` solving the targets again (its ``ring`` path) without a row
    of ``Bd`` (:func:`_bd_block`), the upward injections carried as they leave the window
    into ``B`` (:func:`_carry_to_rows`) and the downward ones into the slots of ``E`` below
    it: the same operations on the same values, so the same injections, sums and
    ``alpha_bar`` to the bit. ``A`` and ``Ad`` are brought up to a target's point before the
    window moves (:func:`_moments_up_to` reads ``E`` there). With ``negate``, the cotangent
    is ``-u`` (negated where read, as ``np.negative`` would). Returns ``(alpha_bar, done)``;
    when done, ``B`` holds the upward sums and ``E`` the downward injections. The other
    targets: as in :func:`_ladder_pullback`.
    """
    n = r.shape[0]
    win_up, win_down, a_win, ad_win = _pullback_windows()
    ring = empty((WINDOW,), np.float64)
    block = empty((BD_STEP,), np.float64)
    b_t, b_ra, b_rl, b_rr, b_br, b_bdr, b_el, b_er, b_zl, b_gr, b_zr = stack_rows(
        _BLOCK_ROWS, TBLOCK, np.float64
    )
    left = stack_rows(1, TBLOCK, np.int64)[0]
    mask = WINDOW - 1
    M = 1
    F = 0
    P = 0
    a = 1.0
    ad = 0.0
    lo = np.float64(r[0])
    up = 0.0
    alpha_bar = 0.0
    codes = stack_rows(1, TBLOCK, np.int64)[0]
    ratios = stack_rows(1, TBLOCK, np.float64)[0]
    PA = 0
    pa = 1.0
    J = 0
    c0 = -BD_STEP  # the block of Bd computed again (none yet), down to point blo
    blo = 0
    for q0 in range(0, n, TBLOCK):
        kn = TBLOCK if n - q0 >= TBLOCK else n - q0
        # each target solved (_ladder_values' operations)
        J, PA, pa = _solve_block(
            r, inv_alpha, E, B, counts, q0, kn, w0, J, PA, pa, ring, codes, ratios
        )
        for k in range(kn):  # _target_points, Bd at R computed again
            an, t = codes[k], ratios[k]
            L = an - 1 if t <= 0.0 else an
            R = np.uint64(L + 1 if L + 1 < n else an)
            left[k] = L
            b_t[k] = t
            b_ra[k] = r[np.uint64(an)]
            b_rl[k] = r[np.uint64(L)] if L >= 0 else -INF
            b_rr[k] = r[R] if L + 1 < n else INF
            b_br[k] = B[R] if L + 1 < n else 0.0
            b_bdr[k] = 0.0
            if L + 1 < n:
                if L + 1 < blo or L + 1 >= c0 + BD_STEP:  # (once per block: a call)
                    c0, blo = _bd_block(L + 1, r, inv_alpha, E, B, marks, block, c0, blo)
                b_bdr[k] = block[np.uint64(L + 1 - c0)]
        _usual_weights(
            alpha, inv_alpha, b_t, b_ra, b_rl, b_rr, b_br, b_bdr, b_el, b_er, b_zl, b_gr, b_zr
        )
        for k in range(kn):  # the injections, in the targets' order
            uj = np.float64(u[np.uint64(q0 + k)])
            uj = -uj if negate else uj
            el = b_el[k]
            if uj == 0.0 or el == _SKIP:
                continue
            L = left[k]
            R = L + 1
            if L < M - 2:  # (never, for counts of a ladder)
                return alpha_bar, False
            M = L if L > M else M
            # (A and Ad first: they read E at points the window's move may overwrite)
            P, a, ad, lo = _moments_up_to(L, P, r, E, inv_alpha, a, ad, lo, a_win, ad_win)
            F, up = _carry_to_rows(F, M, E, B, win_up, win_down, up)
            aL = a_win[L & mask] if L >= 0 else 0.0
            adL = ad_win[L & mask] if L >= 0 else 0.0
            if el >= 0.0:
                G = aL * el + b_gr[k]
                Z = (b_zl[k] * aL + adL) * el + b_zr[k]
                cj = uj / G
                if R < n:
                    win_up[R & mask] += cj * b_er[k]
                if L >= 0:
                    if L < F:
                        E[np.uint64(L)] += cj * el
                    else:
                        win_down[L & mask] += cj * el
                alpha_bar += uj * Z / G
                continue
            ra, t, bR, bdR = b_ra[k], b_t[k], b_br[k], b_bdr[k]
            linked, found = _call_other_target(
                r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR, uj, F, B, E, win_up, win_down, True
            )
            code, term = found
            if not linked or code == _BEYOND:
                return alpha_bar, False
            if code == _ADDED:
                alpha_bar += term
    for i in range(F, n):  # the rest of the row: _carry_to_rows' operations
        ui = np.uint64(i)
        inside = i < F + WINDOW
        if i > 0:
            up *= E[ui]
        up += win_up[i & mask] if inside else 0.0
        B[ui] = up
        E[ui] = win_down[i & mask] if inside else 0.0
    return alpha_bar, True


@helper
def _lean_finish(r, inv_alpha, D, B):
    """:func:`~softorder.core.kernel_sums.carry_both_ways`' downward pass of the injections
    ``D`` (the same sums), its decays computed again :data:`BD_STEP` at a time (the
    operations of :func:`~softorder.core.rank.decays`, in a loop LLVM vectorizes: ``D`` took
    their slots), each point's total ``down + B[i]`` (``B``: the upward sums; 0 at an
    infinite value, as :func:`~softorder.core.rows.scatter_finite` writes it) into ``B[i]``.
    """
    n = r.shape[0]
    e = stack_rows(1, BD_STEP, np.float64)[0]
    down = 0.0
    for hi in range(n, 0, -BD_STEP):
        lo = hi - BD_STEP if hi > BD_STEP else 0
        # e[k] = E[lo + 1 + k], the factors of the points j = lo + k below hi
        m = hi - lo if hi < n else hi - lo - 1
        if not FAST_EXP:
            for k in range(m):
                i = np.uint64(lo + 1 + k)  # (unsigned: no wraparound)
                e[k] = math.exp(-gap(np.float64(r[i]), np.float64(r[i - np.uint64(1)])) * inv_alpha)
        else:
            far = False
            for k in range(m):
                i = np.uint64(lo + 1 + k)
                x = -gap(np.float64(r[i]), np.float64(r[i - np.uint64(1)])) * inv_alpha
                far |= needs_libm(x)
                e[k] = exp_or_zero(x)
            if far:
                for k in range(m):
                    i = np.uint64(lo + 1 + k)
                    x = -gap(np.float64(r[i]), np.float64(r[i - np.uint64(1)])) * inv_alpha
                    if needs_libm(x):
                        e[k] = math.exp(x)
        for j in range(hi - 1, lo - 1, -1):
            uj = np.uint64(j)
            if j < n - 1:
                down *= e[uj - np.uint64(lo)]
            down += D[uj]
            total = down + B[uj]
            B[uj] = total if abs(r[uj]) != INF else 0.0


@kernel
def _lean_vjp(xs, alpha, u, negate, counts, E, B, marks, alpha_bar, redo, redo_only):
    """:func:`lean_vjp`'s kernel (``redo_only``: :func:`_then_linked`)."""
    rows, n = xs.shape
    handed = 0
    for row in prange(rows):
        if redo_only and redo[row] == 0:
            continue
        redo[row] = 0
        r = xs[row]
        Br = B[row]
        if has_nan(r):
            Br[:] = np.nan
            alpha_bar[row] = np.nan
            continue
        a = alpha[row]
        inv_alpha = 1.0 / a
        Er = E[row]
        c = counts[row]
        _row_decays(r, inv_alpha, Er)
        if not lean_counts(r, inv_alpha, Er, Br, marks[row], 0.5, c):
            redo[row] = 1
            handed += 1
            continue
        ab, done = _lean_pullback(r, a, inv_alpha, Er, Br, marks[row], c, u[row], negate, 0.5)
        if not done:
            redo[row] = 1
            handed += 1
            continue
        alpha_bar[row] = ab
        _lean_finish(r, inv_alpha, Er, Br)
    return handed


@_then_linked("OTHER_TARGET", _lean_vjp)
def lean_vjp(xs, alpha, u, negate, counts, E, B, marks, alpha_bar, redo):
    """Soft sort's VJP on long rows (:func:`ladder_vjp`'s values, the same to the bit,
    solving the targets again) in two rows of scratch, ``E`` and ``B`` (rows, n), and
    ``counts`` (rows, n) of :data:`LEAN_COUNTS`: ``Bd`` is kept at every
    :data:`BD_STEP`-th point in ``marks`` (rows, n // BD_STEP + 1) and computed again
    where it is read (:func:`_lean_pullback`). Each row's gradient in sorted order is left
    in ``B`` (float64); :func:`scatter_rows` puts it in the input's order, rounded once to
    ``x_bar``'s dtype, once ``E`` and the counts are gone. ``u`` (rows, n) float32 or
    float64, the cotangent itself or, with ``negate``, its negative (a descending sort's:
    no copy of it). A row whose counts do not fit their type, or whose ties throw an injection
    beyond the window (or below it), gets ``redo[row] = 1`` (the caller runs
    :func:`sort_vjp` on it); a NaN row gets NaN in ``B`` and ``alpha_bar``. Rows with rare
    targets call :func:`_other_target`, compiled when a row first needs it
    (:func:`_then_linked`).
    """


@kernel
def scatter_rows(xs, totals, order, x_bar, redo):
    """``x_bar[row, order[row, i]] = totals[row, i]`` (rounded once to ``x_bar``'s dtype)
    for the rows ``xs`` (rows, n) whose ``redo`` is 0: :func:`lean_vjp`'s gradients into
    the input's order.
    """
    rows, n = xs.shape
    for row in prange(rows):
        if redo[row]:
            continue
        o = order[row]
        t = totals[row]
        xb = x_bar[row]
        for i in range(n):
            xb[np.uint64(o[i])] = t[i]


#: the per-row helpers of :func:`ladder_vjp` called by symbol
_LADDER_VJP_CALLS = SymbolCalls(
    # E, injections up and down
    carry_both_ways=(carry_both_ways, (_F1, _F1, _F1)),
)
_call_carry_both_ways = _LADDER_VJP_CALLS.carry_both_ways
#: the decays of :func:`ladder_forward`'s widened row, called by symbol (compiled once, not
#: again inside the kernel); :func:`ladder_vjp` reads float32 rows too, so it links them in
_LADDER_FORWARD_CALLS = SymbolCalls(
    # r, inv_alpha, E
    decays=(_row_decays, (_F1, _F, _F1)),
)
_call_row_decays = _LADDER_FORWARD_CALLS.decays
