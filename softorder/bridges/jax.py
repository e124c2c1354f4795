"""JAX bridge: every softorder operation as a ``jit``-, ``vmap``- and ``grad``-compatible function.

Usage::

    import softorder.bridges.jax as soj

    ranks = soj.soft_rank(x, alpha=0.1)  # x: a jax.Array; axis=-1 by default

The functions take the NumPy API's arguments and compute the same values through the same
rules; what they support is in their docstrings and on the docs' JAX page. This module adapts
JAX only (the checks, the dtype policy and the callbacks' bodies are :mod:`softorder._engine`'s):
each call is one :func:`jax.custom_vjp` function (``_apply``) over the kernels of the route
chosen when it is traced (``_route``): XLA FFI calls (``_Ffi``,
:mod:`softorder.bridges._jax_ffi`) or callbacks of :class:`softorder._engine.call.Call`
(``_Callbacks``: ``buffer_callback`` on XLA's buffers in place, else ``pure_callback``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from softorder import core
from softorder import operations as _ops
from softorder._docs import Dialect, documented
from softorder._engine import checks
from softorder._engine.call import Call, CallSpec, input_dtypes, refuse_derivatives
from softorder._engine.layout import Layout, several_per_row

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

core.set_parallel(False)  # next to XLA's thread pool, numba's parallel rows made calls slower

#: how JAX batches the calls under ``vmap``: the vmapped axes in front of every argument
#: (tiled when it is not batched), so that one call serves the whole batch
VMAP_METHOD = "broadcast_all"

# Read when a call is traced (functions already jitted keep their route):
#: ``"auto"``: the GPU kernels when JAX's default backend is CUDA; ``True`` forces the device
#: callbacks (on the CPU backend: the GPU kernels in numba's simulator under
#: ``NUMBA_ENABLE_CUDASIM=1``, the CPU kernels in place otherwise); ``False`` never
_DEVICE_CALLBACKS: str | bool = "auto"
#: ``False``: the CPU callbacks take ``pure_callback`` (copies; the same values to the bit)
_IN_PLACE: bool = True
#: ``False`` sends every call through the callbacks, not the FFI route
_FFI_CALLS: str | bool = "auto"
#: per operation, rows longer than this take the callbacks, not the FFI route: there the
#: handlers' own radix sort costs more than the callbacks' Python beside NumPy's sort (its
#: scratch, 32 bytes per element, is fresh pages from the C library on every call past 32
#: MiB), and soft sort's handler runs the general kernels (``sort_kernel``, ``sort_vjp``), not
#: the NumPy API's ladder ones (the figures: ``benchmarks/bench_jax.py --sizes``)
FFI_MAX_N = {
    "soft_rank": 2**20,
    "soft_topk": 2**20,
    "log_soft_topk": 2**20,
    "soft_sort": 2**18,
    "soft_quantile": 2**20,
    "topk_cross_entropy": 2**20,
    "permutation_cross_entropy": 2**20,
}

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

# --------------------------------------------------------------------------------------------
# The kernels a call runs, as _apply sees them: forward(arrays, keep) gives the result and the
# residuals, backward(...) the gradients of the arguments at the positions ``wanted``. Frozen
# (hashable, comparable) objects, so that JAX caches a compiled call across calls.


@dataclasses.dataclass(frozen=True)
class _Callbacks:
    """``call`` (:class:`softorder._engine.call.Call`) through callbacks of ``route``
    (:func:`_route`); with ``keep`` or ``wanted`` set, one callback itself: the forward pass
    (with the residuals when ``keep``) or the backward pass (the gradients at ``wanted``).
    """

    call: Call
    route: str
    keep: bool = False
    wanted: tuple | None = None

    @property
    def differentiable(self) -> tuple:
        return self.call.differentiable

    def forward(self, arrays: tuple, keep: bool) -> tuple:
        stored = self.call.stored_shapes() if keep else ()
        shapes = [_struct(*shape) for shape in (self.call.result, *stored)]
        return self._callback(dataclasses.replace(self, keep=keep), shapes, arrays)

    def backward(self, arrays: tuple, residuals: tuple, cotangent, wanted: tuple) -> tuple:
        shapes = [_struct(arrays[i].shape, arrays[i].dtype) for i in wanted]
        backward = dataclasses.replace(self, wanted=wanted)
        return self._callback(backward, shapes, (*arrays, *residuals, cotangent))

    def _callback(self, fn: _Callbacks, shapes: list, operands: tuple) -> tuple:
        if self.route == "copy":
            call = functools.partial(jax.pure_callback, fn, shapes, vmap_method=VMAP_METHOD)
        else:
            call = _buffer_callback()(fn.in_place, shapes, vmap_method=VMAP_METHOD)
        return _first_order_only(call, *operands)

    def __call__(self, *arrays) -> tuple:
        """The callback of ``pure_callback``: host copies in, results out."""
        if self.wanted is None:
            return tuple(self.call.forward(arrays, self.keep))
        return tuple(self.call.backward_flat(arrays, wanted=self.wanted))

    def in_place(self, ctx, out, *buffers) -> None:
        """The callback of ``buffer_callback``: the results written into XLA's buffers ``out``:
        the CPU kernels on NumPy views of host buffers (unless numba's simulator stands in for a
        GPU), the GPU kernels on XLA's stream for GPU buffers.
        """
        if self.route == "host" or (_on_host(buffers[0]) and not _simulator()):
            outs = [np.asarray(target) for target in out]
            if self.wanted is None:
                self.call.forward_into(buffers, outs)
            else:
                self.call.backward_into(buffers, outs, self.wanted)
            return
        from softorder._engine.backends import numba_cuda

        if numba_cuda.SIMULATOR and not _on_host(buffers[0]):
            raise RuntimeError(
                "NUMBA_ENABLE_CUDASIM=1 runs softorder's GPU kernels in numba's simulator, "
                "which cannot read JAX's GPU buffers; unset it to use the GPU"
            )
        stream = None if numba_cuda.SIMULATOR else ctx.stream  # (no GPU context to read there)
        with numba_cuda.launching(buffers[0].__dlpack_device__()[1], stream) as device:
            if self.wanted is None:
                results = self.call.forward(device.arguments(buffers), self.keep, device.backend)
            else:
                results = self.call.backward_flat(buffers, device, self.wanted)
            device.write(out, results)


@dataclasses.dataclass(frozen=True)
class _Ffi:
    """The FFI route's ``handler`` (:mod:`softorder.bridges._jax_ffi`) on the arrays (rows, n)
    of rows, ``alpha``, int32 flags ``(negate, log)`` (and ``m`` for quantiles) and, for
    top-k, ``k`` per row, for quantiles ``q`` and its argsort (rows, m); for the losses the
    labels or target ranks (traced or not: checked by the handler) and, for top-k
    cross-entropy, log P_K and P_K(1) per row (float64 as uint32 words); residuals: the
    argsort (int32) and 64-bit values as pairs of uint32 words (no x64 needed).

    ``alpha`` is one value per row (concrete), or with ``alpha_group`` the caller's traced
    alpha (:func:`_alpha_group`), one value per run of ``alpha_group[0]`` rows, sent per
    row; the handler then checks it, and its backward pass sums the rows' gradients of alpha
    to each value (in float64, as the NumPy API does) when asked.
    """

    handler: str  # "rank", "topk", "sort", "quantile", "topk_loss" or "permutation_loss"
    alpha_group: tuple | None = None  # traced alpha: (rows per value, summed)

    @property
    def differentiable(self) -> tuple:
        # (the other arguments are concrete, or integers)
        return (0,) if self.alpha_group is None else (0, 1)

    def forward(self, arrays: tuple, keep: bool) -> tuple:
        rows, n = arrays[0].shape
        arrays = self._per_row(arrays)
        dtype, order = arrays[0].dtype, _struct((rows, n), np.int32)
        if self.handler in ("topk_loss", "permutation_loss"):  # one loss per row
            if self.handler == "topk_loss":
                K = arrays[4].shape[-1] // 2  # (log P_K: (rows, 2 K) words)
                saved = (_struct((rows, 2 * K), np.uint32),) * 2
            else:  # the n - 1 boundaries' int32 anchors and offsets
                saved = (_struct((rows, n - 1), np.int32), _struct((rows, 2 * n - 2), np.uint32))
            return self._call((_struct((rows,), dtype), order, *saved), arrays)
        m = arrays[3].shape[-1] if self.handler == "quantile" else n  # (q: (rows, m))
        widths = {"rank": (2 * n,), "sort": (2 * n,) * 2, "topk": (2, 2), "quantile": (2 * m,) * 2}
        saved = [_struct((rows, w), np.uint32) for w in widths[self.handler]]
        return self._call((_struct((rows, m), dtype), order, *saved), arrays)

    def backward(self, arrays: tuple, residuals: tuple, cotangent, wanted: tuple) -> tuple:
        x, alpha = arrays[:2]  # (k, q and its order, the fourth argument on, are not needed)
        needed = self._per_row(arrays)
        if self.handler not in ("topk_loss", "permutation_loss"):
            needed = needed[:3]
        shapes, operands = (_struct(x.shape, x.dtype),), (*needed, *residuals, cotangent)
        if 1 in wanted:  # alpha's gradient, summed by the handler: one more argument, result
            from softorder.bridges import _jax_ffi

            _jax_ffi.link_alpha_sums()  # (compiled for a traced alpha only)
            shapes += (_struct((alpha.size,), x.dtype),)
            operands += (jnp.asarray(np.array(self.alpha_group, np.int32)),)
        grads = self._call(shapes, operands)
        return tuple(grads[0] if i == 0 else grads[1].reshape(alpha.shape) for i in wanted)

    def _per_row(self, arrays: tuple) -> tuple:
        """``arrays`` with a traced ``alpha`` once per row, as the handler reads it."""
        if self.alpha_group is None:
            return arrays
        alpha, group = arrays[1].reshape(-1, 1), self.alpha_group[0]
        per_row = jnp.broadcast_to(alpha, (alpha.shape[0], group)).reshape(-1)
        return (arrays[0], per_row, *arrays[2:])

    def _call(self, shapes: tuple, operands: tuple) -> tuple:
        from softorder.bridges import _jax_ffi

        call = jax.ffi.ffi_call(_jax_ffi.target(self.handler), shapes, vmap_method=VMAP_METHOD)
        return _first_order_only(call, *operands)


def _struct(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_only(call: Callable, *arrays) -> tuple:
    """``call(*arrays)``, a callback or an FFI call, whose derivative raises."""
    return tuple(call(*arrays))


@_first_order_only.defjvp
def _refuse_second_order(call, primals, tangents):
    # asked for only when a call's inputs carry tangents: the forward call under an outer jvp
    # (jax.hessian), or the backward one under a derivative of a gradient
    raise NotImplementedError(_SECOND_ORDER)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply(kernel: _Callbacks | _Ffi, *arrays):
    return _vary(kernel.forward(arrays, False), _varying_axes(arrays))[0]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
    """The positions of the arguments to differentiate (a static part of the residuals)."""

    positions: tuple


def _apply_fwd(kernel: _Callbacks | _Ffi, *primals):
    # (symbolic zeros: the backward pass computes only the gradients of perturbed arguments)
    arrays = tuple(p.value for p in primals)
    if isinstance(kernel, _Callbacks):  # (the FFI route's others: concrete, or integers)
        spec = kernel.call.spec
        refuse_derivatives(spec.op, spec.rule, spec.names, [p.perturbed for p in primals])
    out, *residuals = _vary(kernel.forward(arrays, True), _varying_axes(arrays))
    wanted = _Wanted(tuple(i for i in kernel.differentiable if primals[i].perturbed))
    return out, (arrays, tuple(residuals), wanted)


def _apply_bwd(kernel: _Callbacks | _Ffi, saved, cotangent):
    arrays, residuals, wanted = saved
    out: list = [None] * len(arrays)  # None: no gradient (labels, p_k, target_ranks, ...)
    if not wanted.positions:
        return tuple(out)
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        cotangent = jnp.zeros(cotangent.aval.shape, cotangent.aval.dtype)  # as JAX would
    grads = kernel.backward(arrays, residuals, cotangent.astype(arrays[0].dtype), wanted.positions)
    for i, grad in zip(wanted.positions, _vary(grads, _varying_axes(arrays)), strict=True):
        out[i] = grad
    return tuple(out)


_apply.defvjp(_apply_fwd, _apply_bwd, symbolic_zeros=True)


def _varying(value) -> frozenset:
    """The manual mesh axes ``value`` varies over (empty outside :func:`jax.shard_map`)."""
    if not hasattr(jax, "typeof"):  # JAX before varying-axes types
        return frozenset()
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _varying_axes(arrays) -> tuple:
    return tuple(sorted(set().union(*(_varying(arr) for arr in arrays))))


def _vary(values, axes: tuple) -> tuple:
    """``values`` typed as varying over the mesh axes ``axes``: inside :func:`jax.shard_map`
    each device computes a call's results from its own rows, and an argument that did not vary
    (a replicated ``alpha``) gets its per-device gradients summed (the cast's transpose).
    """
    out = []
    for value in values:
        missing = tuple(a for a in axes if a not in _varying(value))
        if missing and hasattr(jax.lax, "pcast"):
            value = jax.lax.pcast(value, missing, to="varying")
        elif missing:  # JAX before 0.8.2
            value = jax.lax.pvary(value, missing)
        out.append(value)
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Routes: which kernels a call traced now takes.


def _route() -> str:
    """``"device"`` (buffer_callback; the GPU kernels on GPU buffers), ``"host"``
    (buffer_callback into the CPU kernels) or ``"copy"`` (pure_callback: host copies).
    """
    backend = jax.default_backend()
    auto = _DEVICE_CALLBACKS == "auto" and backend == "gpu" and _cuda_kernels()
    if auto or _DEVICE_CALLBACKS is True:
        return "device"
    return "host" if _IN_PLACE and backend == "cpu" and _buffer_callback() else "copy"


@functools.cache
def _buffer_callback() -> Callable | None:
    """:func:`jax.experimental.buffer_callback.buffer_callback`, if this JAX has it."""
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError:  # pragma: no cover - depends on the JAX version
        return None
    return buffer_callback


@functools.cache
def _cuda_kernels() -> bool:
    """The default backend is CUDA and softorder's GPU kernels can be imported (a warning,
    once, when they cannot: arrays are then copied to the host).
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


def _on_host(buffer) -> bool:
    return buffer.__dlpack_device__()[0] == 1  # DLDeviceType kDLCPU


def _simulator() -> bool:
    """``NUMBA_ENABLE_CUDASIM=1``: numba's CUDA simulator stands in for a GPU."""
    import numba

    return bool(numba.config.ENABLE_CUDASIM)


#: the operations the FFI route covers: (handler, log)
_FFI_OPS = {
    "soft_rank": ("rank", False),
    "soft_topk": ("topk", False),
    "log_soft_topk": ("topk", True),
    "soft_sort": ("sort", False),
    "soft_quantile": ("quantile", False),
    "topk_cross_entropy": ("topk_loss", False),
    "permutation_cross_entropy": ("permutation_loss", False),
}
#: the losses' integer argument, which the handlers check when they run (it may be traced)
_FFI_INTEGERS = {"topk_cross_entropy": "labels", "permutation_cross_entropy": "target_ranks"}


def _ffi_constants(
    op_name: str, arguments: dict, arrays: dict, layout: Layout, compute, route: str
):
    """``(handler, arguments after the rows, alpha_group)`` of the FFI route (``alpha``, and
    ``k`` per row as the kernels see them through the callbacks, the flags; ``alpha_group``:
    :class:`_Ffi`'s), or ``None``: the call takes the callbacks. ``arguments``: as the
    caller gave them; ``arrays``: as JAX arrays.
    Concrete values are validated now; traced ones (``alpha``, the losses' labels and target
    ranks: data of a training step) are checked by the handlers when they run.
    """
    import numba

    if (
        _FFI_CALLS is False
        or op_name not in _FFI_OPS
        or route == "device"
        or jax.default_backend() != "cpu"
        or not hasattr(jax, "ffi")
        or numba.config.DISABLE_JIT  # (no C function can call Python kernels)
        or layout.n > FFI_MAX_N[op_name]
        or layout.n >= 2**31  # the argsort travels as int32
        or not math.prod(layout.batch_shape)
        or any(_is_traced(arguments.get(name)) for name in ("k", "q", "p_k"))
    ):
        return None
    if _is_traced(arguments["alpha"]):
        group = _alpha_group(arguments["alpha"].shape, layout)
        if group is None:
            return None
        alpha = arrays["alpha"]  # (in the compute dtype)
    else:
        group, alpha = None, checks.row_values("alpha", arguments["alpha"], layout, compute)
    handler, log = _FFI_OPS[op_name]
    if op_name in _FFI_INTEGERS:
        integers = _ffi_integers(op_name, arrays[_FFI_INTEGERS[op_name]], layout)
        if integers is None:
            return None
        constants = _ffi_loss_constants(op_name, arguments, integers, layout, compute)
        return None if constants is None else (constants[0], [alpha, *constants[1]], group)
    negate = bool(arguments.get("descending", arguments.get("largest")))
    constants = [alpha, np.array([negate, log], np.int32)]
    if "k" in arguments:
        k = checks.row_values("k", arguments["k"], layout, compute)
        if k is None:
            return None  # several k per row: the callbacks
        constants.append(k)
    if "q" in arguments:
        q = checks.row_quantiles(arguments["q"], layout, compute)
        if not core.sort.few_targets(q.shape[1], layout.n):
            return None  # (their gradient is another kernel's)
        # m, and the argsort of each row's targets, as the NumPy API's Targets.parse sorts them
        constants[1] = np.array([negate, log, q.shape[1]], np.int32)
        constants += [q.astype(compute), np.argsort(q, axis=1).astype(np.int32)]
    return handler, constants, group


def _alpha_group(shape: tuple, layout: Layout) -> tuple | None:
    """For a traced ``alpha`` of ``shape``: ``(rows per value, summed)`` when each value of
    alpha is the alpha of a contiguous run of rows (a scalar; one alpha per row; values along
    leading batch axes, broadcast along the trailing ones), whose gradients the handler sums
    as the NumPy API does (``summed``: whether NumPy's sum runs, which makes a lone ``-0.0``
    ``0.0``); ``None`` for another shape (values along inner axes, broadcast along outer
    ones): the callbacks.
    """
    batch = layout.batch_shape
    rows = math.prod(batch)
    if shape == ():  # the NumPy API's scalar path (sum_over_rows)
        return (rows, bool(batch)) if rows < 2**31 else None
    aligned = checks.alpha_batch_shape(tuple(shape), len(batch), layout.axis)
    aligned = (1,) * (len(batch) - len(aligned)) + tuple(aligned)  # (as the callbacks see it)
    spread = [i for i, (a, b) in enumerate(zip(aligned, batch, strict=True)) if a == 1 != b]
    varying = [i for i, a in enumerate(aligned) if a != 1]
    group = math.prod(batch[i] for i in spread)
    if (spread and varying and max(varying) > min(spread)) or group >= 2**31:
        return None
    return group, bool(spread)


def _ffi_loss_constants(op_name: str, arguments: dict, integers, layout: Layout, compute):
    """:func:`_ffi_constants` of a loss after ``alpha``: the flags and the labels or target
    ranks ``integers`` (:func:`_ffi_integers`); for top-k cross-entropy then log P_K and
    P_K(1) per row, in float64 as pairs of uint32 words (as the NumPy API computes them from
    ``p_k`` rounded to ``compute``, the callbacks' ``p_k``).
    """
    if op_name == "permutation_cross_entropy":
        if layout.n < 2:
            return None  # (no boundaries: the callbacks)
        flags = np.array([bool(arguments["descending"])], np.int32)
        return "permutation_loss", [flags, integers]
    pk = checks.as_computed(checks.host_value(arguments["p_k"], "p_k"), compute)
    pk = checks.p_k_rows(pk, layout.batch_shape).reshape(-1, pk.shape[-1])
    K = pk.shape[1]
    if K > layout.n:  # (the kernels keep the K terms in a row of scratch of n)
        return None
    with np.errstate(divide="ignore"):
        log_pk = np.log(pk)
    pk1 = np.ascontiguousarray(pk[:, :1])
    flags = np.array([bool(arguments["split_top1"]), K], np.int32)
    return "topk_loss", [flags, integers, _words(log_pk), _words(pk1)]


def _words(values: np.ndarray) -> np.ndarray:
    """float64 ``values`` (rows, w) as uint32 words (rows, 2 w): what the handler reads."""
    return np.ascontiguousarray(values, np.float64).view(np.uint32)


def _ffi_integers(op_name: str, value, layout: Layout):
    """The labels (rows,) or target ranks (rows, n) of a loss's FFI call, int32 or int64 (as
    the handler reads them; exact), or ``None`` for a dtype neither holds exactly (uint32
    without x64, uint64): the callbacks.
    """
    dtype = np.dtype(value.dtype)
    if dtype not in (np.int32, np.int64):
        if dtype.kind not in "iu" or dtype.itemsize > 2:
            return None
        value = value.astype(np.int32)
    shape = (-1,) if op_name == "topk_cross_entropy" else (-1, layout.n)
    return value.reshape(shape)


# --------------------------------------------------------------------------------------------
# A call: the NumPy API's checks on concrete values where there are any and on placeholders
# of the right shape and dtype kind for traced ones, then the kernels of its route.


def _is_traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


try:  # a private module: _refuse_forward_mode goes without it
    from jax._src.interpreters import ad as _ad
except ImportError:  # pragma: no cover - depends on the JAX version
    _ad = None


def _refuse_forward_mode(arrays) -> None:
    """``TypeError`` naming softorder for an argument that carries a forward-mode tangent: under
    ``jax.jit(lambda x: jax.jvp(f, ...))`` JAX refuses a custom_vjp only after the call has
    traced, outside :func:`_run`, in its own words (JAX has no public test for a jvp tracer).
    """
    jvp_tracer = getattr(_ad, "JVPTracer", None)
    if jvp_tracer is not None and any(
        isinstance(value, jvp_tracer) and type(value.tangent).__name__ != "Zero" for value in arrays
    ):
        raise TypeError(_FORWARD_MODE)


def _run(op: Callable, arguments: dict) -> jax.Array:
    """Call the NumPy operation ``op``'s rule from JAX; ``arguments``: every argument of the
    public function, by name. JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp
    function" (eager ``jax.jvp``, ``jax.jacfwd``) becomes an error that names softorder.
    """
    try:
        return _dispatch(op, arguments)
    except TypeError as error:
        if "forward-mode autodiff" not in str(error):
            raise
        raise TypeError(_FORWARD_MODE) from error


def _as_traced(value):
    """``value``, or one traced array for a list or tuple that holds traced values (``[k1, k2]``
    of a jitted function's arguments, a list ``jax.grad`` differentiates): NumPy cannot read
    it, so it is checked and passed as a traced argument.
    """
    if isinstance(value, (list, tuple)) and any(
        _is_traced(leaf) for leaf in jax.tree_util.tree_leaves(value)
    ):
        return jnp.asarray(value)
    return value


def _dispatch(op: Callable, arguments: dict) -> jax.Array:
    names, statics = checks.split_arguments(op.signature.parameters, arguments)
    arguments = {name: _as_traced(arguments[name]) for name in names}
    input_name = names[0]
    checks.refuse_masked(arguments[input_name], input_name)
    try:
        x = jnp.asarray(arguments[input_name])
    except (TypeError, ValueError):  # (None, strings, ragged lists: JAX's words name no
        # argument) the NumPy API's error, naming the input, where it has one
        checks.float_array(arguments[input_name], input_name)
        raise
    default = jax.dtypes.canonicalize_dtype(np.float64)
    compute, out_dtype = input_dtypes(x.dtype, input_name, default)
    x = x.astype(compute)
    layout = Layout.of(x.shape, statics.get("axis", -1), input_name)  # axis, scalar, empty

    arrays = {input_name: x}
    for name in names[1:]:
        value = arguments[name]
        if _is_traced(value):  # its shape and dtype kind
            checks.check_traced(name, value.shape, value.dtype, layout)
        else:  # as NumPy sees it, also rounded to the compute dtype
            checks.check_concrete(name, value, layout, compute)
        value = jnp.asarray(value)
        arrays[name] = value.astype(compute) if name in checks.FLOAT_ARGUMENTS else value
    _refuse_forward_mode(arrays.values())

    route = _route()
    ffi = _ffi_constants(op.__name__, {**arguments, **statics}, arrays, layout, compute, route)
    if ffi is not None:
        handler, constants, group = ffi
        moved = jnp.moveaxis(x, layout.axis, -1)
        operands = (moved.reshape(-1, layout.n), *map(jnp.asarray, constants))
        out = _apply(_Ffi(handler, group), *_vary(operands, _varying_axes(operands)))
        if op.__name__ in _FFI_INTEGERS:  # a loss: one per row
            return _reduced(out.reshape(layout.batch_shape), statics, out_dtype)
        if handler == "quantile" and not several_per_row("q", arguments["q"], moved.ndim - 1):
            return out.reshape(moved.shape[:-1]).astype(out_dtype)  # one q per row
        out = out.reshape(moved.shape[:-1] + out.shape[-1:])
        return jnp.moveaxis(out, -1, layout.axis).astype(out_dtype)

    # one spec for any number of vmapped axes: the axis counts from the end, a loss is
    # computed per row and reduced below, in JAX, per vmapped element
    spec = CallSpec(op.__name__, names, tuple(sorted(statics.items())))
    spec = spec.vmapped(len(layout.batch_shape))
    words = jax.dtypes.canonicalize_dtype(np.int64) != np.int64  # no x64: 64-bit as 2 words
    call = Call.plan(spec, arrays, compute.name, words)
    operands = tuple(arrays[name] for name in names)
    out = _apply(_Callbacks(call, route), *_vary(operands, _varying_axes(operands)))
    return _reduced(out, statics, out_dtype)


def _reduced(out: jax.Array, statics: dict, out_dtype) -> jax.Array:
    """A loss's rows ``out`` reduced as ``statics["reduction"]`` says (in JAX: per vmapped
    element), in ``out_dtype``; another operation's result in ``out_dtype``.
    """
    if statics.get("reduction", "none") != "none":
        out = jnp.sum(out) if statics["reduction"] == "sum" else jnp.mean(out)
    return out.astype(out_dtype)


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
        "Forward mode (``jax.jvp``, ``jax.jacfwd``) raises ``TypeError``, and second "
        "derivatives and derivatives in other arguments ``NotImplementedError``. Concrete "
        "arguments are checked when the function "
        "is traced (in float32 also as rounded to float32); a bad traced value raises "
        ":class:`jax.errors.JaxRuntimeError` when the kernels run."
    ),
)

_ALPHA_NOTE = (
    "``alpha`` may be traced (a learnable temperature) when it is a scalar, one per row, or "
    "varies along leading batch axes only: the handler checks it when it runs (a bad one "
    "raises :class:`jax.errors.JaxRuntimeError` with the NumPy API's message, naming "
    "softorder) and sums the rows' gradients of alpha in float64, as the NumPy API does"
)
_FFI_NOTE = (
    "FFI route: on the CPU backend, with a concrete ``k`` (one per row) or ``q`` (a few per "
    "row), this is an XLA FFI call into numba C functions, with no Python per call; "
    + _ALPHA_NOTE
    + '. Otherwise a callback (see the module\'s "FFI route").'
)
_LOSS_NOTE = (
    "Under ``vmap`` the reduction applies to each vmapped element separately. FFI route: on "
    "the CPU backend, with a concrete ``p_k``, this is an XLA FFI call into numba C "
    "functions, with no Python per call; its {integers} may be traced (data of a training "
    "step): the handler checks them when it runs, and a bad one raises "
    ":class:`jax.errors.JaxRuntimeError` with the NumPy API's message, naming softorder; "
    + _ALPHA_NOTE
    + '. Otherwise a callback (see the module\'s "FFI route").'
)


@documented(_ops.soft_topk, _JAX, notes=_FFI_NOTE)
def soft_topk(
    x: ArrayLike, k: ArrayLike, alpha: ArrayLike = 1.0, *, axis: int = -1, largest: bool = True
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
    return _run(_ops.soft_topk, locals())


@documented(_ops.log_soft_topk, _JAX, notes=_FFI_NOTE)
def log_soft_topk(
    x: ArrayLike, k: ArrayLike, alpha: ArrayLike = 1.0, *, axis: int = -1, largest: bool = True
) -> jax.Array:
    """
    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import softorder.bridges.jax as soj
    >>> soj.log_soft_topk(jnp.array([0.0, 2000.0]), 1, alpha=1.0).round(2)
    Array([-1000.69,    -0.  ], dtype=float32)
    """
    return _run(_ops.log_soft_topk, locals())


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
    return _run(_ops.soft_rank, locals())


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
    return _run(_ops.soft_sort, locals())


@documented(_ops.soft_quantile, _JAX, notes=_FFI_NOTE)
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
    return _run(_ops.soft_quantile, locals())


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
    return _run(_ops.soft_permutation, locals())


@documented(_ops.topk_cross_entropy, _JAX, notes=_LOSS_NOTE.format(integers="labels"))
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
    return _run(_ops.topk_cross_entropy, locals())


@documented(
    _ops.permutation_cross_entropy,
    _JAX,
    notes=_LOSS_NOTE.format(integers="target ranks"),
)
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
    return _run(_ops.permutation_cross_entropy, locals())
