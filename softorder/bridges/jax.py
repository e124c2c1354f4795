"""JAX bridge: every softorder operation as a ``jit``-, ``vmap``- and ``grad``-compatible function.

Usage::

    import softorder.bridges.jax as soj

    ranks = soj.soft_rank(x, alpha=0.1)  # x: a jax.Array; axis=-1 by default

The functions take the same arguments as the NumPy API (:mod:`softorder.operations`) with
JAX conventions, and compute the same values through the same rules: the bridge holds no
mathematics. Each operation is a :func:`jax.custom_vjp` function whose forward and backward
passes are callbacks into the numba core
(:func:`jax.experimental.buffer_callback.buffer_callback` calls, into the CPU kernels on the
CPU and into the GPU kernels on a CUDA backend: see "Devices"), or XLA FFI calls (see "FFI
route"); the forward pass keeps the O(n)-per-row residuals of the rule (the argsort of each
row and the inversion targets), so the backward pass never sorts again. On the CPU a small
call (at most 64 KiB of arguments) also keeps its whole context, in host memory, for the
backward pass on the same arguments (:mod:`softorder._engine.call`: the last 8 such contexts,
found by the call and the bytes of every argument), which then rebuilds nothing: the same
gradients to the bit, for less Python per call.

FFI route
    On the CPU backend, ``soft_rank``, ``soft_sort``, ``soft_topk`` and ``log_soft_topk`` with a
    concrete (not traced) ``alpha`` and ``k``, one ``k`` per row, are XLA FFI custom calls into
    numba C functions (:mod:`softorder.bridges._jax_ffi`): XLA runs them in place on its buffers,
    with no Python, GIL or host copy, so a call costs its kernels. They sort the rows
    themselves (a radix sort, faster than XLA's own on single rows), then call the same
    serial kernels as the NumPy API on the same float64 rows: values and gradients are the
    NumPy API's bit for bit, except that with ties the order among equal elements, and with
    it the rounding of their gradients, can differ (these sorts are stable, NumPy's is not).
    The route is chosen when a function is traced; every other call (a traced ``alpha`` or
    ``k``, several ``k`` per row, the other operations) takes the callbacks. Timings
    against the callbacks and the NumPy API: the JAX page of the docs. The handlers are
    compiled on first use (seconds, once: cached on disk next to the kernels;
    ``softorder.precompile(apis=["jax"])`` compiles them ahead).

Transformations
    ``jax.jit``, ``jax.grad`` / ``jax.vjp`` (with respect to the input, ``alpha`` and ``k`` /
    ``q``, which may all be traced) and ``jax.vmap`` (nested too). A vmapped call reaches the
    kernels as one batched call (``vmap_method="broadcast_all"``: the vmapped axes become
    leading batch axes), not as a loop over rows. Forward mode (``jax.jvp``, ``jax.jacfwd``)
    is not available: ``custom_vjp`` functions only have reverse-mode derivatives; it raises
    ``TypeError`` naming softorder, also under ``jax.jit``. Second derivatives
    (``jax.hessian``, ``jax.grad`` of ``jax.grad``, ``jax.jacrev`` of ``jax.jacrev``) raise
    ``NotImplementedError`` naming softorder when traced: the callbacks have no derivatives.
    Inside :func:`jax.shard_map` each device's callbacks get only that device's rows, and
    the gradient of a replicated argument (``alpha``) is summed over the devices; a plain
    ``jax.jit`` of a sharded batch gathers it onto one device for the callbacks (see the
    "Scaling out" page of the docs).
dtypes
    Results are float32 by default and float64 when ``jax_enable_x64`` is on: floating inputs
    keep their dtype, integer inputs give the default float dtype. float16 and bfloat16 inputs
    are computed in float32 and returned in their own dtype. The kernels always run in
    float64; residuals pass between the forward and backward callbacks bit for bit, also
    without x64. On the CPU, XLA runs the callbacks and FFI calls, as all its computations,
    with subnormal numbers flushed to zero: a result that would be subnormal (below 1.2e-38
    in float32) is 0, where the NumPy API keeps it.
Threads
    Importing this module keeps the numba kernels on the calling thread
    (:func:`softorder.core.set_parallel`): next to XLA's thread pool, numba's parallel rows
    made calls slower (figures: the JAX page of the docs).
Devices
    On the CPU backend the callbacks are ``buffer_callback`` calls into the CPU kernels:
    they run on NumPy views of XLA's buffers and write their results into XLA's output
    buffers, without the host copies of :func:`jax.pure_callback` (which cost more than the
    kernels at n = 1e2; ``_IN_PLACE = False`` takes it, with the same values to the bit).
    When JAX's default backend is CUDA and ``numba-cuda`` is installed, the
    ``buffer_callback`` calls run the GPU kernels instead: the input, the
    cotangent and the residuals stay in XLA's buffers, seen as numba device arrays; the rules
    run on them through the numba device backend
    (:mod:`softorder._engine.backends.numba_cuda`), with the GPU kernels of
    :mod:`softorder.core.cuda` on XLA's compute stream; results, residuals
    and gradients are copied into the output buffers device to device. Only the small
    arguments the rules validate (``alpha``, ``k``, ``q``, labels, ``p_k``,
    ``target_ranks``) are copied to the host, once per call after synchronizing the stream,
    and the backend sums the gradients of ``alpha``, ``k`` and ``q`` over broadcast axes on
    the host. On ROCm, TPU, or CUDA without ``numba-cuda`` (with a warning) every call copies
    its inputs to the host and its results back. The path is chosen when a function is traced
    (``jax.default_backend()``); a computation placed on the CPU under a GPU default runs the
    CPU kernels in place. ``_DEVICE_CALLBACKS = True`` forces the ``buffer_callback`` path on
    the CPU backend, where numba's simulator runs the GPU kernels on host buffers (the tests
    compare it with the CPU kernels' path; what has run on a GPU: the JAX page of the
    docs).
Bad input
    Shapes, ``axis``, flags and every concrete (non-traced) value are checked when the
    function is traced, raising the same ``ValueError`` / ``TypeError`` as the NumPy API.
    A call that computes in float32 (float32 input, or JAX's default without
    ``jax_enable_x64``) also checks concrete ``alpha``, ``k``, ``q`` and ``p_k`` as the kernels
    will see them, rounded to float32 with subnormals flushed to zero: ``alpha=1e-40`` raises
    "alpha=1e-40 rounds to 0.0 in float32, ...".
    Values that are traced (e.g. an ``alpha`` that is an argument of a jitted function) can
    only be checked when the callback runs: a bad value then raises
    :class:`jax.errors.JaxRuntimeError` whose message contains the NumPy API's error (e.g.
    ``ValueError: alpha must be positive and finite; got alpha=-1.0``) and the callback's
    traceback. NaN in the input is not an error: it gives NaN for its row, as in
    the NumPy API.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from softorder import core
from softorder import operations as _ops
from softorder._docs import Dialect, documented
from softorder._engine.backend import float_array
from softorder._engine.call import Call, CallSpec, compute_dtype
from softorder._engine.checks import (
    FLOAT_ARGUMENTS,
    as_computed,
    check_alpha,
    check_argument,
    check_flag,
    check_reduction,
    check_targets,
    placeholder,
    refuse_masked,
)
from softorder._engine.layout import Layout

if TYPE_CHECKING:
    from softorder._engine.backends.numba_cuda import Launch

__all__ = [
    "log_soft_topk",
    "permutation_cross_entropy",
    "soft_permutation",
    "soft_quantile",
    "soft_rank",
    "soft_sort",
    "soft_topk",
    "topk_cross_entropy",
]

core.set_parallel(False)  # see "Threads" above

#: How JAX batches the callbacks under ``vmap``: every argument gets the vmapped axes in
#: front (tiled when it is not batched), so one callback serves the whole batch.
VMAP_METHOD = "broadcast_all"

#: Which callbacks a call is traced with (see "Devices" above): ``"auto"`` takes
#: ``buffer_callback`` and the GPU kernels when JAX's default backend is CUDA and the CPU
#: kernels otherwise (see :data:`_IN_PLACE`); ``True`` / ``False`` force one of them
#: (``True`` on the CPU backend runs the GPU kernels in numba's simulator when
#: ``NUMBA_ENABLE_CUDASIM=1``, and the CPU kernels in place otherwise). Read when a call is
#: traced: functions already jitted keep the path they were traced with.
_DEVICE_CALLBACKS: str | bool = "auto"

#: Whether the CPU backend's callbacks run the CPU kernels in place on XLA's buffers
#: (``buffer_callback``, the default) or take :func:`jax.pure_callback`, which copies the
#: arguments and results (``False``; the values are the same to the bit). Read when a call is
#: traced.
_IN_PLACE: bool = True


# --------------------------------------------------------------------------------------------
# The callbacks: one frozen (hashable, comparable) object per call signature, so that JAX
# caches the compiled callback across calls with the same shapes and static arguments.


@dataclasses.dataclass(frozen=True)
class _Forward:
    call: Call  # softorder._engine.call: the spec, the declared shapes, the callbacks' bodies
    keep: bool  # return the residuals too (when a gradient will be asked for)

    def __call__(self, *arrays):
        return tuple(self.call.forward(arrays, self.keep))

    def into(self, out: list, buffers: tuple) -> None:
        """The same on the host, written into the output arrays ``out``."""
        self.call.forward_into(buffers, out)

    def on_device(self, device: Launch, buffers: tuple) -> list:
        """The same on device arrays: the result (and residuals), on the device."""
        return self.call.forward(device.arguments(buffers), self.keep, device.backend)


@dataclasses.dataclass(frozen=True)
class _Backward:
    call: Call
    wanted: tuple  # positions of the arguments whose gradients are returned

    def __call__(self, *flat):
        return tuple(self.call.backward_flat(flat, wanted=self.wanted))

    def into(self, out: list, buffers: tuple) -> None:
        """The same on the host, written into the output arrays ``out``."""
        self.call.backward_into(buffers, out, self.wanted)

    def on_device(self, device: Launch, buffers: tuple) -> list:
        """The same on device arrays: the gradients, on the device (cast and reshaped to
        their arguments' buffers when written).
        """
        return self.call.backward_flat(buffers, device, self.wanted)


# --------------------------------------------------------------------------------------------
# The device path: buffer_callback hands the callbacks XLA's own buffers, which become numba
# device arrays for the rules (the numba device backend, softorder._engine.backends.numba_cuda), and
# the results are copied into the output buffers on the device.

_DLPACK_CPU = 1  # DLDeviceType kDLCPU


@dataclasses.dataclass(frozen=True)
class _InPlace:
    """A callback of :func:`jax.experimental.buffer_callback.buffer_callback`: ``fn`` (a
    :class:`_Forward` or :class:`_Backward`) on the input buffers, its results written into
    the output buffers ``out``.

    GPU buffers, and host buffers under numba's simulator, run the GPU kernels
    (``fn.on_device``). Host buffers otherwise (a computation placed on the CPU) run ``fn``
    itself, the CPU kernels, on NumPy views of the buffers.
    """

    fn: _Forward | _Backward
    device: bool = True  # False: the CPU kernels always (the CPU route, see "Devices")

    def __call__(self, ctx, out, *buffers) -> None:
        if not self.device or (_on_host(buffers[0]) and not _simulator()):
            # NumPy views of XLA's buffers: the engine never writes into the arguments (nor
            # keeps them past the call: Call.forward_into), the outputs are written in place
            self.fn.into([np.asarray(target) for target in out], buffers)
            return
        with _launching(ctx, buffers[0]) as device:
            device.write(out, self.fn.on_device(device, buffers))


def _on_host(buffer) -> bool:
    return buffer.__dlpack_device__()[0] == _DLPACK_CPU


def _simulator() -> bool:
    """``NUMBA_ENABLE_CUDASIM=1``: numba's CUDA simulator stands in for a GPU."""
    import numba

    return bool(numba.config.ENABLE_CUDASIM)


def _launching(ctx, buffer):
    """Launch every kernel inside the block on XLA's stream of ``buffer``'s device; yields
    the :class:`softorder._engine.backends.numba_cuda.Launch` (the buffers as numba device
    arrays, copies to and from them on that stream).
    """
    from softorder._engine.backends import numba_cuda

    if numba_cuda.SIMULATOR and not _on_host(buffer):
        raise RuntimeError(
            "NUMBA_ENABLE_CUDASIM=1 runs softorder's GPU kernels in numba's simulator, "
            "which cannot read JAX's GPU buffers; unset it to use the GPU"
        )
    stream = None if numba_cuda.SIMULATOR else ctx.stream  # (no GPU context to read there)
    return numba_cuda.launching(buffer.__dlpack_device__()[1], stream)


def _device_callbacks() -> bool:
    """Whether a call traced now takes the device path (:data:`_DEVICE_CALLBACKS`)."""
    if _DEVICE_CALLBACKS == "auto":
        return jax.default_backend() == "gpu" and _cuda_kernels_available()
    return bool(_DEVICE_CALLBACKS)


@functools.cache
def _cuda_kernels_available() -> bool:
    """The default backend is CUDA and softorder's GPU kernels can be imported; with a
    warning (once) when they cannot.
    """
    import jax.extend.backend

    if "cuda" not in jax.extend.backend.get_backend().platform_version.lower():
        return False  # ROCm: numba-cuda has no kernels for it
    try:
        from jax.experimental import buffer_callback  # noqa: F401

        from softorder._engine.backends import numba_cuda  # noqa: F401
    except ImportError as error:
        warnings.warn(
            f"softorder's JAX bridge copies GPU arrays to the host ({error}); the GPU kernels "
            'need the numba-cuda package: pip install "softorder[cuda]"',
            stacklevel=3,
        )
        return False
    return True


#: why a softorder function cannot be differentiated twice, or in forward mode
_SECOND_ORDER = (
    "softorder's JAX operations have first derivatives only: second derivatives (jax.hessian, "
    "jax.jacfwd of a gradient, jax.grad of jax.grad, jax.jvp of a gradient) are not supported"
)
_FORWARD_MODE = (
    "softorder's JAX operations have reverse-mode derivatives only (jax.grad, jax.vjp, "
    "jax.jacrev): forward mode (jax.jvp, jax.jacfwd, jax.linearize) is not supported; "
    "softorder.jvp gives forward-mode derivatives in the NumPy API"
)


def _route() -> str:
    """The callbacks a call traced now takes: ``"device"`` (the GPU kernels, see "Devices"),
    ``"host"`` (``buffer_callback`` running the CPU kernels on XLA's CPU buffers) or
    ``"copy"`` (``pure_callback``: JAX copies the arguments to the host and the results back).
    """
    if _device_callbacks():
        return "device"
    if _IN_PLACE and jax.default_backend() == "cpu" and _buffer_callbacks():
        return "host"
    return "copy"


@functools.cache
def _buffer_callbacks() -> bool:
    """Whether this JAX has :func:`jax.experimental.buffer_callback.buffer_callback`."""
    try:
        from jax.experimental import buffer_callback  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the JAX version
        return False
    return True


def _callback(fn, shapes: tuple, arrays: tuple, route: str) -> tuple:
    """``fn`` on ``arrays`` through ``buffer_callback`` or ``pure_callback`` (:func:`_route`)."""
    if route == "copy":
        call = functools.partial(jax.pure_callback, fn, shapes, vmap_method=VMAP_METHOD)
    else:
        from jax.experimental.buffer_callback import buffer_callback

        callback = _InPlace(fn, device=route == "device")
        call = buffer_callback(callback, shapes, vmap_method=VMAP_METHOD)
    return _first_order_only(call, *arrays)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_only(call: Callable, *arrays) -> tuple:
    """``call(*arrays)``, a callback or an FFI call: a derivative of it (a second derivative)
    raises ``NotImplementedError``.
    """
    return tuple(call(*arrays))


@_first_order_only.defjvp
def _refuse_second_order(call, primals, tangents):
    # JAX asks for this only when a call's inputs carry tangents: the forward call under an
    # outer jvp (jax.hessian), or the backward one under a derivative of a gradient
    raise NotImplementedError(_SECOND_ORDER)


def _naming_forward_mode(run: Callable) -> Callable:
    """JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function", raised while
    ``run`` traces (eager ``jax.jvp``, ``jax.jacfwd``), as an error that names softorder.
    """

    @functools.wraps(run)
    def wrapped(op: Callable, **kwargs: Any) -> jax.Array:
        try:
            return run(op, **kwargs)
        except TypeError as error:
            if "forward-mode autodiff" not in str(error):
                raise
            raise TypeError(_FORWARD_MODE) from error

    return wrapped


try:  # a private module: _refuse_forward_mode goes without it
    from jax._src.interpreters import ad as _ad
except ImportError:  # pragma: no cover - depends on the JAX version
    _ad = None


def _refuse_forward_mode(arrays) -> None:
    """``TypeError`` naming softorder for an argument that carries a forward-mode tangent.

    Under ``jax.jit(lambda x: jax.jvp(f, ...))`` JAX refuses the custom_vjp only after the
    call has traced, outside :func:`_naming_forward_mode`, in words that do not name softorder.
    """
    # JAX has no public test for a jvp tracer; without this private one, JAX's own error
    jvp_tracer = getattr(_ad, "JVPTracer", None)
    if jvp_tracer is None:
        return
    for value in arrays:
        if isinstance(value, jvp_tracer) and type(value.tangent).__name__ != "Zero":
            raise TypeError(_FORWARD_MODE)


def _struct(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


def _forward(call: Call, route: str, arrays: tuple, keep: bool) -> tuple:
    residuals = [_struct(shape, dtype) for shape, dtype in call.stored_shapes()]
    shapes = (_struct(*call.result), *(residuals if keep else ()))
    return _callback(_Forward(call, keep), shapes, arrays, route)


def _varying(value) -> frozenset:
    """The manual mesh axes ``value`` varies over (empty outside :func:`jax.shard_map`)."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:  # JAX before varying-axes types
        return frozenset()
    aval = typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _varying_axes(arrays) -> tuple:
    """Inside :func:`jax.shard_map`: the mesh axes that any of ``arrays`` varies over."""
    return tuple(sorted(set().union(*(_varying(arr) for arr in arrays))))


def _vary(values, axes: tuple) -> tuple:
    """``values`` typed as varying over ``axes``.

    A callback's results are typed as the same on every device, yet inside
    :func:`jax.shard_map` each device computes them from its own rows: they vary over the
    axes their inputs vary over. Arguments that do not vary (a replicated ``alpha``) are made
    varying before the call, so that the transpose of this cast sums their per-device
    gradients over the devices (a ``psum``).
    """
    if not axes:
        return tuple(values)
    out = []
    for value in values:
        missing = tuple(a for a in axes if a not in _varying(value))
        if missing and hasattr(jax.lax, "pcast"):
            value = jax.lax.pcast(value, missing, to="varying")
        elif missing:  # JAX before 0.8.2
            value = jax.lax.pvary(value, missing)
        out.append(value)
    return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _apply(call: Call, route: str, *arrays):
    return _vary(_forward(call, route, arrays, keep=False), _varying_axes(arrays))[0]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
    """The positions of the arguments a backward pass returns gradients for (a static part
    of the residuals).
    """

    positions: tuple


def _apply_fwd(call: Call, route: str, *primals):
    # (symbolic zeros: each primal says whether it is differentiated; the backward pass
    # computes and returns only those gradients, the others are zero to JAX anyway)
    arrays = tuple(p.value for p in primals)
    out, *residuals = _vary(_forward(call, route, arrays, keep=True), _varying_axes(arrays))
    wanted = _Wanted(tuple(i for i in call.differentiable if primals[i].perturbed))
    return out, (arrays, tuple(residuals), wanted)


def _apply_bwd(call: Call, route: str, saved, cotangent):
    arrays, residuals, wanted = saved
    out: list = [None] * len(arrays)  # None: no gradient (labels, p_k, target_ranks, ...)
    if not wanted.positions:
        return tuple(out)
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        cotangent = jnp.zeros(cotangent.aval.shape, cotangent.aval.dtype)  # as JAX would
    shapes = tuple(_struct(arrays[i].shape, arrays[i].dtype) for i in wanted.positions)
    backward = _Backward(call, wanted.positions)
    grads = _callback(backward, shapes, (*arrays, *residuals, cotangent), route)
    grads = _vary(grads, _varying_axes(arrays))
    for i, grad in zip(wanted.positions, grads, strict=True):
        out[i] = grad
    return tuple(out)


_apply.defvjp(_apply_fwd, _apply_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------------------------
# The FFI route (CPU): XLA calls numba C functions in place, which sort the rows and run the
# kernels (softorder.bridges._jax_ffi); chosen when a call is traced, for the operations and
# arguments it covers. Everything it needs is validated then, so nothing can fail when it runs.

#: Which CPU calls take the FFI route: ``"auto"`` (the default) for ``soft_rank``,
#: ``soft_sort``, ``soft_topk`` and ``log_soft_topk`` traced on the CPU backend with a concrete
#: (not traced) ``alpha`` and ``k`` and one ``k`` per row; ``False`` sends every call through
#: the callbacks. Read when a call is traced.
_FFI_CALLS: str | bool = "auto"

#: the operations the FFI route covers: (handler, log)
_FFI_OPS = {
    "soft_rank": ("rank", False),
    "soft_topk": ("topk", False),
    "log_soft_topk": ("topk", True),
    "soft_sort": ("sort", False),
}


def _ffi_route(op: Callable, statics: dict, arguments: dict, layout: Layout, compute):
    """A function of the (compute-dtype) input computing ``op`` through the FFI handlers, or
    ``None`` when this call takes the callbacks instead (see :data:`_FFI_CALLS`).
    ``arguments``: the call's arguments as given (already validated).
    """
    if _FFI_CALLS is False or op.__name__ not in _FFI_OPS or _device_callbacks():
        return None
    rows = math.prod(layout.batch_shape)
    if not 1 <= layout.n < 2**31 or rows < 1:  # the argsort travels as int32
        return None
    if not hasattr(jax, "ffi") or jax.default_backend() != "cpu" or _jit_disabled():
        return None
    if any(_is_traced(arguments[name]) for name in ("alpha", "k") if name in arguments):
        return None
    handler, log = _FFI_OPS[op.__name__]
    batch_shape = layout.batch_shape
    alpha = _as_kernel_value(arguments["alpha"], compute)
    per_row, _ = check_alpha(alpha, batch_shape, layout.axis)
    constants = [per_row.astype(compute)]  # exact: the values are the rounded ones
    negate = bool(statics.get("descending", False))
    targets = None
    if "k" in arguments:
        n = layout.n
        k = _as_kernel_value(arguments["k"], compute)
        targets, multi, _ = check_targets(k, batch_shape, "k", n, f"n={n}")
        if multi:
            return None  # several k per row: the callbacks
        negate = bool(statics["largest"])
    constants.append(np.array([negate, log], np.int32))
    if targets is not None:
        constants.append(targets.astype(compute))
    spec = _FfiSpec(handler, layout.axis - layout.ndim)

    def run(x):
        return _ffi_apply(spec, x, *(jnp.asarray(c) for c in constants))

    return run


def _jit_disabled() -> bool:
    """``NUMBA_DISABLE_JIT=1``: the kernels are Python functions, which no C function can
    call.
    """
    import numba

    return bool(numba.config.DISABLE_JIT)


def _as_kernel_value(value, compute) -> np.ndarray:
    """A concrete ``alpha`` or ``k`` as the kernels see it through the callbacks: in the
    compute dtype (float32: rounded, subnormals flushed as XLA does), as float64.
    """
    host = _host_value(value)
    if np.dtype(compute) == np.float64:
        return np.asarray(host, dtype=np.float64)
    return as_computed(host, compute).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class _FfiSpec:
    handler: str  # "rank", "topk" or "sort": the handler in softorder.bridges._jax_ffi
    axis: int  # negative


def _ffi_forward(spec: _FfiSpec, x, alpha, flags, *rest):
    moved = jnp.moveaxis(x, spec.axis, -1)
    rows2d = moved.reshape(-1, moved.shape[-1])
    rows, n = rows2d.shape
    words = np.uint32  # float64 and int64 residuals as pairs of words: no x64 needed
    if spec.handler == "rank":
        saved = (_struct((rows, 2 * n), words),)  # the decays
    elif spec.handler == "sort":  # anchors, offsets: one per target, n targets
        saved = (_struct((rows, 2 * n), words), _struct((rows, 2 * n), words))
    else:
        saved = (_struct((rows, 2), words), _struct((rows, 2), words))  # anchors, offsets
    shapes = (_struct((rows, n), rows2d.dtype), _struct((rows, n), np.int32), *saved)
    out, *saved = _ffi(spec.handler, shapes, (rows2d, alpha, flags, *rest))
    out = jnp.moveaxis(out.reshape(moved.shape), -1, spec.axis)
    return out, (rows2d, alpha, flags, *saved)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ffi_apply(spec: _FfiSpec, x, alpha, flags, *rest):
    return _ffi_forward(spec, x, alpha, flags, *rest)[0]


def _ffi_apply_fwd(spec: _FfiSpec, x, alpha, flags, *rest):
    return _ffi_forward(spec, x, alpha, flags, *rest)


def _ffi_apply_bwd(spec: _FfiSpec, saved, cotangent):
    rows2d = saved[0]
    moved = jnp.moveaxis(cotangent, spec.axis, -1)
    v = moved.reshape(rows2d.shape).astype(rows2d.dtype)
    (x_bar,) = _ffi(spec.handler, (_struct(rows2d.shape, rows2d.dtype),), (*saved, v))
    x_bar = jnp.moveaxis(x_bar.reshape(moved.shape), -1, spec.axis)
    return (x_bar, None, None) + ((None,) if spec.handler == "topk" else ())


_ffi_apply.defvjp(_ffi_apply_fwd, _ffi_apply_bwd)


def _ffi(handler: str, shapes: tuple, operands: tuple) -> tuple:
    """The XLA FFI call of ``handler`` (registered on first use) on ``operands``; inside
    :func:`jax.shard_map` its results vary over the mesh axes its operands vary over.
    """
    from softorder.bridges import _jax_ffi

    axes = _varying_axes(operands)
    call = jax.ffi.ffi_call(_jax_ffi.target(handler), shapes, vmap_method=VMAP_METHOD)
    return _vary(_first_order_only(call, *_vary(operands, axes)), axes)


# --------------------------------------------------------------------------------------------
# Trace-time checks: the NumPy API's own validation, on concrete values where there are any
# and on placeholders of the right shape and dtype kind for traced ones.


def _is_traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def _host_value(value):
    """A concrete argument as NumPy sees it (JAX's narrow floats widened to float32)."""
    if isinstance(value, (int, float, bool, complex)):
        return value
    arr = np.asarray(value)
    if jnp.issubdtype(arr.dtype, jnp.floating) and arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float32)
    return arr


def _check(name: str, value, layout: Layout, compute=np.float64) -> None:
    """Raise the NumPy API's error for a bad array argument other than the input: a concrete
    one as NumPy sees it (also rounded to ``compute``), a traced one as a placeholder of its
    shape and dtype kind.
    """
    refuse_masked(value, name)
    if not _is_traced(value):
        check_argument(name, _host_value(value), layout, compute)
        return
    floating = jnp.issubdtype(value.dtype, jnp.floating)
    dtype = np.float64 if floating else value.dtype
    check_argument(name, placeholder(name, value.shape, dtype, layout.n), layout)


def _compute_dtype(dtype) -> tuple[np.dtype, np.dtype]:
    """(dtype the kernels' results are computed in, dtype returned) for an input dtype."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(compute_dtype(dtype.name)), dtype
    float_array(np.empty(0, dtype=dtype), "x")  # TypeError for complex
    default = jax.dtypes.canonicalize_dtype(np.float64)
    return default, default


@_naming_forward_mode
def _run(op: Callable, **kwargs: Any) -> jax.Array:
    """Call the NumPy operation ``op``'s rule through the callbacks, from JAX."""
    signature = op.signature
    bound = signature.bind(**kwargs)  # every public function passes every argument
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    names = tuple(p.name for p in signature.parameters.values() if p.kind is not p.KEYWORD_ONLY)
    statics = {p: arguments[p] for p in signature.parameters if p not in names}
    if "reduction" in statics:
        check_reduction(statics["reduction"])
    for flag in ("largest", "descending", "split_top1"):
        if flag in statics:
            statics[flag] = check_flag(statics[flag], flag)

    input_name = names[0]
    refuse_masked(arguments[input_name], input_name)
    x = jnp.asarray(arguments[input_name])
    compute, out_dtype = _compute_dtype(x.dtype)
    x = x.astype(compute)
    layout = Layout.of(x.shape, statics.get("axis", -1), input_name)  # axis, scalar, empty

    arrays = {input_name: x}
    for name in names[1:]:
        value = arguments[name]
        _check(name, value, layout, compute)
        if name in FLOAT_ARGUMENTS:
            value = jnp.asarray(value).astype(compute)
        else:
            value = jnp.asarray(value)
        arrays[name] = value

    _refuse_forward_mode(arrays.values())
    route = _ffi_route(op, statics, arguments, layout, compute)
    if route is not None:
        return route(x).astype(out_dtype)

    # one spec for any number of vmapped axes: the axis counts from the end, a loss is
    # computed per row and reduced below, in JAX, per vmapped element
    spec = CallSpec(op.__name__, names, tuple(sorted(statics.items())))
    spec = spec.vmapped(len(layout.batch_shape))
    words = jax.dtypes.canonicalize_dtype(np.int64) != np.int64  # no x64: 64-bit as 2 words
    call = Call.plan(spec, arrays, compute.name, words)
    operands = tuple(arrays[name] for name in names)
    out = _apply(call, _route(), *_vary(operands, _varying_axes(operands)))
    if arguments.get("reduction", "none") != "none":
        out = jnp.sum(out) if arguments["reduction"] == "sum" else jnp.mean(out)
    return out.astype(out_dtype)


# --------------------------------------------------------------------------------------------
# The public functions. Their docstrings are the NumPy API's, in JAX's words
# (softorder._docs): each function writes only its differences and its example.

_JAX = Dialect(
    words=((r"\bndarray\b", "jax.Array"),),
    types=(
        (r"\barray_like\b", "jax.Array"),
        (r"\bndarray\b", "jax.Array"),
    ),
    kinds={"p_k": "sequence or jax.Array"},
    about="The JAX version of :func:`softorder.{name}`: the same kernels and values.",
    note=(
        "JAX: results are float32 by default and float64 with ``jax_enable_x64``; floating "
        "inputs keep their dtype (float16 and bfloat16 are computed in float32). Works under "
        "``jax.jit`` and ``jax.vmap`` (one batched kernel call); reverse-mode derivatives "
        "(``jax.grad``, ``jax.vjp``, ``jax.jacrev``) in {differentiable}, which may be traced. "
        "Forward mode (``jax.jvp``, ``jax.jacfwd``) raises ``TypeError`` and second "
        "derivatives ``NotImplementedError``. Concrete arguments are checked when the function "
        "is traced (in float32 also as rounded to float32); a bad traced value raises "
        ":class:`jax.errors.JaxRuntimeError` when the kernels run."
    ),
)

#: a note of the operations the FFI route covers
_FFI_NOTE = (
    "FFI route: on the CPU backend, with a concrete (not traced) ``alpha`` (and ``k``, one per "
    "row), this is an XLA FFI call into numba C functions, with no Python per call; otherwise "
    'a callback (see the module\'s "FFI route").'
)
#: a note of the losses
_LOSS_NOTE = "Under ``vmap`` the reduction applies to each vmapped element separately."


@documented(_ops.soft_topk, _JAX, notes=_FFI_NOTE)
def soft_topk(
    x: ArrayLike,
    k: ArrayLike,
    alpha: ArrayLike = 1.0,
    *,
    axis: int = -1,
    largest: bool = True,
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> x = jnp.array([3.0, 1.0, 2.0, -5.0])
    >>> soj.soft_topk(x, 2, alpha=0.01).round(3)
    Array([1., 0., 1., 0.], dtype=float32)
    >>> g = jax.grad(lambda k: soj.soft_topk(x, k, alpha=0.5)[1])(2.0)
    >>> bool(g > 0)  # a larger k takes in more of the third-largest element
    True
    """
    return _run(_ops.soft_topk, x=x, k=k, alpha=alpha, axis=axis, largest=largest)


@documented(_ops.log_soft_topk, _JAX, notes=_FFI_NOTE)
def log_soft_topk(
    x: ArrayLike,
    k: ArrayLike,
    alpha: ArrayLike = 1.0,
    *,
    axis: int = -1,
    largest: bool = True,
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> soj.log_soft_topk(jnp.array([0.0, 2000.0]), 1, alpha=1.0).round(2)
    Array([-1000.69,    -0.  ], dtype=float32)
    """
    return _run(_ops.log_soft_topk, x=x, k=k, alpha=alpha, axis=axis, largest=largest)


@documented(_ops.soft_rank, _JAX, notes=_FFI_NOTE)
def soft_rank(
    x: ArrayLike, alpha: ArrayLike = 1.0, *, axis: int = -1, descending: bool = False
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> x = jnp.array([0.5, -1.0, 3.0])
    >>> soj.soft_rank(x, alpha=0.01)
    Array([2., 1., 3.], dtype=float32)
    >>> jax.jit(jax.grad(lambda x: soj.soft_rank(x, 1.0)[0]))(x).shape
    (3,)
    >>> jax.vmap(soj.soft_rank)(jnp.stack([x, -x])).shape  # one batched kernel call
    (2, 3)
    """
    return _run(_ops.soft_rank, x=x, alpha=alpha, axis=axis, descending=descending)


@documented(_ops.soft_sort, _JAX, notes=_FFI_NOTE)
def soft_sort(
    x: ArrayLike, alpha: ArrayLike = 1.0, *, axis: int = -1, descending: bool = False
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> soj.soft_sort(jnp.array([2.0, -1.0, 0.5]), alpha=0.001)
    Array([-1. ,  0.5,  2. ], dtype=float32)
    """
    return _run(_ops.soft_sort, x=x, alpha=alpha, axis=axis, descending=descending)


@documented(_ops.soft_quantile, _JAX)
def soft_quantile(
    x: ArrayLike, q: ArrayLike, alpha: ArrayLike = 1.0, *, axis: int = -1
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> x = jnp.array([4.0, 1.0, 3.0, 2.0])
    >>> soj.soft_quantile(x, jnp.array([0.25, 0.5, 0.75]), alpha=1e-3)
    Array([1.5, 2.5, 3.5], dtype=float32)
    """
    return _run(_ops.soft_quantile, x=x, q=q, alpha=alpha, axis=axis)


@documented(_ops.soft_permutation, _JAX)
def soft_permutation(
    x: ArrayLike, alpha: ArrayLike = 1.0, *, axis: int = -1, descending: bool = False
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> x = jnp.array([0.2, -3.0, 1.0])
    >>> P = soj.soft_permutation(x, alpha=0.01)
    >>> P @ x
    Array([-3. ,  0.2,  1. ], dtype=float32)
    """
    return _run(_ops.soft_permutation, x=x, alpha=alpha, axis=axis, descending=descending)


@documented(_ops.topk_cross_entropy, _JAX, notes=_LOSS_NOTE)
def topk_cross_entropy(
    logits: ArrayLike,
    labels: ArrayLike,
    p_k: ArrayLike,
    alpha: ArrayLike = 1.0,
    *,
    reduction: str = "mean",
    split_top1: bool = False,
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> logits = jnp.array([[2.0, 1.0, 0.1, -1.0], [0.0, 3.0, 1.0, 2.0]])
    >>> labels = jnp.array([1, 0])
    >>> loss = soj.topk_cross_entropy(logits, labels, [0.5, 0.5], alpha=0.5, reduction="none")
    >>> [round(float(v), 4) for v in loss]
    [0.7257, 4.2676]
    >>> jax.grad(soj.topk_cross_entropy)(logits, labels, [0.5, 0.5], 0.5).shape
    (2, 4)
    """
    return _run(
        _ops.topk_cross_entropy,
        logits=logits,
        labels=labels,
        p_k=p_k,
        alpha=alpha,
        reduction=reduction,
        split_top1=split_top1,
    )


@documented(_ops.permutation_cross_entropy, _JAX, notes=_LOSS_NOTE)
def permutation_cross_entropy(
    x: ArrayLike,
    target_ranks: ArrayLike,
    alpha: ArrayLike = 1.0,
    *,
    reduction: str = "mean",
    descending: bool = False,
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> x = jnp.array([[0.1, 2.0, -1.0]])
    >>> good = soj.permutation_cross_entropy(x, jnp.array([[2, 3, 1]]), alpha=0.1)
    >>> bad = soj.permutation_cross_entropy(x, jnp.array([[1, 2, 3]]), alpha=0.1)
    >>> bool(good < bad)
    True
    """
    return _run(
        _ops.permutation_cross_entropy,
        x=x,
        target_ranks=target_ranks,
        alpha=alpha,
        reduction=reduction,
        descending=descending,
    )
