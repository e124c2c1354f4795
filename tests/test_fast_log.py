"""``fast_log.log_main`` is libm's ``log`` to the bit for every positive normal double wherever
the kernels use it (``FAST_LOG``), its table is what the algorithm needs, the gate falls back
to ``math.log`` elsewhere, and the solvers' log pass (``fast_log.take_logs``) gives libm's
values whichever variant the gate picks."""

import math
import platform
from decimal import Decimal, localcontext

import numpy as np
import pytest

from softorder.core import fast_log
from softorder.core.laplace import INF

TINY = 2.0**-1022
MAX = np.finfo(np.float64).max


@pytest.fixture(scope="module")
def compiled():
    import numba

    @numba.njit
    def run(x, main, gated, libm, inside):
        for i in range(x.shape[0]):
            main[i] = fast_log.log_main(x[i])
            gated[i] = fast_log.log(x[i])
            libm[i] = math.log(x[i])
            inside[i] = fast_log.in_range(x[i])

    return run


def _evaluate(compiled, x):
    main, gated, libm = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    inside = np.zeros(x.shape, bool)
    compiled(x, main, gated, libm, inside)
    return main, gated, libm, inside


def _edges():
    """The paths' and the table's boundaries and their neighbours, powers of 2, 1 and its
    neighbours, the normal range's ends."""
    points = [1.0, TINY, MAX, fast_log.NEAR_LO, fast_log.NEAR_HI, 0.5, 2.0, 3.0, 0.1]
    points += [2.0**k for k in range(-1022, 1024, 7)]
    points += [0x16 * 2.0 ** (k - 5) for k in range(-1000, 1000, 13)]  # 0x1.6p(k-1): z's ends
    # the table's subintervals: z = 0x1.6p-1 + i 2^-8 (below 1) or 1 + (i - 80) 2^-7 (above)
    points += [0.6875 + i * 2.0**-8 for i in range(80)] + [1.0 + i * 2.0**-7 for i in range(48)]
    out = []
    for p in points:
        out += [p, math.nextafter(p, 0.0), math.nextafter(p, INF)]
    out += [1.0 + k * 2.0**-52 for k in range(-8, 9)]
    x = np.array(out)
    return x[(x >= TINY) & (x <= MAX)]


def _inputs(rng, size):
    bits = rng.integers(0x0010000000000000, 0x7FF0000000000000, size, dtype=np.int64)
    return np.concatenate(
        [
            _edges(),
            rng.uniform(0.0, 3.0, size),
            rng.uniform(0.9, 1.1, size),
            1.0 + rng.uniform(-1.0, 1.0, size) * 10.0 ** rng.uniform(-17.0, -1.0, size),
            10.0 ** rng.uniform(-307.0, 308.0, size),
            bits.view(np.float64),
        ]
    )


def test_table_is_what_the_algorithm_needs():
    """Every ``1/c`` is within ``2^-8`` of ``1/z`` across its subinterval (``|z/c - 1| <
    2^-8``, the polynomial's range), ``log c = -log(1/c)`` to ``2^-66``, and ``log c`` and
    ``LN2_HI`` end in 11 zero bits (``k LN2_HI + log c`` is exact)."""
    assert fast_log.T.shape == (256,)
    bits = fast_log.T.view(np.int64)
    low_bits = (1 << 11) - 1
    assert np.all(bits[1::2] & low_bits == 0)
    assert fast_log._i64(fast_log.LN2_HI) & low_bits == 0
    with localcontext() as ctx:
        ctx.prec = 60
        for i in range(128):
            invc, logc = float(fast_log.T[2 * i]), float(fast_log.T[2 * i + 1])
            start = fast_log.OFF + (i << 45)
            for z in (fast_log._f64(start), fast_log._f64(start + (1 << 45))):
                assert abs(Decimal(z) * Decimal(invc) - 1) < Decimal(2) ** -8
            assert abs(Decimal(logc) + Decimal(invc).ln()) < Decimal(2) ** -66
    assert float(Decimal(fast_log.LN2_HI) + Decimal(fast_log.LN2_LO)) == math.log(2.0)


def test_in_range(rng, compiled):
    x = np.concatenate([_inputs(rng, 1000), [0.0, -0.0, -1.0, -INF, INF, np.nan, 5e-324, TINY]])
    x = np.concatenate([x, [math.nextafter(TINY, 0.0), -TINY]])
    _, _, _, inside = _evaluate(compiled, x)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(inside, (x >= TINY) & (x < INF))


@pytest.mark.skipif(not fast_log.FAST_LOG, reason="libm's log is not glibc's FMA variant here")
def test_log_main_is_libm_log_to_the_bit(rng, compiled):
    for _ in range(4):
        x = _inputs(rng, 1_000_000)
        main, gated, libm, inside = _evaluate(compiled, x)
        assert inside.all()
        np.testing.assert_array_equal(main.view(np.int64), libm.view(np.int64))
        np.testing.assert_array_equal(gated.view(np.int64), libm.view(np.int64))
    # libm's log is Python's: the compiled math.log above is that function
    sample = x[:: x.shape[0] // 2000]
    want = np.array([math.log(v) for v in sample])
    np.testing.assert_array_equal(libm[:: x.shape[0] // 2000].view(np.int64), want.view(np.int64))


def test_log_is_math_log_outside_the_range(compiled):
    """0, negatives, subnormals, infinities and NaN take ``math.log`` itself."""
    below = math.nextafter(TINY, 0.0)
    x = np.array([0.0, -0.0, -1.0, -TINY, -INF, INF, np.nan, 5e-324, 1e-310, below])
    with np.errstate(invalid="ignore", divide="ignore"):
        _, gated, libm, inside = _evaluate(compiled, x)
    assert not inside.any()
    np.testing.assert_array_equal(gated.view(np.int64), libm.view(np.int64))
    assert gated[0] == -INF and gated[5] == INF and np.isnan(gated[2])
    assert gated[7] == math.log(5e-324)


@pytest.mark.skipif(not fast_log.FAST_LOG, reason="libm's log is not glibc's FMA variant here")
def test_reference_is_log_main(rng, compiled):
    """The Python model of the self-check computes what the compiled intrinsic computes."""
    x = np.concatenate([_edges()[::9], _inputs(rng, 20)[-100:]])
    main, _, _, _ = _evaluate(compiled, x)
    for xi, mi in zip(x, main, strict=True):
        assert fast_log._reference(float(xi)) == mi


def test_gate_needs_the_platform_and_agreement(monkeypatch):
    """Off Linux, off glibc, or with a table that disagrees with ``math.log``, the gate is off
    (the kernels then call libm)."""
    expected = fast_log._jit_enabled() and fast_log._platform_matches() and fast_log._agrees()
    assert fast_log.FAST_LOG == expected
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert not fast_log._platform_matches()
    monkeypatch.undo()
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("musl", "1.2"))
    assert not fast_log._platform_matches()
    monkeypatch.undo()
    if not fast_log.FAST_LOG:
        return
    assert fast_log._agrees()
    table = fast_log.T.copy()
    table[2 * 80 + 1] += 1e-12  # the log c of z just above 1 (x = 2 in the sample)
    monkeypatch.setattr(fast_log, "T", table)
    assert not fast_log._agrees()


@pytest.fixture(scope="module")
def log_passes():
    import numba

    def inlined(marks, t):
        fast_log._logs_where_marked(marks, t)

    return numba.njit(inlined), numba.njit(fast_log._logs_of_libm)


@pytest.mark.parametrize("kind", [np.int32, np.int64])
@pytest.mark.parametrize("step", [1, 3])
def test_take_logs_variants_agree(rng, log_passes, kind, step):
    """Both variants of the solvers' log pass: libm's log of the ratios (mark >= 0), the
    final offsets kept and their anchors decoded (mark < 0), to the bit, on contiguous and
    strided rows; the gate picks the inlined one exactly where ``FAST_LOG``."""
    if fast_log.FAST_LOG:
        assert fast_log.take_logs is fast_log._logs_where_marked
    else:
        assert fast_log.take_logs.py_func is fast_log._logs_of_libm
    n = 5001
    anchor = rng.integers(0, n, n).astype(kind)
    final = rng.random(n) < 0.2
    anchor[final] = -1 - anchor[final]
    t = np.where(final, rng.normal(size=n) * 1e3, 10.0 ** rng.uniform(-160, 160, n))
    t[final & (rng.random(n) < 0.3)] = -INF
    t[:50] = 1.0 + rng.uniform(-0.07, 0.07, 50)
    want_anchor = np.where(anchor < 0, -1 - anchor, anchor)
    want_t = np.array([ti if a < 0 else math.log(ti) for a, ti in zip(anchor, t, strict=True)])
    for run in log_passes:
        a, v = anchor.copy(), t.copy()
        run(a[::step], v[::step])
        np.testing.assert_array_equal(a[::step], want_anchor[::step])
        np.testing.assert_array_equal(v[::step].view(np.int64), want_t[::step].view(np.int64))
        # the slots between the strided ones are untouched
        untouched = np.ones(n, bool)
        untouched[::step] = False
        np.testing.assert_array_equal(a[untouched], anchor[untouched])
        np.testing.assert_array_equal(v[untouched].view(np.int64), t[untouched].view(np.int64))
