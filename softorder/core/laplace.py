"""Scalar functions of the standard Laplace distribution, in numerically stable forms.

``z`` is always a standardized distance ``(b - r) / alpha``. Infinite ``z`` are legal: they
come from infinite entries and give the limits (``cdf(-inf) = 0``, ``cdf(inf) = 1``).
"""

from __future__ import annotations

import math

from softorder.core._jit import helper

LOG_HALF = math.log(0.5)
INF = math.inf


@helper
def gap(hi, lo):
    """``hi - lo`` for ``hi >= lo``, but 0 for equal values, including equal infinities."""
    if hi == lo:
        return 0.0
    return hi - lo


@helper
def offset_z(r_anchor, r_i, inv_alpha, t):
    """Standardized distance ``(b - r_i) / alpha`` of a target ``b = r_anchor + alpha * t``.

    Working from the anchor keeps ``t`` exact when ``b`` is huge and makes equal infinite
    values tie (distance 0). When an infinite distance meets an infinite offset of the other
    sign, the distance between the points wins (the target sits in the gap between them).
    """
    d = gap(r_anchor, r_i) if r_anchor >= r_i else -gap(r_i, r_anchor)
    z = d * inv_alpha + t
    if z != z:  # inf - inf
        return d * inv_alpha
    return z


@helper
def cdf(z):
    """Laplace CDF ``F(z)``."""
    if z <= 0.0:
        return 0.5 * math.exp(z)
    return 1.0 - 0.5 * math.exp(-z)


@helper
def log_cdf(z):
    """``log F(z)`` without underflow for very negative ``z``."""
    if z <= 0.0:
        return LOG_HALF + z
    return math.log1p(-0.5 * math.exp(-z))


@helper
def hazard(z):
    """``f(z) / F(z)``: the closed form of ``d log F / dz``, never a ratio of underflows."""
    if z <= 0.0:
        return 1.0
    e = 0.5 * math.exp(-z)
    return e / (1.0 - e)


@helper
def shifted_hazard(z, shift):
    """``hazard(z) * exp(shift)`` for ``shift <= |z|``, folded so that it overflows only when the
    product itself does (``exp(shift)`` alone overflows for well-separated values).
    """
    if z <= 0.0:
        return math.exp(shift)
    return 0.5 * math.exp(shift - z) / (1.0 - 0.5 * math.exp(-z))


@helper
def log_density(z):
    """``log f(z) = log(1/2) - |z|``."""
    return LOG_HALF - abs(z)


@helper
def cdf_diff(z0, z1):
    """``F(z1) - F(z0)`` for ``z0 <= z1`` without cancellation."""
    if z0 == z1:
        return 0.0
    if z1 <= 0.0:
        return 0.5 * math.exp(z1) * -math.expm1(z0 - z1)
    if z0 >= 0.0:
        return 0.5 * math.exp(-z0) * -math.expm1(z0 - z1)
    return 1.0 - 0.5 * math.exp(z0) - 0.5 * math.exp(-z1)


@helper
def rel_weight(z, shift):
    """``exp(shift - |z|)``: a Laplace weight relative to the nearest point (0 at infinity)."""
    a = abs(z)
    if a == INF:
        return 0.0
    if a == shift:  # the nearest point itself: exp(0), without the call
        return 1.0
    return math.exp(shift - a)


@helper
def exp_nonpositive(x):
    """``exp(min(0, x))``; 1 at 0 without calling ``exp`` (half the factors of a merge are the
    nearest point's, exactly 0 from it).
    """
    if x >= 0.0:
        return 1.0
    return math.exp(x)


@helper
def logaddexp(a, b):
    """``log(exp(a) + exp(b))``."""
    m = b if b > a else a
    if m == -INF:
        return -INF
    return m + math.log1p(math.exp(-abs(a - b)))
