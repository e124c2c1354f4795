"""``log`` as the C library computes it, inlined, so that a loop of logs vectorizes.

libm's ``log`` cannot be inlined and keeps a loop that calls it scalar; inside the solve
loops of soft sort and of the permutation boundaries
(:func:`~softorder.core.lapsum.solve_ladder`, ``sort._ladder_values``) its latency added to
the square root's and the division's. Those solvers leave each target's ratio and take the
logs in a pass of their own (:data:`take_logs`), a loop of :func:`log_main` that LLVM
vectorizes (figures in CHANGELOG.md).

:func:`log_main` is glibc's ``log`` (glibc >= 2.28, ``sysdeps/ieee754/dbl-64/e_log.c``, from
ARM's optimized-routines; the variant glibc selects on x86-64 CPUs with FMA and AVX2),
operation for operation and with the fused multiply-adds of that variant's machine code (read
from glibc 2.36's ``libm.so.6``: the compiler contracted most products and sums), so it
returns the same double to the bit for every positive normal ``x`` (:func:`in_range`);
outside that range (0, negative, subnormal, inf, NaN), and on any other platform, callers use
``math.log`` itself. (NumPy's ``np.log`` is not libm's on CPUs with AVX-512: its own SIMD
loop differs from libm in about 1 of 140 random doubles, so ``math.log`` is the reference.)

Two paths: near 1 (``1 - 2^-4 <= x < 1 + 0x1.09p-4``) an 11-coefficient polynomial in
``r = x - 1`` with ``r^2 / 2`` split exactly; elsewhere ``x = 2^k z`` with ``z`` in
``[0x1.6p-1, 0x1.6p0)``, a table of 128 ``(1/c, log c)`` pairs for ``c`` near ``z`` and a
5-coefficient polynomial in ``r = z/c - 1``.

:data:`FAST_LOG` says whether the platform is that one (as
:data:`~softorder.core.fast_exp.FAST_EXP`: Linux, x86-64, glibc >= 2.28, a CPU with FMA and
AVX2) and a sample of inputs agrees with ``math.log`` to the bit; the kernels take
:func:`log_main` only then, so every result stays what ``math.log`` gives.
``tests/test_fast_log.py`` compares the two on millions of inputs where it is on.

The table ``T`` is glibc's ``__log_data.tab`` (read from glibc 2.36's ``libm.so.6``); no
closed form gives it (each ``1/c`` was picked among candidates for the rounding of ``log c``),
so a test checks what the algorithm needs of it instead: ``1/c`` within ``2^-8`` of every
``1/z`` of its subinterval, ``log c = -log(1/c)`` to ``2^-66``, and 11 trailing zero bits in
``log c`` (``k ln2_hi + log c`` is exact).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from llvmlite import ir

from softorder.core._jit import inner_helper
from softorder.core.fast_exp import _constant_table, _f64, _i64, _jit_enabled
from softorder.core.fast_exp import _platform_matches as _fma_platform


def _platform_matches() -> bool:
    """Where libm's ``log`` is the code :func:`log_main` repeats: the platform of
    :func:`~softorder.core.fast_exp.exp_main` (glibc's FMA variants of both came in 2.28).
    """
    return _fma_platform()


#: ``ln 2`` in two parts (``LN2_HI`` has 11 trailing zero bits: ``k LN2_HI`` is exact)
LN2_HI = _f64(0x3FE62E42FEFA3800)
LN2_LO = _f64(0x3D2EF35793C76730)
#: the main path's polynomial for ``log1p(r) - r``, ``|r| < 2^-8``
A0 = _f64(0xBFE0000000000001)
A1 = _f64(0x3FD555555551305B)
A2 = _f64(0xBFCFFFFFFFEB4590)
A3 = _f64(0x3FC999B324F10111)
A4 = _f64(0xBFC55575E506C89F)
#: the polynomial near 1 (``B0 = -1/2``)
B0 = _f64(0xBFE0000000000000)
B1 = _f64(0x3FD5555555555577)
B2 = _f64(0xBFCFFFFFFFFFFDCB)
B3 = _f64(0x3FC999999995DD0C)
B4 = _f64(0xBFC55555556745A7)
B5 = _f64(0x3FC24924A344DE30)
B6 = _f64(0xBFBFFFFFA4423D65)
B7 = _f64(0x3FBC7184282AD6CA)
B8 = _f64(0xBFB999EB43B068FF)
B9 = _f64(0x3FB78182F7AFD085)
B10 = _f64(0xBFB5521375D145CD)
#: the near-1 path: ``NEAR_LO <= x < NEAR_HI``
NEAR_LO = 1.0 - 2.0**-4
NEAR_HI = 1.0 + 0x109 * 2.0**-12
#: the bits of ``0x1.6p-1``: ``x = 2^k z`` with ``z`` in ``[0x1.6p-1, 0x1.6p0)``
OFF = 0x3FE6000000000000
#: ``2^27``: splits ``r`` into a head of 26 bits, whose square is exact, and a tail
SPLIT = 2.0**27
#: the smallest positive normal double: :func:`log_main` is libm's from here to the largest
TINY = 2.0**-1022

#: glibc's table ``__log_data.tab``: ``(1/c, log c)`` for the 128 subintervals of ``z``, 16
#: hex digits per entry
_TABLE_HEX = (
    "3ff734f0c3e0de9fbfd7cc7f79e690003ff713786a2ce91fbfd76feec20d00003ff6f26008fab5a0"
    "bfd713e31351e0003ff6d1a61f138c7dbfd6b85b382878003ff6b1490bc5b4d1bfd65d5590807800"
    "3ff69147332f0cbabfd602d0761800003ff6719f18224223bfd5a8ca869090003ff6524f99a51ed9"
    "bfd54f43560350003ff63356aa8f24c4bfd4f637c36b40003ff614b36b9ddc14bfd49da7fda85000"
    "3ff5f66452c65c4cbfd445923989a8003ff5d867b5912c4fbfd3edf439b0b8003ff5babccb5b90de"
    "bfd396ce448f70003ff59d61f2d91a78bfd3401e17bda0003ff5805612465687bfd2e9e2ef468000"
    "3ff56397cee76bd3bfd2941b3830e0003ff54725e2a77f93bfd23ec58cda88003ff52aff42064583"
    "bfd1e9e1292790003ff50f22dbb2bddfbfd1956d2b48f8003ff4f38f4734ded7bfd141679ab9f800"
    "3ff4d843cfde2840bfd0edd094ef98003ff4bd3ec078a3c8bfd09aa518db10003ff4a27fc3e0258a"
    "bfd047e65263b8003ff4880524d48434bfcfeb224586f0003ff46dce1b192d0bbfcf474a7517b000"
    "3ff453d9d3391854bfcea4443d1030003ff43a2744b4845abfce020d44e9b0003ff420b54115f8fb"
    "bfcd60a22977f0003ff40782da3ef4b1bfccc001049590003ff3ee8f5d57fe8fbfcc202956891000"
    "3ff3d5d9a00b4ce9bfcb81178d8110003ff3bd60c010c12bbfcae2c9ccd3d0003ff3a5242b75dab8"
    "bfca45402e1290003ff38d22cd9fd002bfc9a877681df0003ff3755bc5847a1cbfc90c6d69483000"
    "3ff35dce49ad36e2bfc87120a645c0003ff34679984dd440bfc7d68fb41430003ff32f5cceffcb24"
    "bfc73cb83c6270003ff3187775a10d49bfc6a39a9b3760003ff301c8373e3990bfc60b3154b7a000"
    "3ff2eb4ebb95f841bfc5737d762430003ff2d50a0219a9d1bfc4dc7b8fc230003ff2bef9a8b7fd2a"
    "bfc4462c51d200003ff2a91c7a0c1babbfc3b08abc8300003ff293726014b530bfc31b996b490000"
    "3ff27dfa5757a1f5bfc2875490a440003ff268b39b1d3bbfbfc1f3b9f879a0003ff2539d838ff5bd"
    "bfc160c8252ca0003ff23eb7aac9083bbfc0ce7f57f720003ff22a012ba940b6bfc03cdc49fea000"
    "3ff2157996cc4132bfbf57bdbc4b80003ff201201dd2fc9bbfbe3708964040003ff1ecf4494d480b"
    "bfbd17983ef940003ff1d8f5528f6569bfbbf9674ed8a0003ff1c52311577e7cbfbadc79202f6000"
    "3ff1b17c74cb26e9bfb9c0c3e72880003ff19e010c2c1ab6bfb8a646b372c0003ff18ab07bb670bd"
    "bfb78d01b3ac00003ff1778a25efbcb6bfb674f1453800003ff1648d354c31dabfb55e0e6d878000"
    "3ff151b990275fddbfb4485cdea1e0003ff13f0ea432d24cbfb333d94d6aa0003ff12c8b7210f9da"
    "bfb22079f8c560003ff11a3028ecb531bfb10e46986220003ff107fbda8434afbfaffa6c6ad20000"
    "3ff0f5ee0f4e6bb3bfadda8d4a7740003ff0e4065d2a9fcebfabbcece48500003ff0d244632ca521"
    "bfa9a1894012c0003ff0c0a77ce2981abfa788583302c0003ff0af2f83c636d1bfa5715e67d68000"
    "3ff09ddb98a01339bfa35c8a496580003ff08cabaf52e7dfbfa149e3641540003ff07b9f2f4e28fb"
    "bf9e72c082eb80003ff06ab58c358f19bf9a55f1525280003ff059eea5ecf92cbf963d62cf818000"
    "3ff04949cdd12c90bf9228fb8caa00003ff038c6c6f0ada9bf8c317b20f900003ff02865137932a9"
    "bf8419355daa00003ff0182427ea7348bf781203c2ec00003ff008040614b195bf60040979240000"
    "3fefe01ff726fa1a3f6feff3849000003fefa11cc261ea743f87dc41353d00003fef6310b081992e"
    "3f93cea3c4c280003fef25f63ceeadcd3f9b9fc1148900003feee9c8039113e73fa1b0d8ce110000"
    "3feeae8078cbb1ab3fa58a5bd001c0003fee741aa29d0c9b3fa95c8340d880003fee3a91830a99b5"
    "3fad276aef5780003fee01e009609a563fb07598e598c0003fedca01e577bb983fb253f5e30d2000"
    "3fed92f20b7c91033fb42edd8b3800003fed5cac66fb5cce3fb606598757c0003fed272caa5ede9d"
    "3fb7da76356a00003fecf26e3e6b2ccd3fb9ab434e1c60003fecbe6da2a779023fbb78c7bb0d6000"
    "3fec8b266d37086d3fbd431332e720003fec5894bd5d58043fbf0a3171de60003fec26b533bb9f8c"
    "3fc067152b9140003febf583eeece73f3fc147858292b0003febc4fd75db96c13fc2266ecdca3000"
    "3feb951e0c864a283fc303d7a6c550003feb65e2c5ef3e2c3fc3dfc33c3310003feb374867c9888b"
    "3fc4ba366b7a80003feb094b211d304a3fc5933928d1f0003feadbe885f2ef7e3fc66acd2418f000"
    "3feaaf1d31603da23fc740f8ec6690003fea82e63fd358a73fc815c0f51af0003fea5740ef09738b"
    "3fc8e92954f680003fea2c2a90ab4b273fc9bb3602f840003fea01a01393f2d13fca8bed1c2c0000"
    "3fe9d79f24db3c1b3fcb5b515c01d0003fe9ae2505c7b1903fcc2967ccbcc0003fe9852ef297ce2f"
    "3fccf635d54860003fe95cbaeea44b753fcdc1bd3446c0003fe934c69de748383fce8c01b8cfe000"
    "3fe90d4f2f6752e63fcf5509c01790003fe8e6528effd79d3fd00e6c121fb8003fe8bfce9fcc007c"
    "3fd071b80e93d0003fe899c0dabec30e3fd0d46b9e8670003fe87427aa2317fb3fd13687334bd000"
    "3fe84f00acb39a083fd1980d672348003fe82a49e8653e553fd1f8ffe0cc80003fe8060195f40260"
    "3fd2595fd76368003fe7e22563e0a3293fd2b9300914a8003fe7beb377dcb5ad3fd3187210436000"
    "3fe79baa679725c23fd377266dec18003fe77907f21706573fd3d54ffbaf30003fe756cadbd6130c"
    "3fd432eee32fe000"
)
#: the table as float64: ``T[2 i]`` is ``1/c``, ``T[2 i + 1]`` is ``log c``
T = np.frombuffer(bytes.fromhex("".join(_TABLE_HEX)), ">u8").astype(np.uint64).view(np.float64)


def _emit_log(builder, x):
    """Emit the operations of glibc's ``log(x)`` (both paths, then a select) as LLVM IR: the
    same as :func:`_reference`, operation for operation.
    """
    d = ir.DoubleType()
    i64 = ir.IntType(64)
    module = builder.module
    fma_fn = module.declare_intrinsic("llvm.fma", [d], ir.FunctionType(d, [d, d, d]))

    def c(value):
        return ir.Constant(d, value)

    def fma(a, b, addend):
        return builder.call(fma_fn, [a, b, addend])

    add, sub, mul = builder.fadd, builder.fsub, builder.fmul
    # near 1: a polynomial in r = x - 1, and r - r^2/2 exactly from a 26-bit head of r
    r = sub(x, c(1.0))
    r2 = mul(r, r)
    r3 = mul(r, r2)
    p = fma(
        r3,
        fma(r3, c(B10), fma(r2, c(B9), fma(r, c(B8), c(B7)))),
        fma(r2, c(B6), fma(r, c(B5), c(B4))),
    )
    p = fma(p, r3, fma(r2, c(B3), fma(r, c(B2), c(B1))))
    rhi = fma(builder.fneg(r), c(SPLIT), fma(r, c(SPLIT), r))
    rlo = sub(r, rhi)
    rhi2 = mul(rhi, rhi)
    hi = fma(rhi2, c(B0), r)
    lo = fma(rhi2, c(B0), sub(r, hi))
    lo = fma(mul(c(B0), rlo), add(r, rhi), lo)
    near = add(hi, fma(p, r3, lo))
    # elsewhere: x = 2^k z, log x = k ln 2 + log c + log1p(z/c - 1), (1/c, log c) from T
    ix = builder.bitcast(x, i64)
    tmp = builder.sub(ix, ir.Constant(i64, OFF))
    i = builder.shl(
        builder.and_(builder.ashr(tmp, ir.Constant(i64, 45)), ir.Constant(i64, 127)),
        ir.Constant(i64, 1),
    )
    k = builder.ashr(tmp, ir.Constant(i64, 52))
    z = builder.bitcast(builder.sub(ix, builder.shl(k, ir.Constant(i64, 52))), d)
    kd = builder.sitofp(k, d)
    table = _table(module)
    zero = ir.Constant(i64, 0)
    invc = builder.load(builder.gep(table, [zero, i], inbounds=True))
    logc = builder.load(
        builder.gep(table, [zero, builder.or_(i, ir.Constant(i64, 1))], inbounds=True)
    )
    r = fma(z, invc, c(-1.0))
    w = fma(kd, c(LN2_HI), logc)
    hi = add(w, r)
    lo = fma(kd, c(LN2_LO), add(sub(w, hi), r))
    r2 = mul(r, r)
    p = fma(r2, fma(r, c(A4), c(A3)), fma(r, c(A2), c(A1)))
    far = add(fma(mul(r, r2), p, fma(r2, c(A0), lo)), hi)
    is_near = builder.and_(
        builder.fcmp_ordered(">=", x, c(NEAR_LO)), builder.fcmp_ordered("<", x, c(NEAR_HI))
    )
    return builder.select(is_near, near, far)


_T_VALUES = [float(v) for v in T]


def _table(module):
    """:data:`T` as a constant of the LLVM module."""
    return _constant_table(module, "softorder.fast_log.T", ir.DoubleType(), _T_VALUES)


if _jit_enabled():
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def log_main(typingctx, x):
        """The ``log(x)`` of glibc for positive normal ``x`` (:func:`in_range`); any double
        (no trap, no error) elsewhere, where callers take ``math.log``. Both paths and a
        select, no branch, so that a loop of it vectorizes. Emitted as LLVM IR in place
        (:func:`_emit_log`): the same operations as an inlined Python helper took numba
        longer to compile in every caller, on first calls that have little room.
        """
        if x != types.float64:
            return None

        def codegen(context, builder, signature, args):
            return _emit_log(builder, args[0])

        return types.float64(types.float64), codegen

    @intrinsic
    def _logs_where_marked(typingctx, marks, t):
        """:func:`take_logs` where :data:`FAST_LOG`: its loop emitted as LLVM IR, which LLVM
        vectorizes (numba's own loop of the same operations compiled again in each solver
        that inlined it).
        """
        if not (
            isinstance(marks, types.Array)
            and isinstance(marks.dtype, types.Integer)
            and marks.dtype.signed
            and marks.ndim == 1
            and isinstance(t, types.Array)
            and t.dtype == types.float64
            and t.ndim == 1
            and t.mutable
            and marks.mutable
        ):
            return None

        def codegen(context, builder, signature, args):
            kinds = signature.args
            arrays = [
                context.make_array(kind)(context, builder, value)
                for kind, value in zip(kinds, args, strict=True)
            ]
            count = builder.extract_value(arrays[0].shape, 0)
            zero = ir.Constant(arrays[0].data.type.pointee, 0)
            minus_one = ir.Constant(arrays[0].data.type.pointee, -1)
            with cgutils.for_range(builder, count) as loop:
                at_mark, at_t = (
                    cgutils.get_item_pointer2(
                        context,
                        builder,
                        array.data,
                        cgutils.unpack_tuple(builder, array.shape),
                        cgutils.unpack_tuple(builder, array.strides),
                        kind.layout,
                        [loop.index],
                    )
                    for array, kind in zip(arrays, kinds, strict=True)
                )
                mark = builder.load(at_mark)
                x = builder.load(at_t)
                usual = builder.icmp_signed(">=", mark, zero)
                builder.store(builder.select(usual, _emit_log(builder, x), x), at_t)
                builder.store(builder.select(usual, mark, builder.sub(minus_one, mark)), at_mark)
            return context.get_dummy_value()

        return types.none(marks, t), codegen

else:  # pragma: no cover - NUMBA_DISABLE_JIT: FAST_LOG is off, these are never called

    def log_main(x):
        """:func:`_reference` (NUMBA_DISABLE_JIT)."""
        return _reference(x)

    def _logs_where_marked(marks, t):
        """Never called (NUMBA_DISABLE_JIT)."""
        raise NotImplementedError("softorder: fast_log needs numba's JIT")


@inner_helper
def in_range(x):
    """Whether :func:`log_main` is ``math.log`` at ``x``: ``x`` positive, normal and finite
    (NaN: no).
    """
    return x >= TINY and x < math.inf


@inner_helper
def log(x):
    """``math.log(x)``, the same value: :func:`log_main` in its range where :data:`FAST_LOG`
    (inlined, no call), else ``math.log``.
    """
    if FAST_LOG and in_range(x):
        return log_main(x)
    return math.log(x)


def _reference(x: float) -> float:
    """:func:`log_main` in Python, with exact fused multiply-adds (for the self-check)."""

    def fma(a, b, c):
        return float(Fraction(a) * Fraction(b) + Fraction(c))

    if NEAR_LO <= x < NEAR_HI:
        r = x - 1.0
        r2 = r * r
        r3 = r * r2
        p = fma(r3, fma(r3, B10, fma(r2, B9, fma(r, B8, B7))), fma(r2, B6, fma(r, B5, B4)))
        p = fma(p, r3, fma(r2, B3, fma(r, B2, B1)))
        rhi = fma(-r, SPLIT, fma(r, SPLIT, r))
        rlo = r - rhi
        rhi2 = rhi * rhi
        hi = fma(rhi2, B0, r)
        lo = fma(rhi2, B0, r - hi)
        lo = fma(B0 * rlo, r + rhi, lo)
        return hi + fma(p, r3, lo)
    ix = _i64(x)
    tmp = ix - OFF
    i = 2 * ((tmp >> 45) & 127)
    k = tmp >> 52
    z = _f64((ix - (k << 52)) % 2**64)
    kd = float(k)
    invc, logc = float(T[i]), float(T[i + 1])
    r = fma(z, invc, -1.0)
    w = fma(kd, LN2_HI, logc)
    hi = w + r
    lo = fma(kd, LN2_LO, w - hi + r)
    r2 = r * r
    p = fma(r2, fma(r, A4, A3), fma(r, A2, A1))
    return fma(r * r2, p, fma(r2, A0, lo)) + hi


#: inputs of the self-check: both paths, the table's two ends and an entry of each binade
#: half, the smallest and largest normals
_SAMPLE = (
    TINY,
    3.7e-200,
    1e-10,
    0.0123,
    0.5,
    0.6875,
    0.7,
    0.9,
    NEAR_LO,
    0.97,
    0.999999,
    1.0,
    1.0 + 2.0**-52,
    1.000001,
    1.03,
    1.0646,
    NEAR_HI,
    1.2,
    1.374,
    1.5,
    2.0,
    3.0,
    12345.678,
    1e100,
    1.7976931348623157e308,
)


def _agrees() -> bool:
    return all(_reference(x) == math.log(x) for x in _SAMPLE)


#: whether the kernels take :func:`log_main` for ``math.log`` (see the module's docstring)
FAST_LOG = _jit_enabled() and _platform_matches() and _agrees()


def _logs_of_libm(marks, t):
    for q in range(marks.shape[0]):
        m = marks[q]
        if m >= 0:
            t[q] = math.log(t[q])
        else:
            marks[q] = -1 - m


#: ``take_logs(marks, t)``: ``t[q] = log(t[q])`` (libm's value) where ``marks[q] >= 0``, and
#: ``marks[q] = -1 - marks[q]`` elsewhere (both 1-d, ``marks`` signed integers, ``t``
#: float64; the ``t[q]`` of a marked slot is kept). The ladder solvers
#: (:func:`~softorder.core.lapsum.solve_ladder`) leave each usual target's anchor and ratio,
#: and the anchor ``-1 - anchor`` beside the final offset of the others, and take the logs
#: here in a pass of their own. Where :data:`FAST_LOG`, :func:`log_main` for every slot and a
#: select, a loop LLVM vectorizes (libm's ``log`` inside the solve loop added its latency
#: to the square root's and the division's): the
#: solvers mark a ratio outside :func:`in_range` and take its ``math.log`` themselves (never
#: seen: ``A, B >= 1`` and ``E >= SMALL_E`` keep the ratios in ``[1e-160, 1e160]``). Else
#: libm's loop.
take_logs = _logs_where_marked if FAST_LOG else inner_helper(_logs_of_libm)
