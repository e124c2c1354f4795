"""The Lap-sum ``S(x) = sum_i F((x - r_i) / alpha)`` of one sorted row and its closed-form inverse.

Section 3-4 of the math doc. Per sorted row ``r`` (ascending, float64) the O(n) prefix arrays

    E[i] = exp(-(r[i] - r[i-1]) / alpha)
    A[i] = sum_{j <= i} exp(-(r[i] - r[j]) / alpha),   Ad[i] = sum_{j <= i} d_ij exp(-d_ij)
    B[i] = sum_{j >= i} exp(-(r[j] - r[i]) / alpha),   Bd[i] = sum_{j >= i} d_ij exp(-d_ij)

(``d_ij = |r[i] - r[j]| / alpha``; every factor is <= 1, so nothing overflows) give S at every
point of the row, the inverse ``S^-1(w)`` at any target in O(1) after locating its interval,
and the derivative sums of a target in O(1).

A target ``b`` is kept as ``(anchor, t)`` with ``b = r[anchor] + alpha * t``: offsets stay exact
next to huge values and targets inside a block of equal infinite values stay meaningful.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange, types

from softorder.core import fast_exp, fast_log
from softorder.core._jit import SymbolCalls, address_only, helper, inner_helper, kernel
from softorder.core.kernel_sums import carry_injections, gather_at_targets, inject_exact
from softorder.core.laplace import INF, gap, logaddexp, offset_z, rel_weight
from softorder.core.rows import has_nan

#: Rows of a kernel's workspace that :func:`row_tables` fills: E, A, B, S, and Ad, Bd.
TABLES = 4
TABLES_WITH_MOMENTS = 6
#: Rows of :func:`sort_kernel`'s workspace: E, A, B (its count computes S without storing it).
SORT_TABLES = 3
#: Rows of per-target scratch (``twork``) that the GPU twin of :func:`inverse_pullback` and
#: :func:`inverse_pushforward` use (the CPU pullback takes ``inj``, two rows of n, instead).
PULLBACK_WORK = 2
PUSHFORWARD_WORK = 3

if fast_exp._jit_enabled():
    from numba.core import cgutils
    from numba.core.imputils import impl_ret_new_ref
    from numba.extending import intrinsic
    from numba.np.arrayobj import make_array, populate_array

    def _allocate(context, builder, array_type, dims):
        """A new C-ordered array of ``dims`` (LLVM intp values): what numba's
        ``_empty_nd_impl`` emits, with the runtime's allocation called in place, where numba
        compiles a call of its allocator (``compile_internal``) at each use, a few
        hundredths of a second each on a first compilation.
        """
        intp = context.get_value_type(types.intp)
        itemsize = context.get_constant(
            types.intp, context.get_abi_sizeof(context.get_data_type(array_type.dtype))
        )
        size, overflow = itemsize, cgutils.false_bit
        strides = []
        for d in reversed(dims):
            strides.append(size)
            product = builder.smul_with_overflow(size, d)
            size = builder.extract_value(product, 0)
            overflow = builder.or_(overflow, builder.extract_value(product, 1))
        with builder.if_then(overflow, likely=False):
            context.call_conv.return_user_exc(
                builder, ValueError, ("softorder: an array of that size is too big",)
            )
        align = context.get_preferred_array_alignment(array_type.dtype)
        meminfo = context.nrt.meminfo_alloc_aligned(builder, size, align)
        data = context.nrt.meminfo_data(builder, meminfo)
        array = make_array(array_type)(context, builder)
        populate_array(
            array,
            data=builder.bitcast(data, context.get_data_type(array_type.dtype).as_pointer()),
            shape=cgutils.pack_array(builder, dims, ty=intp),
            strides=cgutils.pack_array(builder, strides[::-1], ty=intp),
            itemsize=itemsize,
            meminfo=meminfo,
        )
        return array

    @intrinsic
    def empty(typingctx, shape, kind):
        """``np.empty(shape, kind)`` in a kernel or helper (``shape`` a tuple of integers,
        ``kind`` a NumPy scalar type), emitted in place: ``np.empty`` and ``np.zeros`` compile
        a function of their own per combination of argument types on a first call (a few
        hundredths of a second each).
        """
        array_type = types.Array(kind.instance_type, len(shape), "C")

        def codegen(context, builder, signature, args):
            dims = [
                context.cast(builder, d, t, types.intp)
                for d, t in zip(cgutils.unpack_tuple(builder, args[0]), shape, strict=True)
            ]
            array = _allocate(context, builder, array_type, dims)
            return impl_ret_new_ref(context, builder, array_type, array._getvalue())

        return array_type(shape, kind), codegen

    @intrinsic
    def stack_rows(typingctx, rows, cols, kind):
        """``np.empty((rows, cols), kind)`` on the stack of a helper (``rows`` and ``cols``
        integer constants): scratch of a few KB that costs no allocation per call, counts in
        no heap peak, and that LLVM knows no argument can overlap. It lives as long as the
        function that calls it (or that it is inlined into): never return or keep it.
        """
        if not isinstance(rows, types.IntegerLiteral) or not isinstance(cols, types.IntegerLiteral):
            return None
        dtype = kind.instance_type
        array_type = types.Array(dtype, 2, "C")
        shape = (rows.literal_value, cols.literal_value)

        def codegen(context, builder, signature, args):
            item = context.get_data_type(dtype)
            size = context.get_abi_sizeof(item)
            data = cgutils.alloca_once(builder, item, size=shape[0] * shape[1])
            array = context.make_array(array_type)(context, builder)
            intp = context.get_value_type(types.intp)
            context.populate_array(
                array,
                data=data,
                shape=[intp(shape[0]), intp(shape[1])],
                strides=[intp(shape[1] * size), intp(size)],
                itemsize=intp(size),
                meminfo=None,
            )
            return array._getvalue()

        return array_type(rows, cols, kind), codegen

else:

    def empty(shape, kind):
        """``np.empty(shape, kind)`` (NUMBA_DISABLE_JIT)."""
        return np.empty(shape, kind)

    def stack_rows(rows, cols, kind):
        """``np.empty((rows, cols), kind)`` (NUMBA_DISABLE_JIT)."""
        return np.empty((rows, cols), kind)


@helper
def prefix_sums(r, inv_alpha, E, A, B):
    """Fill ``E``, ``A``, ``B`` for the sorted row ``r``."""
    n = r.shape[0]
    A[0] = 1.0
    E[0] = 0.0
    for i in range(1, n):
        e = math.exp(-gap(r[i], r[i - 1]) * inv_alpha)
        E[i] = e
        A[i] = 1.0 + e * A[i - 1]
    B[n - 1] = 1.0
    for i in range(n - 2, -1, -1):
        B[i] = 1.0 + E[i + 1] * B[i + 1]


@helper
def prefix_moments(r, inv_alpha, E, Ad, Bd, A, B):
    """Fill the distance-weighted sums ``Ad``, ``Bd`` (needs ``E``, ``A``, ``B``)."""
    n = r.shape[0]
    Ad[0] = 0.0
    for i in range(1, n):
        e = E[i]
        Ad[i] = e * (Ad[i - 1] + gap(r[i], r[i - 1]) * inv_alpha * A[i - 1]) if e > 0.0 else 0.0
    Bd[n - 1] = 0.0
    for i in range(n - 2, -1, -1):
        e = E[i + 1]
        Bd[i] = e * (Bd[i + 1] + gap(r[i + 1], r[i]) * inv_alpha * B[i + 1]) if e > 0.0 else 0.0


@helper
def lapsum_at_points(A, B, S):
    """``S[i] = S(r[i]) = i + 1/2 + (B[i] - A[i]) / 2`` (0-based ``i``); non-decreasing."""
    for i in range(A.shape[0]):
        S[i] = i + 0.5 + 0.5 * (B[i] - A[i])


@inner_helper
def count_at_most(S, w, hint):
    """Number of ``S[i] <= w``, by a galloping search from ``hint`` (O(1) amortized for sorted
    targets, O(log n) otherwise). Always terminates: every loop moves a bound strictly.
    """
    n = S.shape[0]
    if hint > 0 and S[hint - 1] > w:
        hi = hint - 1
        step = 1
        lo = -1
        while True:
            cand = hi - step
            if cand < 0:
                break
            if S[cand] <= w:
                lo = cand
                break
            hi = cand
            step *= 2
    else:
        lo = hint - 1
        step = 1
        hi = n
        while True:
            cand = lo + step
            if cand >= n:
                break
            if S[cand] > w:
                hi = cand
                break
            lo = cand
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if S[mid] <= w:
            lo = mid
        else:
            hi = mid
    return hi


#: Below this ``E = exp(-gap / alpha)`` the inverse switches to log space (``A B E`` would lose
#: precision as a subnormal, or underflow to 0 and give ``log(0)`` for integer targets).
SMALL_E = 1e-280


@inner_helper
def invert(r, inv_alpha, E, A, B, w, J):
    """Closed-form ``S^-1(w)`` as ``(anchor, t)``, given ``J`` = number of ``S(r[i]) <= w``.

    With ``c = w - J`` and ``D = sqrt(c^2 + A B E)`` (section 4), ``t = log((c + D) / B)`` from the
    right point for ``c >= 0`` and ``t = log(A / (D - c))`` from the left point for ``c < 0``:
    sums of positive terms, no cancellation. When the gap is hundreds of alphas wide (``E``
    tiny or 0, the common case for integer k), the same formulas are evaluated in log space, so
    the target stays exact (the midpoint for ``c = 0``) instead of becoming ``log(0)``.
    """
    return invert_at(r, inv_alpha, E[J] if 0 < J < r.shape[0] else 0.0, A, B, w, J)


@inner_helper
def invert_at(r, inv_alpha, e, A, B, w, J):
    """:func:`invert` given the decay ``e = E[J]`` of the target's interval (any value when
    ``J`` is 0 or n): the solvers that keep no row of decays compute it.
    """
    n = r.shape[0]
    if J == 0:
        ratio = 2.0 * w / B[0]
        if ratio >= fast_log.TINY:
            return 0, math.log(ratio)
        # a subnormal ratio (a tiny k or q) keeps few bits: the difference of two logs
        # (doubling w is exact)
        return 0, math.log(2.0 * w) - math.log(B[0])
    if J == n:
        return n - 1, -math.log(2.0 * (n - w) / A[n - 1])
    c = w - J
    if e >= SMALL_E:
        d = math.sqrt(c * c + A[J - 1] * B[J] * e)
        if c >= 0.0:
            return J, math.log((c + d) / B[J])
        return J - 1, math.log(A[J - 1] / (d - c))
    return invert_far(A[J - 1], B[J], gap(r[J], r[J - 1]) * inv_alpha, c, J)


@helper
def invert_far(a, b, distance, c, J):
    """:func:`invert_at` in log space, for an interval hundreds of alphas wide (``E[J] <
    SMALL_E``): ``a = A[J - 1]``, ``b = B[J]``, ``distance = gap(r[J], r[J - 1]) / alpha``,
    ``c = w - J``. A helper of scalars (no reference counting to call), not inlined by numba:
    its inlining copied this code into every inverse on their first compilation.
    """
    log_a = math.log(a)
    log_b = math.log(b)
    log_abe = log_a + log_b - distance
    if c == 0.0:
        return J, 0.5 * log_abe - log_b
    log_c = math.log(abs(c))
    log_d = 0.5 * logaddexp(2.0 * log_c, log_abe)
    if c > 0.0:
        return J, logaddexp(log_c, log_d) - log_b
    return J - 1, log_a - logaddexp(log_c, log_d)


@helper
def solve_targets(r, inv_alpha, E, A, B, S, w, worder, anchor, t):
    """Invert every target ``w[j]`` of one row, visiting them in ascending order ``worder``."""
    hint = 0
    for q in range(w.shape[0]):
        j = worder[q]
        hint = count_at_most(S, w[j], hint)
        anchor[j], t[j] = invert(r, inv_alpha, E, A, B, w[j], hint)


@helper
def prefix_sums_ab(r, inv_alpha, A, B):
    """:func:`prefix_sums` without a row of decays: ``E`` passes through ``B``'s row, which the
    backward pass overwrites with ``B`` (each ``E[i + 1]`` is read just before its slot is).
    """
    n = r.shape[0]
    A[0] = 1.0
    for i in range(1, n):
        e = math.exp(-gap(r[i], r[i - 1]) * inv_alpha)
        B[i] = e
        A[i] = 1.0 + e * A[i - 1]
    e_next = B[n - 1]
    B[n - 1] = 1.0
    for i in range(n - 2, -1, -1):
        e = B[i]
        B[i] = 1.0 + e_next * B[i + 1]
        e_next = e


@helper
def prefix_sums_halves(r, inv_alpha, A, B):
    """:func:`prefix_sums_ab` (the same operations, so the same ``A`` and ``B`` to the bit)
    in another order: ``A``'s recurrence runs up the lower half while
    ``B``'s runs down the upper half, each computing its own decays ``E``, then both finish
    the other half from the decays the other left. The ``exp`` of the first half hide the
    latency of both recurrences, which ``prefix_sums_ab`` leaves exposed in its second,
    ``exp``-free pass; they are :func:`~softorder.core.fast_exp.exp_emitted` (in place, where a call
    of libm's ``exp`` would stall the recurrences). The decays wait in the spare slots:
    ``E[i]`` of the lower half in ``B[i]``, of the upper half in ``A[i]``, each read just
    before its slot is written.
    """
    n = r.shape[0]
    h = (n + 1) // 2
    A[0] = 1.0
    B[n - 1] = 1.0
    a = 1.0  # A[i - 1]
    b = 1.0  # B[j + 1]
    e_next = 0.0  # E[j + 1] for B's next step
    j = n - 2
    for i in range(1, h):
        e = fast_exp.exp_emitted(-gap(r[i], r[i - 1]) * inv_alpha)
        B[i] = e
        a = 1.0 + e * a
        A[i] = a
        f = fast_exp.exp_emitted(-gap(r[j + 1], r[j]) * inv_alpha)
        A[j + 1] = f
        b = 1.0 + f * b
        B[j] = b  # (for odd n the last step writes B[h - 1] over E[h - 1], kept in e_next)
        j -= 1
        e_next = e
    if n % 2 == 0:  # E[h], between the halves, is the one neither computed
        e_next = math.exp(-gap(r[h], r[h - 1]) * inv_alpha)
        A[h] = e_next
    for i in range(h, n):
        a = 1.0 + A[i] * a
        A[i] = a
        e = B[j]  # E[j] (garbage at j == 0, never used)
        b = 1.0 + e_next * b
        B[j] = b
        e_next = e
        j -= 1


@helper
def prefix_tables_halves(r, inv_alpha, E, A, B):
    """:func:`prefix_sums` (the same operations, so the same ``E``, ``A`` and ``B`` to the
    bit) in the order of :func:`prefix_sums_halves`: ``A``'s recurrence up the lower half
    beside ``B``'s down the upper half, each computing its decays, then both finish the other
    half from the decays the other stored.
    """
    n = r.shape[0]
    h = (n + 1) // 2
    E[0] = 0.0
    A[0] = 1.0
    B[n - 1] = 1.0
    a = 1.0
    b = 1.0
    j = n - 2
    for i in range(1, h):
        e = math.exp(-gap(r[i], r[i - 1]) * inv_alpha)
        E[i] = e
        a = 1.0 + e * a
        A[i] = a
        f = math.exp(-gap(r[j + 1], r[j]) * inv_alpha)
        E[j + 1] = f
        b = 1.0 + f * b
        B[j] = b
        j -= 1
    if n % 2 == 0:  # E[h], between the halves, is the one neither computed
        E[h] = math.exp(-gap(r[h], r[h - 1]) * inv_alpha)
    for i in range(h, n):
        a = 1.0 + E[i] * a
        A[i] = a
        b = 1.0 + E[j + 1] * b
        B[j] = b
        j -= 1


@helper
def solve_targets_ab(r, inv_alpha, A, B, w, worder, anchor, t):
    """:func:`solve_targets` from ``A`` and ``B`` alone (:func:`prefix_sums_ab`): two rows of
    n instead of four; ``S`` (:func:`lapsum_at_points`) and the decay of each target's
    interval are computed where read, with the same operations, so the targets are the same
    to the bit.

    :func:`count_at_most`'s galloping search and :func:`invert_at` are written out, in fewer
    statements (one gallop loop for both directions, one ``log`` for the common cases): each
    statement is typed and lowered again on a first call, and their inlined copies were most
    of this function's compilation.
    """
    n = r.shape[0]
    J = 0  # the previous target's count: the search's hint
    for q in range(w.shape[0]):
        j = worder[q]
        wj = w[j]
        # count_at_most: gallop down from the hint while S > w, or up while S <= w (the
        # same points in the same order), then bisect; S[i] = i + 1/2 + (B[i] - A[i]) / 2.
        # Down, S is never NaN (one NaN decay makes every S NaN, and then no S > w), so
        # "S <= w" there is "not above"
        down = J > 0 and (J - 1 + 0.5 + 0.5 * (B[J - 1] - A[J - 1])) > wj
        lo = -1 if down else J - 1
        hi = J - 1 if down else n
        base = hi if down else lo
        step = -1 if down else 1
        while True:
            cand = base + step
            if cand < 0 or cand >= n:
                break
            above = (cand + 0.5 + 0.5 * (B[cand] - A[cand])) > wj
            if above:
                hi = cand
            else:
                lo = cand
            if above != down:
                break
            base = cand
            step *= 2
        while True:  # (a loop's condition is compiled twice, a test in the loop once)
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
            if (mid + 0.5 + 0.5 * (B[mid] - A[mid])) <= wj:
                lo = mid
            else:
                hi = mid
        J = hi
        # invert_at: the anchor and the ratio whose log is the offset
        # (its tests as invert_at writes them: a NaN takes the same branch)
        negate = False
        if J == 0:
            an = 0
            ratio = 2.0 * wj / B[0]
            if not ratio >= fast_log.TINY:
                # a subnormal ratio (a tiny k or q) keeps few bits: the difference of two
                # logs (doubling w is exact)
                anchor[j] = 0
                t[j] = math.log(2.0 * wj) - math.log(B[0])
                continue
        elif J == n:
            an = n - 1
            ratio = 2.0 * (n - wj) / A[n - 1]
            negate = True
        else:
            c = wj - J
            distance = gap(r[J], r[J - 1]) * inv_alpha
            e = math.exp(-distance)
            if not e >= SMALL_E:
                anchor[j], t[j] = invert_far(A[J - 1], B[J], distance, c, J)
                continue
            d = math.sqrt(c * c + A[J - 1] * B[J] * e)
            up = c >= 0.0
            an = J if up else J - 1
            ratio = (c + d) / B[J] if up else A[J - 1] / (d - c)
        anchor[j] = an
        lg = math.log(ratio)
        t[j] = -lg if negate else lg


@helper
def solve_ladder(r, alpha, inv_alpha, E, A, B, w0, anchor, t, out):
    """Invert the ascending targets ``w_q = w0 + q`` (q = 0..m-1, m = ``anchor.shape[0]``) of
    one row: soft sort (``w0 = 1/2``) and the permutation boundaries (``w0 = 1``).

    The interval of every target, ``J_q = #{i : S[i] <= w_q}``, comes from a count instead of
    a search: ``S[i] <= w0 + q`` exactly when ``q >= ceil(S[i] - w0)`` (``S[i] - w0`` is exact
    for ``S[i] >= w0 / 2``, and below that the ceiling is 0 either way), so each point adds 1
    at its first target and a prefix sum gives ``J_q``. Branch-free, unlike a merge, whose
    data-dependent exit is mispredicted about once per target and dominated its time.
    The same ``J`` as :func:`count_at_most` wherever ``S`` is non-decreasing; the inverse is
    :func:`invert`'s, written with selects for the common case, and its logs in a pass of
    their own (:data:`~softorder.core.fast_log.take_logs`). ``S``
    (:func:`lapsum_at_points`) is computed in the count, never stored. With ``out`` of length
    m, the targets' values :func:`target_position` go there too (``out`` of length 0: not
    wanted).
    """
    n = r.shape[0]
    m = anchor.shape[0]
    anchor[:] = 0  # the counts, then overwritten by the anchors
    for i in range(n):
        first = math.ceil(i + 0.5 + 0.5 * (B[i] - A[i]) - w0)
        if first < m:
            anchor[np.uint64(first if first > 0 else 0)] += 1  # (unsigned: no wraparound)
    positions = out.shape[0] == m
    J = 0
    for q in range(m):
        J += anchor[q]
        uJ = np.uint64(J)  # (0 < J < n below; unsigned: no wraparound)
        w = w0 + q
        # invert's cases written out (numba's inlining of invert was a third of this
        # function's compilation); a target whose offset is final here gets the anchor
        # -1 - anchor, the others their ratio, whose log fast_log.take_logs takes afterwards
        if J == 0:
            anchor[q] = -1
            t[q] = math.log(2.0 * w / B[0])
        elif J == n:
            anchor[q] = -n
            t[q] = -math.log(2.0 * (n - w) / A[n - 1])
        elif E[uJ] < SMALL_E:
            j1 = uJ - np.uint64(1)
            an, t[q] = invert_far(A[j1], B[uJ], gap(r[uJ], r[j1]) * inv_alpha, w - J, J)
            anchor[q] = -1 - an
        else:
            c = w - J
            a = A[uJ - np.uint64(1)]
            b = B[uJ]
            d = math.sqrt(c * c + a * b * E[uJ])
            up = c >= 0.0
            num = c + d if up else a
            den = b if up else d - c
            an = J if up else J - 1
            ratio = num / den
            if ratio >= fast_log.TINY and ratio < INF:  # (always: A, B >= 1, E >= SMALL_E)
                anchor[q] = an
                t[q] = ratio
            else:
                anchor[q] = -1 - an
                t[q] = math.log(ratio)
    fast_log.take_logs(anchor, t)
    if positions:  # a pass of its own: inside the loop above it slowed every target
        for q in range(m):
            out[q] = target_position(r, alpha, anchor[q], t[q])


@inner_helper
def target_position(r, alpha, anchor, t):
    """The value ``b = r[anchor] + alpha * t`` of a target."""
    ra = r[anchor]
    if t == 0.0 or ra == INF or ra == -INF:
        return ra
    return ra + alpha * t


@inner_helper
def inverse_position(r, alpha, anchor, t):
    """:func:`target_position` of a target of :func:`inverse_kernel`, but NaN on the plateau
    between a block of ``-inf`` and a block of ``+inf`` entries with nothing between them
    (``w`` equal to the number of ``-inf`` entries): every value of the gap solves it and no
    limit exists (``[-M, M]`` gives 0, ``[-M, 2M]`` gives ``M / 2``). :func:`invert_far` gives
    only that target the offset ``-inf`` from the first ``+inf`` entry.
    """
    if t == -INF and anchor > 0 and r[anchor] == INF and r[anchor - 1] == -INF:
        return math.nan
    return target_position(r, alpha, anchor, t)


@inner_helper
def target_sums(r, inv_alpha, A, B, Ad, Bd, anchor, t):
    """Derivative sums of one target ``b``, relative to its nearest point.

    With ``z_i = (b - r_i) / alpha`` returns ``(shift, G, Z)``:
    ``shift = min_i |z_i|``, ``G = sum_i exp(shift - |z_i|)``, ``Z = sum_i z_i exp(shift - |z_i|)``.
    Then ``db/dr_i = exp(shift - |z_i|) / G``, ``db/dalpha = Z / G`` and
    ``db/dw = 2 alpha exp(shift) / G``. ``G == 0`` only for a target at infinite distance.
    """
    n = r.shape[0]
    L = anchor - 1 if t <= 0.0 else anchor
    R = L + 1
    return target_sums_at(
        r,
        inv_alpha,
        anchor,
        t,
        A[L] if L >= 0 else 0.0,
        Ad[L] if L >= 0 else 0.0,
        B[R] if R < n else 0.0,
        Bd[R] if R < n else 0.0,
    )


@inner_helper
def target_sums_at(r, inv_alpha, anchor, t, a_left, ad_left, b_right, bd_right):
    """:func:`target_sums` from the tables' values at the target's two neighbouring points
    ``L`` (below) and ``L + 1``: ``A[L], Ad[L], B[L + 1], Bd[L + 1]`` (any values for a
    missing neighbour), e.g. from :func:`neighbour_sums`.
    """
    n = r.shape[0]
    L = anchor - 1 if t <= 0.0 else anchor
    R = L + 1
    zl = offset_z(r[anchor], r[L], inv_alpha, t) if L >= 0 else INF
    zr = offset_z(r[anchor], r[R], inv_alpha, t) if R < n else -INF
    shift = -zr if -zr < zl else zl  # min(zl, -zr)
    if shift == INF:
        return 0.0, 0.0, 0.0
    G = 0.0
    Z = 0.0
    el = rel_weight(zl, shift)
    if el > 0.0:
        G += a_left * el
        Z += (zl * a_left + ad_left) * el
    er = rel_weight(zr, shift)
    if er > 0.0:
        G += b_right * er
        Z += (zr * b_right - bd_right) * er
    return shift, G, Z


@inner_helper
def moment_step_up(d, inv_alpha, a, ad):
    """One step of the recurrences of ``A``, ``Ad`` (:func:`prefix_moments`) from ``r[i - 1]``
    to ``r[i]``, ``d = gap(r[i], r[i - 1])``: returns ``(E[i], A[i], Ad[i])``.
    """
    e = fast_exp.exp_emitted(-d * inv_alpha)  # (in place: no call in the recurrence)
    return e, 1.0 + e * a, (e * (ad + d * inv_alpha * a) if e > 0.0 else 0.0)


@inner_helper
def moment_step_down(r, i, e, inv_alpha, b, bd):
    """One step of the recurrences of ``B``, ``Bd`` from ``r[i + 1]`` to ``r[i]``, with
    ``e = E[i + 1]``: returns ``(B[i], Bd[i])``.
    """
    bd = e * (bd + gap(r[i + 1], r[i]) * inv_alpha * b) if e > 0.0 else 0.0
    return 1.0 + e * b, bd


@helper
def neighbour_sums(r, inv_alpha, E, anchor, offset, sums):
    """Fill ``E`` and, for each target ``j`` (``anchor``, ``offset``) with left point ``L``
    (``anchor - 1`` for ``offset <= 0``, else ``anchor``; -1 for none) and right point
    ``L + 1`` (n for none), ``sums[:, j] = (L, A[L], Ad[L], B[L + 1], Bd[L + 1])``: the
    recurrences of :func:`row_tables` with moments, kept in registers and read at the
    targets' points (the same values to the bit; 0 for a missing point). For a few targets:
    they are sorted by insertion, O(m + inversions).

    ``B``'s recurrence runs first, down the whole row, with the decays computed as it reads
    them (:func:`~softorder.core.fast_exp.exp_emitted`: in place where libm's ``exp`` allows; a call
    beside the recurrence clobbered the registers of its accumulators); ``A``'s recurrence
    then reads them and stops at the last left point: the top-k loss's targets sit near the
    bottom of the row.
    """
    n = r.shape[0]
    m = anchor.shape[0]
    L = sums[0]
    for j in range(m):
        L[j] = anchor[j] - 1 if offset[j] <= 0.0 else anchor[j]
        sums[1, j] = 0.0
        sums[2, j] = 0.0
        sums[3, j] = 0.0
        sums[4, j] = 0.0
    # (np.argsort compiled a sort of its own into every kernel that calls this)
    by_left = empty((m,), np.int64)
    for j in range(m):
        k = j
        while True:  # (a loop's condition is compiled twice, a test in the loop once)
            if k == 0 or L[by_left[k - 1]] <= L[j]:
                break
            by_left[k] = by_left[k - 1]
            k -= 1
        by_left[k] = j
    # B's recurrence first, down the row, with the decays: each computed where it is read
    # (fast_exp.exp_emitted: no call beside the recurrence), and on below the first right point for
    # A's recurrence and the caller
    E[0] = 0.0
    b = 1.0
    bd = 0.0
    p = m - 1
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            e = fast_exp.exp_emitted(-gap(r[i + 1], r[i]) * inv_alpha)
            E[i + 1] = e
            if p < 0:  # every right point read
                continue
            b, bd = moment_step_down(r, i, e, inv_alpha, b, bd)
        while p >= 0:
            j = by_left[p]
            if L[j] + 1 < i:
                break
            if L[j] + 1 == i:
                sums[3, j] = b
                sums[4, j] = bd
            p -= 1
    a = 1.0
    ad = 0.0
    p = 0
    for i in range(n):
        if p == m:  # every left point read
            break
        if i > 0:
            d = gap(r[i], r[i - 1])
            e = E[i]  # moment_step_up's, its exp done
            ad = e * (ad + d * inv_alpha * a) if e > 0.0 else 0.0
            a = 1.0 + e * a
        while p < m:
            j = by_left[p]
            if L[j] > i:
                break
            if L[j] == i:
                sums[1, j] = a
                sums[2, j] = ad
            p += 1


@kernel
def lapsum_kernel(xs, alpha, points, out, work):
    """``out[row, j] = S_row(points[row, j])`` for sorted rows ``xs`` (any order of points).

    O(n + m log n) per row: prefix sums, then a binary search and the interval formula.
    ``work``: (rows, TABLES, n) scratch.
    """
    rows, n = xs.shape
    m = points.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :] = np.nan
            continue
        inv_alpha = 1.0 / alpha[row]
        E, A, B, Ad, Bd, S = sum_tables(r, inv_alpha, work[row])
        for j in range(m):
            x = points[row, j]
            J = np.searchsorted(r, x, side="right")
            s = float(J)
            if J > 0:
                s -= 0.5 * A[J - 1] * math.exp(-gap(x, r[J - 1]) * inv_alpha)
            if J < n:
                s += 0.5 * B[J] * math.exp(-gap(r[J], x) * inv_alpha)
            out[row, j] = s


@helper
def row_tables(r, inv_alpha, moments, work):
    """Fill the prefix arrays of one sorted row into ``work`` and return views
    ``(E, A, B, Ad, Bd, S)``; ``Ad``/``Bd`` (only gradients need them) only if ``moments``:
    :func:`moment_tables` or :func:`sum_tables`. Kernels call those two, so that a first call
    compiles only the one it uses (the two in one function cost twice the compilation).

    Scratch memory comes from the caller (NumPy allocations of large arrays are several times
    cheaper than fresh ones inside numba, which page-fault on every call).
    """
    if moments:
        return moment_tables(r, inv_alpha, work)
    return sum_tables(r, inv_alpha, work)


@helper
def sum_tables(r, inv_alpha, work):
    """:func:`row_tables` without the moments: ``Ad``, ``Bd`` are empty views."""
    n = r.shape[0]
    E = work[0, :n]
    A = work[1, :n]
    B = work[2, :n]
    S = work[3, :n]
    prefix_sums(r, inv_alpha, E, A, B)
    lapsum_at_points(A, B, S)
    return E, A, B, work[0, :0], work[0, :0], S


@helper
def moment_tables(r, inv_alpha, work):
    """:func:`row_tables` with the moments: :func:`prefix_sums`, :func:`lapsum_at_points` and
    :func:`prefix_moments` in two passes instead of five (the same operations on the same
    values; without the moments, fused passes are slower than the separate ones, so only this
    case is fused).
    """
    n = r.shape[0]
    E = work[0, :n]
    A = work[1, :n]
    B = work[2, :n]
    S = work[3, :n]
    Ad = work[4, :n]
    Bd = work[5, :n]
    A[0] = 1.0
    E[0] = 0.0
    Ad[0] = 0.0
    for i in range(1, n):
        d = gap(r[i], r[i - 1])
        e = math.exp(-d * inv_alpha)
        E[i] = e
        A[i] = 1.0 + e * A[i - 1]
        Ad[i] = e * (Ad[i - 1] + d * inv_alpha * A[i - 1]) if e > 0.0 else 0.0
    B[n - 1] = 1.0
    S[n - 1] = n - 1 + 0.5 + 0.5 * (B[n - 1] - A[n - 1])
    Bd[n - 1] = 0.0
    for i in range(n - 2, -1, -1):
        e = E[i + 1]
        B[i] = 1.0 + e * B[i + 1]
        S[i] = i + 0.5 + 0.5 * (B[i] - A[i])
        Bd[i] = e * (Bd[i + 1] + gap(r[i + 1], r[i]) * inv_alpha * B[i + 1]) if e > 0.0 else 0.0
    return E, A, B, Ad, Bd, S


_F, _B, _I = types.float64, types.boolean, types.int64
_F1, _L1 = types.Array(_F, 1, "C"), types.Array(_I, 1, "C")
#: the helpers of :func:`inverse_pullback`, called by symbol: compiled once, not again inside
#: it (its callers reach it by address, so it registers them itself: :func:`address_only`)
_PULLBACK_CALLS = SymbolCalls(
    # r, inv_alpha, ra, t, shift, c, start, injections up and down
    inject_exact=(inject_exact, (_F1, _F, _F, _F, _F, _F, _I, _F1, _F1)),
    # E, injections up and down, out, fresh_out
    carry_injections=(carry_injections, (_F1, _F1, _F1, _F1, _B)),
)
_call_inject_exact = _PULLBACK_CALLS.inject_exact
_call_carry_injections = _PULLBACK_CALLS.carry_injections


@inner_helper
def target_weights(r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR):
    """The weights of one target (anchor value ``ra``, offset ``t``) on its points ``L`` and
    ``R = L + 1``, for :func:`inverse_pullback` and its specialisations (soft sort's and the
    permutation loss's): ``(how, G, Z, el, er, shift)``. ``aL``, ``adL`` are ``A[L]``,
    ``Ad[L]`` and ``bR``, ``bdR`` are ``B[R]``, ``Bd[R]`` (anything where the point does not
    exist). ``how``: 0, nothing to pull back; 1, inject ``cj * er`` upward at ``R`` and
    ``cj * el`` downward at ``L`` (where they exist); 2, ties or rounding: inject at the two
    points :func:`~softorder.core.kernel_sums.inject_exact` finds.

    The usual target (strictly above its left point, at or below its right one, both finite)
    is written without branches on the side of ``t`` and on which point is nearer (random per
    target, they were mispredicted about twice per target), with the arithmetic of the
    general case: with ``shift = min(zl, -zr)`` one of the two factors ``exp(shift - |z|)``
    is 1 and the other ``exp(-|zl + zr|)``. The other targets take
    :func:`other_target_weights`.
    """
    n = r.shape[0]
    if L >= 0 and R < n:
        zl = offset_z(ra, r[L], inv_alpha, t)
        zr = offset_z(ra, r[R], inv_alpha, t)
        if zl > 0.0 and zl != INF and zr <= 0.0 and zr != -INF:
            e = math.exp(-abs(zl + zr))
            left_nearer = zl <= -zr
            el = 1.0 if left_nearer else e
            er = e if left_nearer else 1.0
            G = aL * el + bR * er
            Z = (zl * aL + adL) * el + (zr * bR - bdR) * er
            return 1, G, Z, el, er, (-zr if -zr < zl else zl)
    return other_target_weights(r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR)


@helper
def other_target_weights(r, inv_alpha, ra, t, L, R, aL, adL, bR, bdR):
    """The weights of the targets other than the usual one: the second half of
    :func:`target_weights` (which calls it), and the ladder pullbacks' rare targets (it tests
    for the usual target itself). A helper, not inlined: compiled once, outside the
    pullbacks' loops. Given a usual target it returns the usual target's values to the bit:
    with ``shift = min(zl, -zr)`` its factors ``exp(shift - |z|)`` are 1 and
    ``exp(-|zl + zr|)`` (``zl - -zr`` rounds as ``zl + zr``), and a term it leaves out for a
    factor of 0 is a zero that leaves the sums unchanged (``tests/test_sort_vjp.py``).
    """
    n = r.shape[0]
    zl = offset_z(ra, r[L], inv_alpha, t) if L >= 0 else INF
    zr = offset_z(ra, r[R], inv_alpha, t) if R < n else -INF
    sh = -zr if -zr < zl else zl  # min(zl, -zr)
    if sh == INF:
        return 0, 0.0, 0.0, 0.0, 0.0, sh
    G = 0.0
    Z = 0.0
    el = rel_weight(zl, sh)
    if el > 0.0:
        G += aL * el
        Z += (zl * aL + adL) * el
    er = rel_weight(zr, sh)
    if er > 0.0:
        G += bR * er
        Z += (zr * bR - bdR) * er
    if G == 0.0:
        return 0, G, Z, el, er, sh
    if (L < 0 or zl > 0.0) and (R >= n or zr <= 0.0):
        # L and R are the last point below the target and the first at or above it: their
        # factors exp(min(0, shift - |z|)) are el and er
        return 1, G, Z, el, er, sh
    return 2, G, Z, el, er, sh


@address_only
@helper
def inverse_pullback(
    r, alpha, tables, anchor, offset, u, rbar, wbar, inj_up, inj_down, want_wbar, fresh_rbar
):
    """Pull a cotangent ``u`` on targets ``b_j = S^-1(w_j)`` back to the sorted row.

    Adds ``sum_j u_j db_j/dr_i`` to ``rbar`` (sorted order, O(n + m)), writes
    ``wbar[j] = u_j db_j/dw_j`` when ``want_wbar`` (soft sort and the permutation boundaries
    discard it: it costs one ``exp`` per target) and returns ``sum_j u_j db_j/dalpha``.
    ``inj_up``, ``inj_down``: scratch of length n. With ``fresh_rbar`` (``rbar`` holds nothing
    yet) ``inj_down`` may be ``rbar`` itself: one row of n less. Targets may come in any order.

    ``db_j/dr_i = exp(shift_j - |b_j - r_i| / alpha) / G_j`` is a Laplace-kernel sum from the
    targets to the points: each target is injected at its two neighbouring points with the
    weights its own sums ``G_j`` already computed, then one scan up and one down carry the
    injections by the factors ``E`` (:func:`~softorder.core.kernel_sums.carry_injections`).
    The sums of :func:`target_sums` are written out in the loop: called per target, passing
    the row's arrays cost their reference counting, several times the arithmetic, inlined
    or not.
    """
    E, A, B, Ad, Bd, S = tables
    n = r.shape[0]
    m = anchor.shape[0]
    inv_alpha = 1.0 / alpha
    inj_up[:] = 0.0
    inj_down[:] = 0.0
    alpha_bar = 0.0
    for j in range(m):
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
        how, G, Z, el, er, sh = target_weights(
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
                inj_up[R] += cj * er
            if L >= 0:
                inj_down[L] += cj * el
        else:
            _call_inject_exact(r, inv_alpha, ra, t, sh, cj, R, inj_up, inj_down)
        if want_wbar:
            wbar[j] = uj * 2.0 * alpha * math.exp(sh) / G
        alpha_bar += uj * Z / G
    _call_carry_injections(E, inj_up, inj_down, rbar, fresh_rbar)
    return alpha_bar


@helper
def inverse_pushforward(
    r, alpha, tables, anchor, offset, worder, rdot, wdot, alpha_dot, out, twork
):
    """Tangent of the targets: ``out[j] = sum_i db_j/dr_i rdot_i + db_j/dw wdot_j + db_j/dalpha
    alpha_dot`` (``rdot`` in sorted order), O(n + m) by one merge.
    ``twork``: (PUSHFORWARD_WORK, >= m).
    """
    E, A, B, Ad, Bd, S = tables
    m = anchor.shape[0]
    inv_alpha = 1.0 / alpha
    shift = twork[0, :m]
    G = twork[1, :m]
    for j in range(m):
        sh, g, Z = target_sums(r, inv_alpha, A, B, Ad, Bd, anchor[j], offset[j])
        out[j] = 0.0
        G[j] = g
        shift[j] = sh
        if g == 0.0 or abs(target_position(r, alpha, anchor[j], offset[j])) == INF:
            G[j] = 0.0
            shift[j] = -INF
            continue
        out[j] = Z / g * alpha_dot
        if wdot[j] != 0.0:
            out[j] += wdot[j] * 2.0 * alpha * math.exp(sh) / g
    acc = twork[2, :m]
    acc[:] = 0.0
    gather_at_targets(r, inv_alpha, E, rdot, anchor, offset, shift, worder, acc)
    for j in range(m):
        if G[j] > 0.0:
            out[j] += acc[j] / G[j]


#: :func:`inverse_kernel`'s per-row helpers called by symbol: compiled once, not linked in and
#: compiled again inside it
_INVERSE_CALLS = SymbolCalls(
    # r, inv_alpha, A, B
    prefix_sums=(prefix_sums_halves, (_F1, _F, _F1, _F1)),
    # r, inv_alpha, A, B, w, worder, anchor, offset (one row's)
    solve=(solve_targets_ab, (_F1, _F, _F1, _F1, _F1, _L1, _L1, _F1)),
)
_call_prefix_sums_halves = _INVERSE_CALLS.prefix_sums
_call_solve_targets = _INVERSE_CALLS.solve


@kernel
def inverse_kernel(xs, alpha, w, worder, out, anchor, offset, work):
    """``out[row, j] = S_row^-1(w[row, j])`` for ``w`` in (0, n); also stores ``(anchor, offset)``.

    ``worder[row]`` sorts ``w[row]`` ascending. O(n + m) per row for sorted targets.
    Soft sort (``w = k - 1/2``) and soft quantile (``w = q n``) are this kernel.
    ``work``: (rows, TABLES, n) scratch.
    """
    rows, n = xs.shape
    m = w.shape[1]
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            for j in range(m):  # (loops: slice assignments compile NumPy's setitem)
                out[row, j] = np.nan
                anchor[row, j] = 0
                offset[row, j] = np.nan
            continue
        a = alpha[row]
        # A and B alone (2 of the 4 rows of ``work``; the GPU twin fills all 4)
        A = work[row, 0, :n]
        B = work[row, 1, :n]
        _call_prefix_sums_halves(r, 1.0 / a, A, B)
        _call_solve_targets(r, 1.0 / a, A, B, w[row], worder[row], anchor[row], offset[row])
        for j in range(w.shape[1]):
            out[row, j] = inverse_position(r, a, anchor[row, j], offset[row, j])


#: the per-row helpers of :func:`sort_kernel`, called by symbol: compiled once, not again inside
#: the kernel (the first call's compilation)
_SORT_CALLS = SymbolCalls(
    # r, inv_alpha, E, A, B
    prefix_sums=(prefix_tables_halves, (_F1, _F, _F1, _F1, _F1)),
    # r, alpha, inv_alpha, E, A, B, w0, anchor, t, out
    solve_ladder=(solve_ladder, (_F1, _F, _F, _F1, _F1, _F1, _F, _L1, _F1, _F1)),
)
_call_prefix_sums = _SORT_CALLS.prefix_sums
_call_solve_ladder = _SORT_CALLS.solve_ladder


@kernel
def sort_kernel(xs, alpha, out, anchor, offset, work):
    """Soft sort: :func:`inverse_kernel` at the targets ``w = k - 1/2`` (k = 1..n), which
    need no array: they are a ladder (:func:`solve_ladder`). ``work``: (rows, SORT_TABLES, n).
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :] = np.nan
            anchor[row, :] = 0
            offset[row, :] = np.nan
            continue
        E = work[row, 0]
        A = work[row, 1]
        B = work[row, 2]
        a = alpha[row]
        _call_prefix_sums(r, 1.0 / a, E, A, B)
        _call_solve_ladder(r, a, 1.0 / a, E, A, B, 0.5, anchor[row], offset[row], out[row])


#: the per-row helpers of :func:`sort_forward`: :func:`sort_kernel`'s, with int32 anchors
_SORT_FORWARD_CALLS = SymbolCalls(
    # r, inv_alpha, E, A, B
    prefix_sums=(prefix_tables_halves, (_F1, _F, _F1, _F1, _F1)),
    # r, alpha, inv_alpha, E, A, B, w0, anchor, t, out
    solve_ladder=(
        solve_ladder,
        (_F1, _F, _F, _F1, _F1, _F1, _F, types.Array(types.int32, 1, "C"), _F1, _F1),
    ),
)
_call_solve_ladder_int32 = _SORT_FORWARD_CALLS.solve_ladder


@kernel
def sort_forward(xs, alpha, out, anchor, offset, work):
    """:func:`sort_kernel` with int32 anchors (rows shorter than 2**31) and ``out`` float32
    or float64 (a float32 input's soft sort is the float64 one rounded once, as the cast
    rounded it): 4 bytes per element less in each, at the forward pass and while the
    gradients keep the anchors. ``work``: (rows, SORT_TABLES, n).
    """
    rows, n = xs.shape
    for row in prange(rows):
        r = xs[row]
        if has_nan(r):
            out[row, :] = np.nan
            anchor[row, :] = 0
            offset[row, :] = np.nan
            continue
        E = work[row, 0]
        A = work[row, 1]
        B = work[row, 2]
        a = alpha[row]
        _call_prefix_sums(r, 1.0 / a, E, A, B)
        an = anchor[row]
        t = offset[row]
        _call_solve_ladder_int32(r, a, 1.0 / a, E, A, B, 0.5, an, t, E[:0])
        o = out[row]
        for q in range(n):  # solve_ladder's pass of positions
            o[q] = target_position(r, a, an[q], t[q])
