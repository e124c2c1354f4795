"""``exp`` as the C library computes it, inlined, so that loops of independent ``exp`` vectorize.

A loop that calls libm's ``exp`` per element cannot be vectorized: the membership passes of
top-k and the decays of the gradients' Lap-sum tables spent most of their time there.
:func:`exp_main` is the main path of glibc's ``exp`` (glibc >= 2.28,
``sysdeps/ieee754/dbl-64/e_exp.c``, the variant glibc selects on x86-64 CPUs with FMA and
AVX2), operation for operation and with the same fused multiply-adds, so it returns the same
double to the bit for ``2^-54 <= |x| < 512``; inlined into a loop, LLVM vectorizes it, at a
fraction of a call's cost per element (CHANGELOG.md). Outside that range, and on any other
platform, callers use ``math.exp`` itself.

:data:`FAST_EXP` says whether the platform is that one (Linux, x86-64, glibc >= 2.28, a CPU
with FMA and AVX2) and a sample of inputs agrees with ``math.exp`` to the bit; the kernels
take the vectorized path only then, so every result stays what ``math.exp`` gives.
``tests/test_fast_exp.py`` compares the two on millions of inputs where it is on.

The table ``T`` (``2^(k/128)`` as a head and a relative tail) is glibc's ``__exp_data.tab``;
:func:`table` computes it from its definition (a test compares the two).
"""

from __future__ import annotations

import math
import platform
import struct
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
from llvmlite import ir

from softorder.core._jit import inner_helper


def _f64(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _i64(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


#: glibc's constants (``__exp_data``): N / ln 2 with N = 128, -ln 2 / N in two parts, the
#: polynomial's coefficients, and the shift 0x1.8p52 that rounds to an integer
INV_LN2_N = _f64(0x40671547652B82FE)
NEG_LN2_HI_N = _f64(0xBF762E42FEFA0000)
NEG_LN2_LO_N = _f64(0xBD0CF79ABC9E3B3A)
C2 = _f64(0x3FDFFFFFFFFFFDBD)
C3 = _f64(0x3FC555555555543C)
C4 = _f64(0x3FA55555CF172B91)
C5 = _f64(0x3F81111167A4D017)
SHIFT = _f64(0x4338000000000000)
#: the main path's range: 2^-54 <= |x| < 512
TINY = 2.0**-54
LARGE = 512.0
#: below this ``math.exp`` is 0 (its least positive value is at -745.13...)
UNDERFLOW = -746.0


def table() -> np.ndarray:
    """The table of glibc's ``exp``, computed: ``T[2k]`` the tail ``(2^(k/N) - H) / H`` and
    ``T[2k + 1]`` the bits of the head ``H = 2^(k/N)`` rounded, less ``k << 45`` (the
    exponent the index adds back); 60-digit decimals, rounded once.
    """
    tab = np.empty(256, np.int64)
    with localcontext() as ctx:
        ctx.prec = 60
        ln2 = Decimal(2).ln()
        for k in range(128):
            exact = (ln2 * k / 128).exp()
            head = float(exact)
            tab[2 * k] = _i64(float((exact - Decimal(head)) / Decimal(head)))
            tab[2 * k + 1] = _i64(head) - (k << 45)
    return tab


#: glibc's table ``__exp_data.tab``, 16 hex digits per entry (:func:`table` computes it; a
#: test compares the two)
_TABLE_HEX = (
    "00000000000000003ff00000000000003c9b3b4f1a88bf6e3feff63da9fb3335bc7160139cd8dc5d"
    "3fefec9a3e778061bc905e7a108766d13fefe315e86e7f853c8cd2523567f6133fefd9b0d3158574"
    "bc8bce8023f98efa3fefd06b29ddf6de3c60f74e61e6c8613fefc74518759bc83c90a3e45b33d399"
    "3fefbe3ecac6f3833c979aa65d837b6d3fefb5586cf9890f3c8eb51a92fdeffc3fefac922b7247f7"
    "3c3ebe3d702f9cd13fefa3ec32d3d1a2bc6a033489906e0b3fef9b66affed31bbc9556522a2fbd0e"
    "3fef9301d0125b51bc5080ef8c4eea553fef8abdc06c31ccbc91c923b9d5f4163fef829aaea92de0"
    "3c80d3e3e95c55af3fef7a98c8a58e51bc801b15eaa593483fef72b83c7d517bbc8f1ff055de323d"
    "3fef6af9388c8dea3c8b898c3f1353bf3fef635beb6fcb75bc96d99c7611eb263fef5be084045cd4"
    "3c9aecf73e3a2f603fef54873168b9aabc8fe782cb86389d3fef4d5022fcd91d3c8a6f4144a6c38d"
    "3fef463b88628cd63c807a05b0e4047d3fef3f49917ddc963c968efde3a8a8943fef387a6e756238"
    "3c875e18f274487d3fef31ce4fb2a63f3c80472b981fe7f23fef2b4565e27cddbc96b87b3f71085e"
    "3fef24dfe1f563813c82f7e16d09ab313fef1e9df51fdee1bc3d219b1a6fbffa3fef187fd0dad990"
    "3c8b3782720c0ab43fef1285a6e4030b3c6e149289cecb8f3fef0cafa93e2f563c834d754db0abb6"
    "3fef06fe0a31b7153c864201e2ac744c3fef0170fc4cd8313c8fdd395dd3f84a3feefc08b26416ff"
    "bc86a3803b8e5b043feef6c55f929ff1bc924aedcc4b50683feef1a7373aa9cbbc9907f81b512d8e"
    "3feeecae6d05d866bc71d1e83e9436d23feee7db34e59ff7bc991919b3ce1b153feee32dc313a8e5"
    "3c859f48a72a4c6d3feedea64c123422bc9312607a28698a3feeda4504ac801cbc58a78f4817895b"
    "3feed60a21f72e2abc7c2c9b67499a1b3feed1f5d950a8973c4363ed60c2ac113feece086061892d"
    "3c9666093b0664ef3feeca41ed1d00573c6ecce1daa103793feec6a2b5c13cd03c93ff8e3f0f1230"
    "3feec32af0d7d3de3c7690cebb7aafb03feebfdad5362a273c931dbdeb54e0773feebcb299fddd0d"
    "bc8f94340071a38e3feeb9b2769d2ca7bc87deccdc93a3493feeb6daa2cf6642bc78dec6bd0f385f"
    "3feeb42b569d4f82bc861246ec7b5cf63feeb1a4ca5d920f3c93350518fdd78e3feeaf4736b527da"
    "3c7b98b72f8a9b053feead12d497c7fd3c9063e1e21c54093feeab07dd4854293c34c7855019c6ea"
    "3feea9268a5946b73c9432e62b64c0353feea76f15ad2148bc8ce44a6199769f3feea5e1b976dc09"
    "bc8c33c53bef4da83feea47eb03a5585bc845378892be9ae3feea34634ccc320bc93cedd78565858"
    "3feea238825522253c5710aa807e19643feea155d44ca973bc93b3efbf5e22283feea09e667f3bcd"
    "bc6a12ad8734b9823feea012750bdabfbc6367efb86da9ee3fee9fb23c651a2fbc80dc3d54e08851"
    "3fee9f7df9519484bc781f647e5a3ecf3fee9f75e8ec5f74bc86ee4ac08b7db03fee9f9a48a58174"
    "bc8619321e55e68a3fee9feb564267c93c909ccb5e09d4d33feea0694fde5d3fbc7b32dcb94da51d"
    "3feea11473eb01873c94ecfd5467c06b3feea1ed0130c1323c65ebe1abd66c553feea2f336cf4e62"
    "bc88a1c52fb3cf423feea427543e1a12bc9369b6f13b37343feea589994cce13bc805e843a19ff1e"
    "3feea71a4623c7adbc94d450d872576e3feea8d99b4492ed3c90ad675b0e8a003feeaac7d98a6699"
    "3c8db72fc1f0eab43feeace5422aa0dbbc65b6609cc5e7ff3feeaf3216b5448c3c7bf68359f35f44"
    "3feeb1ae99157736bc93091fa71e3d833feeb45b0b91ffc6bc5da9b88b6c1e293feeb737b0cdc5e5"
    "bc6c23f97c90b9593feeba44cbc8520fbc92434322f4f9aa3feebd829fde4e50bc85ca6cd7668e4b"
    "3feec0f170ca07ba3c71affc2b91ce273feec49182a3f0903c6dd235e10a73bb3feec86319e32323"
    "bc87c504226222633feecc667b5de5653c8b1c86e3e231d53feed09bec4a2d33bc91bbd1d3bcbb15"
    "3feed503b23e255d3c90cc319cee31d23feed99e1330b3583c8469846e735ab33feede6b5579fdbf"
    "bc82dfcd978e9db43feee36bbfd3f37a3c8c1a7792cb33873feee89f995ad3adbc907b8f4ad1d9fa"
    "3feeee07298db666bc55c3d956dcaeba3feef3a2b84f15fbbc90a40e3da6f6403feef9728de5593a"
    "bc68d6f438ad93343feeff76f2fb5e47bc91eee26b588a353fef05b030a1064a3c74ffd70a5fddcd"
    "3fef0c1e904bc1d2bc91bdfbfa9298ac3fef12c25bd71e093c736eae30af0cb33fef199bdd85529c"
    "3c8ee3325c9ffd943fef20ab5fffd07a3c84e08fd10959ac3fef27f12e57d14b3c63cdaf384e1a67"
    "3fef2f6d9406e7b53c676b2c6c9219683fef3720dcef9069bc808a1883ccb5d23fef3f0b555dc3fa"
    "bc8fad5d3ffffa6f3fef472d4a07897cbc900dae3875a9493fef4f87080d89f23c74a385a63d07a7"
    "3fef5818dcfba487bc82919e2040220f3fef60e316c983983c8e5a50d5c192ac3fef69e603db3285"
    "3c843a59ac016b4b3fef7321f301b460bc82d52107b43e1f3fef7c97337b9b5fbc892ab93b470dc9"
    "3fef864614f5a1293c74b604603a88d33fef902ee78b3ff63c83c5ec519d72713fef9a51fbc74c83"
    "bc8ff7128fd391f03fefa4afa2a490dabc8dae98e223747d3fefaf482d8e67f13c8ec3bc41aa2008"
    "3fefba1bee615a273c842b94c3a9eb323fefc52b376bba973c8a64a931d185ee3fefd0765b6e4540"
    "bc8e37bae43be3ed3fefdbfdad9cbe143c77893b4d91cd9d3fefe7c1819e90d83c5305c14160cc89"
    "3feff3c22b8f71f1"
)
#: the table as int64 (the kernels' bit patterns)
T = np.frombuffer(bytes.fromhex("".join(_TABLE_HEX)), ">u8").astype(np.uint64).view(np.int64)


def _jit_enabled() -> bool:
    import numba

    return not numba.config.DISABLE_JIT


def _reference(x: float) -> float:
    """:func:`exp_main` in Python, with exact fused multiply-adds: its operations in order
    (the compiled :func:`exp_main` emits them as LLVM instructions; a test compares the two).
    """

    def fma(a, b, c):
        return float(Fraction(a) * Fraction(b) + Fraction(c))

    kd = fma(x, INV_LN2_N, SHIFT)
    ki = _i64(kd)
    kd = kd - SHIFT
    r = fma(kd, NEG_LN2_LO_N, fma(kd, NEG_LN2_HI_N, x))
    idx = 2 * (ki & 127)
    p1 = fma(r, C3, C2)
    tail_r = r + _f64(int(T[idx]) % 2**64)
    sbits = (int(T[idx + 1]) + (ki << 45)) % 2**64
    r2 = r * r
    p2 = fma(r, C5, C4)
    tmp = fma(r2 * r2, p2, fma(p1, r2, tail_r))
    scale = _f64(sbits)
    return fma(scale, tmp, scale)


def _emit_exp(builder, x):
    """Emit the operations of :func:`_reference` (glibc's ``exp`` main path) as LLVM IR, in
    order, its fused multiply-adds as ``llvm.fma``.
    """
    d, i64 = ir.DoubleType(), ir.IntType(64)
    fma_fn = builder.module.declare_intrinsic("llvm.fma", [d], ir.FunctionType(d, [d, d, d]))

    def c(value):
        return ir.Constant(d, value)

    def fma(a, b, addend):
        return builder.call(fma_fn, [a, b, addend])

    def entry(index):
        at = builder.gep(_table(builder.module), [ir.Constant(i64, 0), index], inbounds=True)
        return builder.load(at)

    kd = fma(x, c(INV_LN2_N), c(SHIFT))
    ki = builder.bitcast(kd, i64)
    kd = builder.fsub(kd, c(SHIFT))
    r = fma(kd, c(NEG_LN2_LO_N), fma(kd, c(NEG_LN2_HI_N), x))
    idx = builder.shl(builder.and_(ki, ir.Constant(i64, 127)), ir.Constant(i64, 1))
    p1 = fma(r, c(C3), c(C2))
    tail_r = builder.fadd(r, builder.bitcast(entry(idx), d))
    head = entry(builder.or_(idx, ir.Constant(i64, 1)))
    sbits = builder.add(head, builder.shl(ki, ir.Constant(i64, 45)))
    r2 = builder.fmul(r, r)
    p2 = fma(r, c(C5), c(C4))
    tmp = fma(builder.fmul(r2, r2), p2, fma(p1, r2, tail_r))
    scale = builder.bitcast(sbits, d)
    return fma(scale, tmp, scale)


def _constant_table(module, name: str, element: ir.Type, values: list) -> ir.GlobalVariable:
    """``values`` (Python numbers) as a constant array of ``element`` in the LLVM ``module``,
    named ``name``: made once per module, for the intrinsics that read a table.
    """
    table = module.globals.get(name)
    if table is None:
        kind = ir.ArrayType(element, len(values))
        table = ir.GlobalVariable(module, kind, name)
        table.linkage = "internal"
        table.global_constant = True
        table.initializer = ir.Constant(kind, values)
    return table


_T_WORDS = [int(v) for v in T]


def _table(module):
    """:data:`T` as a constant of the LLVM module."""
    return _constant_table(module, "softorder.fast_exp.T", ir.IntType(64), _T_WORDS)


if _jit_enabled():
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def exp_main(typingctx, x):
        """The ``exp(x)`` of glibc for ``2^-54 <= |x| < 512`` (:func:`in_range`); any double
        (no trap, no error) elsewhere, where callers take ``math.exp``. Emitted as LLVM IR in
        place (:func:`_emit_exp`): the same operations as an inlined Python helper took numba
        longer to compile in every caller.

        Examples
        --------
        >>> import numba
        >>> from softorder.core.fast_exp import exp_main
        >>> numba.njit(lambda x: exp_main(x))(1.0)
        2.718281828459045
        """
        if x != types.float64:
            return None

        def codegen(context, builder, signature, args):
            return _emit_exp(builder, args[0])

        return types.float64(types.float64), codegen

else:  # pragma: no cover - NUMBA_DISABLE_JIT: FAST_EXP is off, never called by the kernels

    def exp_main(x):
        """:func:`_reference` (NUMBA_DISABLE_JIT)."""
        return _reference(x)


@inner_helper
def in_range(x):
    """Whether :func:`exp_main` is ``math.exp`` at ``x`` (NaN: no)."""
    a = abs(x)
    return a >= TINY and a < LARGE


@inner_helper
def exp_or_zero(x):
    """:func:`exp_main` at ``x``, or ``math.exp``'s 0 below :data:`UNDERFLOW`: ``math.exp``'s
    value wherever :func:`needs_libm` is false. Computed at every ``x``, then a select: a loop
    of it vectorizes (the passes that take libm's ``exp`` where ``needs_libm`` come after).

    Examples
    --------
    >>> import numba
    >>> from softorder.core.fast_exp import exp_or_zero
    >>> f = numba.njit(lambda x: exp_or_zero(x))  # (compiled code only: an inlined helper)
    >>> f(0.0), f(-800.0)
    (1.0, 0.0)
    """
    e = exp_main(x)
    return 0.0 if x < UNDERFLOW else e


@inner_helper
def needs_libm(x):
    """Whether ``math.exp(x)`` is neither :func:`exp_or_zero`'s value nor 1 at ``x = 0``
    (``exp_main`` is 1 there exactly): NaN, a tiny ``|x|``, or ``x`` between ``UNDERFLOW`` and
    the main path's range.

    Examples
    --------
    >>> import numba
    >>> from softorder.core.fast_exp import needs_libm
    >>> f = numba.njit(lambda x: needs_libm(x))  # (compiled code only: an inlined helper)
    >>> [f(x) for x in (-1.0, -600.0, -800.0, 1e-20)]
    [False, True, False, True]
    """
    return x != 0.0 and not (in_range(x) or x < UNDERFLOW)


@inner_helper
def exp(x):
    """``math.exp(x)``, the same value: :func:`exp_main` in its range where :data:`FAST_EXP`
    (no call: inlined beside a recurrence, its operations overlap the recurrence's), 0 below
    :data:`UNDERFLOW`, else ``math.exp``.
    """
    if FAST_EXP and in_range(x):
        return exp_main(x)
    if x < UNDERFLOW:
        return 0.0  # (math.exp's value, without the call)
    return math.exp(x)


if _jit_enabled():

    @intrinsic
    def exp_emitted(typingctx, x):
        """:func:`exp` emitted as LLVM IR in place, the same branches and operations: an
        inlined helper is typed and lowered again in every caller (about a tenth of a second
        per call site on a first call), an intrinsic is not.

        Examples
        --------
        >>> import math, numba
        >>> from softorder.core.fast_exp import exp_emitted
        >>> f = numba.njit(lambda x: exp_emitted(x))
        >>> [f(x) == math.exp(x) for x in (-1.0, 1e-20, -800.0, 3.0)]
        [True, True, True, True]
        """
        if x != types.float64:
            return None

        def codegen(context, builder, signature, args):
            (value,) = args
            d = ir.DoubleType()
            function = builder.function
            fast = function.append_basic_block("exp.fast")
            slow = function.append_basic_block("exp.slow")
            libm = function.append_basic_block("exp.libm")
            done = function.append_basic_block("exp.done")
            if FAST_EXP:  # in_range: TINY <= |x| < LARGE (NaN: no)
                fabs = builder.module.declare_intrinsic("llvm.fabs", [d])
                a = builder.call(fabs, [value])
                inside = builder.and_(
                    builder.fcmp_ordered(">=", a, ir.Constant(d, TINY)),
                    builder.fcmp_ordered("<", a, ir.Constant(d, LARGE)),
                )
                builder.cbranch(inside, fast, slow)
            else:
                builder.branch(fast)  # (unreachable below: fast is left at once)
            builder.position_at_end(fast)
            if FAST_EXP:
                fast_value = _emit_exp(builder, value)
                fast_end = builder.block
                builder.branch(done)
            else:
                builder.branch(slow)
            builder.position_at_end(slow)
            below = builder.fcmp_ordered("<", value, ir.Constant(d, UNDERFLOW))
            builder.cbranch(below, done, libm)
            builder.position_at_end(libm)
            exp_of = context.get_function(math.exp, types.float64(types.float64))
            libm_value = exp_of(builder, [value])
            libm_end = builder.block
            builder.branch(done)
            builder.position_at_end(done)
            out = builder.phi(d)
            if FAST_EXP:
                out.add_incoming(fast_value, fast_end)
            out.add_incoming(ir.Constant(d, 0.0), slow)
            out.add_incoming(libm_value, libm_end)
            return out

        return types.float64(types.float64), codegen

else:  # pragma: no cover - NUMBA_DISABLE_JIT
    exp_emitted = exp


def _platform_matches() -> bool:
    """Linux on x86-64 with glibc >= 2.28 and a CPU with FMA and AVX2: where libm's ``exp`` is
    the code :func:`exp_main` repeats.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return False
    try:
        major, minor = (int(v) for v in version.split(".")[:2])
    except ValueError:
        return False
    if (major, minor) < (2, 28):
        return False
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
    except Exception:  # pragma: no cover - llvmlite without the query
        return False
    return bool(features.get("fma")) and bool(features.get("avx2"))


#: inputs of the self-check: both signs, several binades of the main range, the table's ends
_SAMPLE = (
    -511.9,
    -300.25,
    -37.5,
    -1.0,
    -0.693147,
    -0.1,
    -1e-3,
    -3e-9,
    -(2.0**-53),
    2.0**-53,
    1e-5,
    0.3,
    2.5,
    88.7,
    500.0,
)


def _agrees() -> bool:
    return all(_reference(x) == math.exp(x) for x in _SAMPLE)


#: whether the kernels take :func:`exp_main` for ``math.exp`` (see the module's docstring)
FAST_EXP = _jit_enabled() and _platform_matches() and _agrees()
