"""Compile every kernel ahead of the first call (``softorder.precompile()``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

import numpy as np

#: Every public operation, in the order :func:`precompile` compiles them.
OPERATIONS = (
    "soft_rank",
    "soft_sort",
    "soft_quantile",
    "soft_topk",
    "log_soft_topk",
    "soft_permutation",
    "topk_cross_entropy",
    "permutation_cross_entropy",
)
APIS = ("numpy", "torch", "jax")


def _arguments(name: str, x: np.ndarray) -> tuple:
    """Positional arguments of a small valid call of ``name`` on the input ``x`` (its rows
    along the last axis).
    """
    batch, n = x.shape[:-1], x.shape[-1]
    if name in ("soft_rank", "soft_sort", "soft_permutation"):
        return (x, 0.5)
    if name == "soft_quantile":
        return (x, 0.3, 0.5)
    if name in ("soft_topk", "log_soft_topk"):
        return (x, 2, 0.5)
    if name == "topk_cross_entropy":
        return (x, np.zeros(batch, dtype=np.int64), [0.5, 0.5], 0.5)
    ranks = np.tile(np.arange(1, n + 1), batch + (1,))
    return (x, ranks, 0.5)


#: the helpers of rare paths (ties, rounding) that an operation's VJP calls through a
#: :class:`~softorder.core._jit.CallOnDemand` of :mod:`softorder.core.sort`, which a process
#: compiles when a row first needs one, with the dtypes of the kernels' rows
ON_DEMAND = {
    "soft_sort": (("OTHER_TARGET", "float64"), ("OTHER_TARGET", "float32")),
    "soft_quantile": (("TIE_SEARCH", "float64"),),
    "permutation_cross_entropy": (("OTHER_TARGET", "float64"),),
}


def _numpy(name: str, x: np.ndarray) -> None:
    import softorder

    fn = getattr(softorder, name)
    # (float32 inputs have kernels of their own: the forward and VJP of rank and top-k, and
    # rank's JVP, which reads float32 sorted values)
    for dtype in (np.float64, np.float32):
        xd = x.astype(dtype)
        out, pullback = softorder.vjp(fn, *_arguments(name, xd))
        pullback(np.ones_like(out))
        softorder.jvp(fn, _arguments(name, xd), (np.ones_like(xd),))
        if name in ("soft_topk", "log_soft_topk"):  # several k per row: a VJP kernel of its own
            k = np.tile([1.0, 2.0], (xd.shape[0], 1))
            out, pullback = softorder.vjp(fn, xd, k, 0.5)
            pullback(np.ones_like(out))
        if name == "soft_sort":  # long rows keep no offsets: kernels of their own
            from softorder.core.sort import LEAN_N, SOLVE_AGAIN_N

            # (the longest float32 rows: two rows of scratch, kernels of their own too)
            lengths = (SOLVE_AGAIN_N, LEAN_N) if dtype == np.float32 else (SOLVE_AGAIN_N,)
            for n in lengths:
                row = np.linspace(-1.0, 1.0, n, dtype=dtype)
                out, pullback = softorder.vjp(fn, row, 0.5)
                pullback(np.ones_like(out))


def _host_sort() -> None:
    """The host's sort of inputs too large for NumPy's argsort (precompile's own are small),
    which the host otherwise compiles only once it has sorted enough to pay for it
    (:class:`~softorder._engine.backends.numpy_host.PackedSort`).
    """
    from softorder._engine.backends.numpy_host import PACKED

    PACKED.compile()


def _torch(name: str, x: np.ndarray) -> None:
    import torch

    import softorder.bridges.torch as sot

    xt = torch.from_numpy(x).requires_grad_(True)
    args = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in _arguments(name, x)]
    if name == "topk_cross_entropy":
        args[2] = torch.tensor(args[2])
    out = getattr(sot, name)(xt, *args[1:])
    out.sum().backward()


def _jax(name: str, x: np.ndarray) -> None:
    import jax
    import jax.numpy as jnp

    import softorder.bridges.jax as soj
    from softorder.bridges import _jax_ffi

    _jax_ffi.link_alpha_sums()  # (what a learnable alpha's gradient calls)
    args = [jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in _arguments(name, x)]
    if name == "topk_cross_entropy":
        args[2] = jnp.asarray(args[2])
    fn = getattr(soj, name)
    jax.block_until_ready(jax.jit(jax.grad(lambda u: fn(u, *args[1:]).sum()))(args[0]))


def _names(value, name: str) -> tuple[str, ...]:
    """A name or an iterable of names as a tuple (a bare string is one name, not its letters)."""
    if isinstance(value, str):
        return (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a name or an iterable of names; got {value!r}") from None
    if not all(isinstance(v, str) for v in names):
        raise TypeError(f"{name} must hold names (str); got {names!r}")
    return names


def precompile(
    operations: Iterable[str] | None = None,
    *,
    apis: Iterable[str] = ("numpy",),
    parallel: bool = False,
    progress: bool = True,
) -> dict[str, float]:
    """Compile the kernels of the given operations now, not on their first call.

    Compiled kernels are cached on disk (:func:`softorder.core.cache_dir`), so this is done
    once per installation (or per Docker image, CI cache, ...); later processes load them in
    a fraction of a second. A call that finds them cached only loads them. Each operation runs
    once forward, once backward (VJP) and once forward-mode (JVP) on a small input.

    Parameters
    ----------
    operations : str or iterable of str, optional
        Names of public operations (e.g. ``["soft_rank", "soft_topk"]``); all by default.
    apis : str or iterable of {"numpy", "torch", "jax"}
        Which APIs to run each operation through. The torch bridge uses the NumPy API's
        kernels; the JAX bridge passes read-only arrays, which numba compiles separately.
        Naming ``"torch"`` or ``"jax"`` imports that bridge, and importing a bridge turns
        numba's parallel rows off for the process (:func:`softorder.core.set_parallel`), as
        it does in any program that imports it.
    parallel : bool
        Also compile the multi-threaded variants that large batched calls use (at least
        ``MIN_PARALLEL_ROWS`` rows and ``MIN_PARALLEL_ELEMENTS`` elements, with
        :func:`softorder.core.set_parallel` on); they take about twice as long to compile.
    progress : bool
        Print one line per operation on stderr.

    Returns
    -------
    dict
        Seconds spent on each operation (compiling, or loading from the cache).

    Examples
    --------
    >>> import softorder
    >>> seconds = softorder.precompile(["soft_rank"], progress=False)
    >>> list(seconds)
    ['soft_rank']
    """
    from softorder import core
    from softorder.core import _jit

    names = OPERATIONS if operations is None else _names(operations, "operations")
    unknown = [n for n in names if n not in OPERATIONS]
    if unknown:
        raise ValueError(f"unknown operation(s) {unknown}; expected names from {OPERATIONS}")
    apis = _names(apis, "apis")
    runners = {"numpy": _numpy, "torch": _torch, "jax": _jax}
    bad = [a for a in apis if a not in runners]
    if bad:
        raise ValueError(f"apis must be among {APIS}; got {bad}")
    if progress:
        print(f"softorder.precompile: kernels cached in {core.cache_dir()}", file=sys.stderr)
    _jit._noted[0] = True  # this progress output replaces the first-compilation note
    x = np.random.default_rng(0).standard_normal((2, 8))
    seconds = {}
    for i, name in enumerate(names, 1):
        start = time.perf_counter()
        if i == 1 and ("numpy" in apis or "torch" in apis):
            _host_sort()
        for api in apis:
            runners[api](name, x)
        for helper, key in ON_DEMAND.get(name, ()):
            from softorder.core import sort

            getattr(sort, helper).link(key)
        seconds[name] = time.perf_counter() - start
        if progress:
            print(
                f"softorder.precompile: {name} ({i}/{len(names)}) {seconds[name]:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    if parallel:
        start = time.perf_counter()
        for kernel in core._KERNELS:
            run = getattr(core, kernel)
            signatures = list(run.serial.signatures)
            if signatures:
                variant = run.parallel()
                for signature in signatures:
                    variant.compile(signature)
        seconds["parallel"] = time.perf_counter() - start
        if progress:
            print(
                f"softorder.precompile: parallel variants {seconds['parallel']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return seconds
