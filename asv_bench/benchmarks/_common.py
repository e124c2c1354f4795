"""Shared data, parameter grids and base classes of the softorder asv suite.

Everything here starts with an underscore or is a plain function/constant, so asv's
discovery (which skips names starting with ``_``) never collects the base classes
themselves, only the subclasses defined in the family modules.

Conventions of the suite
------------------------
* ``setup()`` builds seeded data (:func:`make_input`), calls the operation once forward and
  once forward + backward (numba compiles or loads its kernels, JAX traces and compiles, torch
  allocates its caches), and raises ``NotImplementedError`` when a framework, bridge or peer
  is not installed or a size is out of a method's reach: asv reports that benchmark as
  skipped.
* The timed bodies only call the operation (and, for ``forward_backward``, its gradient with a
  fixed random cotangent). JAX results are blocked on.
* ``peakmem_*`` is asv's peak resident memory of the whole benchmark process, so it includes
  the imported frameworks and the input; ``asv_bench/plot.py`` measures the extra peak of one
  call instead.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import numpy as np

#: Row lengths of the scaling benchmarks.
N_VALUES = (100, 1_000, 10_000, 100_000, 1_000_000)
#: Input kinds: standard normal, sorted, reversed, ~100 copies of each value, gaps of 1000 alpha.
KINDS = ("random", "sorted", "reversed", "ties", "separated")
#: Batch shapes of the batched benchmarks ("1" is one row; "16x16" two batch axes).
BATCHES = ("1", "256", "16x16")
#: Row lengths of the batched benchmarks.
BATCH_N = (1_000,)
DTYPES = ("float32", "float64")
#: The Laplace scale used throughout (data are standard normal).
ALPHA = 0.1
#: torchsort's regularization strength on the same data (ott-jax runs with its defaults).
PEER_STRENGTH = 0.1
#: O(n^2) (or worse) peers are skipped above this row length.
QUADRATIC_MAX_N = 1_000
#: Iterative (Sinkhorn) peers are skipped above this row length.
SINKHORN_MAX_N = 100_000
SEED = 20250713

# With ``asv run --launch-method=forkserver`` the suite is imported once and every benchmark
# process is forked from it: import the heavy modules here so that forks do not pay for them.
# Nothing is run: numba's OpenMP threading layer (started by softorder's first kernel call)
# and JAX's threads do not survive a fork.
for _name in ("softorder", "torch"):
    try:
        importlib.import_module(_name)
    except ImportError:
        pass


def top_k(n: int) -> int:
    """The k of the top-k benchmarks: a tenth of the row (at least 1)."""
    return max(1, n // 10)


def batch_shape(batch: str) -> tuple[int, ...]:
    """``"16x16"`` -> ``(16, 16)``; ``"1"`` -> ``()`` (a single row)."""
    if batch == "1":
        return ()
    return tuple(int(s) for s in batch.split("x"))


def make_input(kind: str, shape: tuple[int, ...], dtype="float64", seed: int = SEED) -> np.ndarray:
    """Seeded input of the given kind; rows along the last axis."""
    rng = np.random.default_rng(seed)
    n = shape[-1]
    if kind == "random":
        x = rng.standard_normal(shape)
    elif kind == "sorted":
        x = np.sort(rng.standard_normal(shape), axis=-1)
    elif kind == "reversed":
        x = np.sort(rng.standard_normal(shape), axis=-1)[..., ::-1]
    elif kind == "ties":
        x = rng.integers(0, max(2, n // 100), size=shape).astype(np.float64)
    elif kind == "separated":
        base = np.broadcast_to(np.arange(n, dtype=np.float64) * (1000 * ALPHA), shape)
        x = rng.permuted(base, axis=-1)
    else:
        raise ValueError(f"unknown input kind {kind!r}")
    return np.ascontiguousarray(x, dtype=dtype)


def cotangent_like(y, seed: int = SEED + 1) -> np.ndarray:
    """A fixed random cotangent with the shape and dtype of the NumPy array ``y``."""
    rng = np.random.default_rng(seed)
    return np.asarray(rng.standard_normal(np.shape(y)), dtype=np.asarray(y).dtype)


def require(module: str):
    """Import ``module`` or skip the benchmark (asv's way: ``NotImplementedError``).

    Skipped: a module that is not installed (a peer, a framework, or a bridge that does not
    exist yet), including a softorder bridge whose framework is missing. An error: a softorder
    module that exists and fails for another reason (a missing softorder module it imports,
    or any other exception). A peer that fails to import for any reason (a broken optional
    install) is skipped, and its import-time warnings (deprecations of its own dependencies)
    are silenced: they are not ours to fix.
    """
    ours = module.startswith("softorder")
    try:
        if ours:
            return importlib.import_module(module)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        missing_is_ours = missing == "softorder" or missing.startswith("softorder.")
        if module == missing or module.startswith(missing + ".") or not missing_is_ours:
            raise NotImplementedError(f"{module} is not available: {exc}") from exc
        raise
    except Exception as exc:
        if ours:
            raise
        raise NotImplementedError(f"{module} is not available: {exc}") from exc


def torch():
    """The torch module, or skip."""
    return require("torch")


def jax():
    """The jax module, or skip."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return require("jax")


def compile_host_sort() -> None:
    """Compile (or load) softorder's packed host sort, which a process otherwise compiles only
    once its sorts have paid for it: the suite times a process in its steady state, as
    ``softorder.precompile()`` leaves it (versions before that policy compiled it on their
    first long sort; their ``_host_sort`` is that sort). Nothing without softorder.
    """
    try:
        from softorder._precompile import _host_sort
    except ImportError:
        return
    _host_sort()


class _Base:
    """What every benchmark class shares: few repeats, and ``prepare`` for ``setup``."""

    #: A single call can take seconds at n = 1e6 (peers); keep asv's repeats few.
    timeout = 600
    repeat = (1, 5, 20.0)

    def prepare(self, forward, forward_backward=None):
        """Keep the callables and run each once (compilation, caches)."""
        compile_host_sort()
        self.forward = forward
        self.forward_backward = forward_backward
        forward()
        if forward_backward is not None:
            forward_backward()


class _Forward(_Base):
    """Forward-only benchmarks (the hard floors, and peers without a working backward)."""

    def time_forward(self, *params):
        self.forward()

    def peakmem_forward(self, *params):
        self.forward()


class _Benchmark(_Base):
    """Differentiable operations: forward time, forward + backward time and peak memory."""

    def time_forward(self, *params):
        self.forward()

    def time_forward_backward(self, *params):
        self.forward_backward()

    def peakmem_forward_backward(self, *params):
        self.forward_backward()

    def track_extra_peak_memory_ratio(self, *params):
        """Extra peak resident memory of one forward + backward call, in units of the input's
        bytes (:func:`extra_peak_ratio`): what ``peakmem_`` hides under the whole process.
        """
        nbytes = getattr(self, "input_nbytes", None)
        if not nbytes:
            raise NotImplementedError("no input size recorded for this benchmark")
        return extra_peak_ratio(self.forward_backward, nbytes)

    track_extra_peak_memory_ratio.unit = "input bytes"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def extra_peak_ratio(call, input_nbytes: int) -> float:
    """Peak resident memory of one ``call()`` above the resident memory just before it, divided
    by ``input_nbytes``.

    Linux only (the peak is reset through ``/proc/self/clear_refs``); elsewhere the benchmark
    is skipped. glibc's mmap threshold is fixed first (it otherwise rises after large arrays
    are freed, and a later call silently reuses resident heap pages), then one call returns
    the heap it would reuse before the measured one.
    """
    import ctypes
    import gc

    if not os.path.exists("/proc/self/clear_refs"):
        raise NotImplementedError("extra peak memory needs Linux /proc/self/clear_refs")
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 131072)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: measured as is
    call()
    drop_softorder_scratch()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    call()
    return max(0, _status_kib("VmHWM") - before) * 1024 / input_nbytes


def drop_softorder_scratch() -> None:
    """Free the kernel scratch softorder keeps for its next call (``set_scratch_limit``), so
    that a measured call counts the scratch it takes.
    """
    limit = getattr(sys.modules.get("softorder"), "set_scratch_limit", None)
    if limit is not None:
        limit(limit(0))


class _NumpyOp(_Benchmark):
    """A softorder NumPy operation: forward, and forward + VJP with ``softorder.vjp``."""

    def prepare_op(self, fn, args, kwargs):
        import softorder

        self.input_nbytes = np.asarray(args[0]).nbytes
        out = fn(*args, **kwargs)
        cotangent = cotangent_like(out)

        def forward():
            return fn(*args, **kwargs)

        def forward_backward():
            _, pullback = softorder.vjp(fn, *args, **kwargs)
            return pullback(cotangent)

        self.prepare(forward, forward_backward)


class _TorchOp(_Benchmark):
    """A torch function of one tensor ``x`` (plus fixed extra arguments).

    ``forward`` runs under ``torch.no_grad()``; ``forward_backward`` computes the gradient of
    ``<cotangent, f(x)>`` in ``x`` with ``torch.autograd.grad`` (nothing accumulates).
    """

    def prepare_torch(self, fn, x: np.ndarray):
        torch_ = torch()
        self.input_nbytes = x.nbytes
        xt = torch_.from_numpy(np.ascontiguousarray(x))
        xg = xt.clone().requires_grad_(True)
        with torch_.no_grad():
            out = fn(xt)
        cotangent = torch_.from_numpy(cotangent_like(out.numpy()))

        def forward():
            with torch_.no_grad():
                return fn(xt)

        def forward_backward():
            y = fn(xg)
            return torch_.autograd.grad(y, xg, cotangent)

        self.prepare(forward, forward_backward)


def _jax_callables(fn, x: np.ndarray):
    """``jax.jit`` of ``fn`` and of its VJP with a fixed random cotangent, blocking."""
    jax_ = jax()
    if x.dtype == np.float64 and not jax_.config.jax_enable_x64:
        # Switching x64 on here would change every later JAX computation of the process
        # (the test suite's too): float64 JAX benchmarks need JAX_ENABLE_X64=1.
        raise NotImplementedError("float64 JAX benchmarks need JAX_ENABLE_X64=1")
    xj = jax_.numpy.asarray(x)
    fwd = jax_.jit(fn)
    out = fwd(xj)
    cotangent = jax_.numpy.asarray(cotangent_like(np.asarray(out)))

    @jax_.jit
    def fwd_bwd(x, v):
        _, pullback = jax_.vjp(fn, x)
        return pullback(v)

    def forward():
        return jax_.block_until_ready(fwd(xj))

    def forward_backward():
        return jax_.block_until_ready(fwd_bwd(xj, cotangent))

    return forward, forward_backward


class _JaxOp(_Benchmark):
    """A JAX function of one array ``x``: ``jax.jit`` of the function and of its VJP."""

    def prepare_jax(self, fn, x: np.ndarray):
        self.input_nbytes = x.nbytes
        self.prepare(*_jax_callables(fn, x))


class _JaxForwardOp(_Forward):
    """A JAX function of one array ``x`` that is only timed forward (``jax.jit``)."""

    def prepare_jax(self, fn, x: np.ndarray):
        forward, _ = _jax_callables(fn, x)
        self.prepare(forward)


def skip_above(n: int, limit: int, why: str):
    """Skip sizes a method cannot reach in reasonable time or memory."""
    if n > limit:
        raise NotImplementedError(f"n = {n} > {limit}: {why}")


class _SoftorderOp(_NumpyOp):
    """``softorder.<op>(x, *extra_args(n), alpha=ALPHA)``: subclasses name ``op``."""

    #: The name of the softorder function.
    op = ""

    def extra_args(self, n: int) -> tuple:
        """Arguments after ``x`` for a row of length ``n`` (none by default)."""
        return ()

    def prepare_softorder(self, x: np.ndarray):
        fn = getattr(require("softorder"), self.op)
        self.prepare_op(fn, (x, *self.extra_args(x.shape[-1])), {"alpha": ALPHA})


class _SoftorderRow(_SoftorderOp):
    """One row of standard normal data, every size and dtype."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        self.prepare_softorder(make_input("random", (n,), dtype))


class _SoftorderInputs(_SoftorderOp):
    """One float64 row of each input kind."""

    params = ((1_000, 100_000), KINDS)
    param_names = ("n", "kind")

    def setup(self, n, kind):
        self.prepare_softorder(make_input(kind, (n,)))


class _SoftorderBatched(_SoftorderOp):
    """Along the last axis of a batch (rows run in parallel)."""

    params = (BATCHES, BATCH_N, DTYPES)
    param_names = ("batch", "n", "dtype")

    def setup(self, batch, n, dtype):
        self.prepare_softorder(make_input("random", batch_shape(batch) + (n,), dtype))


class _TorchBridgeRow(_TorchOp):
    """``softorder.bridges.torch.<op>(t, *extra_args(n), ALPHA)`` of one row.

    NumPy arrays among the extra arguments are passed as tensors.
    """

    op = ""
    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")
    extra_args = _SoftorderOp.extra_args

    def setup(self, n, dtype):
        fn = getattr(require("softorder.bridges.torch"), self.op)
        extra = tuple(
            torch().from_numpy(a) if isinstance(a, np.ndarray) else a for a in self.extra_args(n)
        )
        self.prepare_torch(lambda t: fn(t, *extra, ALPHA), make_input("random", (n,), dtype))


class _JaxBridgeRow(_JaxOp):
    """``softorder.bridges.jax.<op>(a, *extra_args(n), ALPHA)`` of one row, under ``jax.jit``."""

    op = ""
    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")
    extra_args = _SoftorderOp.extra_args

    def setup(self, n, dtype):
        fn = getattr(require("softorder.bridges.jax"), self.op)
        extra = self.extra_args(n)
        self.prepare_jax(lambda a: fn(a, *extra, ALPHA), make_input("random", (n,), dtype))


class _TorchsortRow(_TorchOp):
    """Peer: ``torchsort.<op>`` of one row (a batch of one) at ``PEER_STRENGTH``."""

    op = ""
    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        fn = getattr(require("torchsort"), self.op)
        x = make_input("random", (1, n), dtype)
        self.prepare_torch(lambda t: fn(t, regularization_strength=PEER_STRENGTH), x)
