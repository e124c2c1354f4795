"""``fast_exp.exp_main`` is libm's ``exp`` to the bit in its range wherever the kernels use it
(``FAST_EXP``), and the top-k passes built on it give the values of the plain loops they
replace: far elements, ties, huge values and infinite distances included."""

import math

import numpy as np
import pytest

from softorder.core import fast_exp, topk
from softorder.core.laplace import INF, cdf


def test_table_is_its_definition():
    np.testing.assert_array_equal(fast_exp.table(), fast_exp.T)


@pytest.fixture(scope="module")
def compiled():
    import numba

    @numba.njit
    def run(x, main, libm, inside):
        for i in range(x.shape[0]):
            main[i] = fast_exp.exp_main(x[i])
            libm[i] = math.exp(x[i])
            inside[i] = fast_exp.in_range(x[i])

    return run


def _inputs(rng, size):
    special = [0.0, -0.0, INF, -INF, np.nan, 512.0, -512.0, 2.0**-54, -(2.0**-54), 1e-300]
    special += [np.nextafter(512.0, 0.0), -np.nextafter(512.0, 0.0), 709.78, -708.4, -745.1]
    return np.concatenate(
        [
            np.array(special),
            rng.uniform(-520.0, 0.0, size),
            rng.uniform(-60.0, 0.0, size),
            rng.uniform(-1.0, 1.0, size) * 10.0 ** rng.uniform(-18.0, 2.7, size),
        ]
    )


def test_in_range(rng, compiled):
    x = _inputs(rng, 1000)
    main, libm, inside = np.empty_like(x), np.empty_like(x), np.zeros(x.shape, bool)
    compiled(x, main, libm, inside)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(inside, (np.abs(x) >= 2.0**-54) & (np.abs(x) < 512.0))


def _libm_exp(v):
    try:
        return math.exp(v)
    except OverflowError:
        return INF


def test_exp_emitted_is_exp_to_the_bit(rng):
    """The intrinsic ``exp_emitted`` (LLVM IR in place) gives ``exp``'s and ``math.exp``'s
    value everywhere: its main path, tiny and huge arguments, underflow, NaN and infinities."""
    import numba

    @numba.njit
    def run(x, emitted, inlined):
        for i in range(x.shape[0]):
            emitted[i] = fast_exp.exp_emitted(x[i])
            inlined[i] = fast_exp.exp(x[i])

    more = [-746.0, np.nextafter(-746.0, 0.0), -800.0, 710.0, 1e308, -1e308, 5e-324, -5e-324]
    x = np.concatenate([_inputs(rng, 100_000), more, rng.uniform(-800.0, 720.0, 100_000)])
    emitted, inlined = np.empty_like(x), np.empty_like(x)
    run(x, emitted, inlined)
    libm = np.array([_libm_exp(v) for v in x])
    np.testing.assert_array_equal(emitted.view(np.int64), inlined.view(np.int64))
    np.testing.assert_array_equal(emitted.view(np.int64), libm.view(np.int64))


@pytest.mark.skipif(not fast_exp.FAST_EXP, reason="libm's exp is not glibc's FMA variant here")
def test_exp_main_is_libm_exp_to_the_bit(rng, compiled):
    for _ in range(5):
        x = _inputs(rng, 1_000_000)
        main, libm, inside = np.empty_like(x), np.empty_like(x), np.zeros(x.shape, bool)
        compiled(x, main, libm, inside)
        np.testing.assert_array_equal(main[inside].view(np.int64), libm[inside].view(np.int64))


@pytest.mark.skipif(not fast_exp.FAST_EXP, reason="libm's exp is not glibc's FMA variant here")
def test_reference_is_exp_main(rng, compiled):
    """The Python model of the self-check computes what the compiled helper computes."""
    x = _inputs(rng, 30)
    x = x[(np.abs(x) >= 2.0**-54) & (np.abs(x) < 512.0)]
    main, libm, inside = np.empty_like(x), np.empty_like(x), np.zeros(x.shape, bool)
    compiled(x, main, libm, inside)
    for xi, mi in zip(x, main, strict=True):
        assert fast_exp._reference(float(xi)) == mi


@pytest.mark.skipif(not fast_exp.FAST_EXP, reason="libm's exp is not glibc's FMA variant here")
def test_exp_or_zero_is_libm_exp_where_no_call_is_needed(rng):
    """Wherever ``needs_libm`` is false (the main path's range, below UNDERFLOW, 0), the
    vectorized passes' ``exp_or_zero`` is ``math.exp`` to the bit; where it is true, the
    passes call libm."""
    import numba

    @numba.njit
    def run(x, value, needs):
        for i in range(x.shape[0]):
            value[i] = fast_exp.exp_or_zero(x[i])
            needs[i] = fast_exp.needs_libm(x[i])

    x = np.concatenate([_inputs(rng, 100_000), rng.uniform(-1e4, -500.0, 100_000)])
    x = np.concatenate([x, [-746.0, np.nextafter(-746.0, 0.0), -745.2, -1e308]])
    value, needs = np.empty_like(x), np.zeros(x.shape, bool)
    run(x, value, needs)
    with np.errstate(over="ignore"):
        libm = np.array([math.exp(v) if v < 709.0 else INF for v in x])
    assert needs.any() and (~needs).any() and (x < fast_exp.UNDERFLOW).any()
    np.testing.assert_array_equal(value[~needs].view(np.int64), libm[~needs].view(np.int64))
    with np.errstate(invalid="ignore"):
        want = (x != 0.0) & ~((np.abs(x) >= 2.0**-54) & (np.abs(x) < 512.0)) & ~(x < -746.0)
    np.testing.assert_array_equal(needs, want)


@pytest.fixture(scope="module")
def passes():
    import numba

    @numba.njit
    def run(r, ra, t, inv_alpha, shift, out):
        topk._exp_pass(r, ra, t, inv_alpha, 0.0, out[0])
        topk._exp_pass(r, ra, t, inv_alpha, shift, out[1])

    return run


@pytest.mark.parametrize("scale", [1.0, 1e3, 1e306])
def test_passes_are_their_plain_loops(rng, passes, scale):
    """The forward's ``exp(-|z|)`` (through ``cdf``) and the VJPs' weights against their
    plain expressions, on rows whose far elements (|z| >= 512), ties and overflowing
    distances take the second pass."""
    for n in [1, 2, 3, 17, 1000]:
        for alpha in [1e-3, 0.1, 7.0]:
            r = np.sort(rng.normal(size=n)) * scale
            if n > 4:
                r[2] = r[1]
            anchor = int(rng.integers(0, n))
            t = float(rng.choice([0.0, -0.0, 0.4, -0.25]))
            inv_alpha = 1.0 / alpha
            ra = float(r[anchor])
            z = np.array([topk.finite_z.py_func(float(ra), float(ri), inv_alpha, t) for ri in r])
            shift = float(np.min(np.abs(z)))
            out = np.full((2, n), np.nan)
            passes(r, ra, t, inv_alpha, shift, out)
            # the forward's exp(-|z|), from which it forms cdf(z) (compared through cdf)
            half = 0.5 * out[0]
            got_cdf = np.where(z > 0.0, 1.0 - half, half)
            want_cdf = np.array([cdf.py_func(zi) for zi in z])
            az = np.abs(z)
            want_w = np.array(
                [0.0 if a == INF else 1.0 if a == shift else math.exp(shift - a) for a in az]
            )
            np.testing.assert_array_equal(got_cdf.view(np.int64), want_cdf.view(np.int64))
            np.testing.assert_array_equal(out[1].view(np.int64), want_w.view(np.int64))
