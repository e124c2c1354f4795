"""PyTorch bridge: every softorder operation as a differentiable PyTorch operation.

>>> import torch
>>> import softorder.bridges.torch as sot
>>> x = torch.tensor([[0.3, -1.2, 2.0, 0.7]], requires_grad=True)
>>> p = sot.soft_topk(x, 2, alpha=0.1)          # membership in the top 2
>>> p.detach().round(decimals=3)
tensor([[0.0680, 0.0000, 1.0000, 0.9320]])
>>> p[0, 0].backward()
>>> x.grad.shape
torch.Size([1, 4])

This module adapts PyTorch's types and transforms only: the checks, the call spec and the
dtype policy are the engine's (:mod:`softorder._engine`); what it supports:
``docs/pytorch.rst``. CPU tensors reach the rules as NumPy views, CUDA tensors stay on their
device (:mod:`softorder.bridges._torch_device`). The routes of a call:

- plain eager calls: :class:`_PlainOperation`, whose backward calls the rule's VJP on the
  context its forward kept;
- forward mode and torch.func transforms: :class:`_Operation`, with ``jvp`` and ``vmap``
  rules (:class:`_Batched`); wrapped tensors reach NumPy only through the custom operators;
- ``torch.compile`` and ``torch.jit.trace``: the custom operators ``softorder::forward``
  (whose outputs include the residuals) and ``softorder::backward``, so that
  ``fullgraph=True`` traces, and a trace records the operation, not its result.

Derivatives of gradients and tangents raise (:class:`_FirstOrderOnly`). Private PyTorch APIs
are used only through :mod:`softorder.bridges._torch_compat`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch
from torch import Tensor, nn

from softorder import core, operations
from softorder._docs import Dialect, documented
from softorder._engine import checks
from softorder._engine.autodiff import rule_named
from softorder._engine.call import (
    CallSpec,
    compute_dtype,
    gradient_positions,
    reduction_scale,
    refuse_derivatives,
)
from softorder.bridges import _torch_compat as compat

__all__ = [
    "PermutationCrossEntropyLoss",
    "TopKCrossEntropyLoss",
    "log_soft_topk",
    "permutation_cross_entropy",
    "soft_permutation",
    "soft_quantile",
    "soft_rank",
    "soft_sort",
    "soft_topk",
    "topk_cross_entropy",
]

core.set_parallel(False)  # next to PyTorch's threads, the kernels run on the calling thread

#: the positional arguments of each operation (the input first), by name
_POSITIONAL = {
    n: checks.positional(getattr(operations, n).signature.parameters)
    for n in __all__
    if n.islower()
}
_INPUT_NAMES = {n: names[0] for n, names in _POSITIONAL.items()}
_RULES = {n: rule_named(n) for n in _POSITIONAL}
#: where the input's gradient is among each rule's VJP results
_INPUT_POSITIONS = {n: r.differentiable.index(r.input_name) for n, r in _RULES.items()}
_PLAIN_TYPES = checks.PLAIN_TYPES
_WIDE_FLOATS = frozenset((torch.float32, torch.float64))
_STRIDED = torch.strided
#: device types whose tensors the rules take as they are; CPU tensors reach them as NumPy views
_ON_DEVICE = {"cuda"}


@compat.mark_constant  # run, not traced, by torch.compile: the spec is a constant string
def _encode(name: str, tensor_names: tuple, statics: tuple) -> str:
    return CallSpec(name, tensor_names, statics).encode()


def _arrays(call: CallSpec | _Call, tensors, fakes: bool = False) -> list:
    """:func:`_as_array` of each tensor; with ``fakes``, fake tensors as they are (shapes)."""
    input_name = call.rule.input_name
    return [
        t if fakes and compat.is_fake(t) else _as_array(t, name == input_name)
        for name, t in zip(call.names, tensors, strict=True)
    ]


def _as_array(t: Tensor, on_device: bool = True):
    """What the rules read of a tensor (never a wrapped one: custom operators and Functions
    unwrap them): a NumPy view of CPU memory; a GPU tensor as it is when ``on_device`` (the
    input, cotangents, tangents, residuals), else copied to the host, where the rules check it.
    """
    if t.is_cpu and "cpu" not in _ON_DEVICE or t.device.type not in _ON_DEVICE:
        return t.numpy(force=True)  # (a view of a CPU tensor; the meta device raises)
    t = t.detach()
    return t if on_device else t.cpu().numpy()


def _as_tensor(arr, dtype: torch.dtype | None = None) -> Tensor:
    """A result of the rules as a tensor (of ``dtype``, if given), sharing its memory."""
    if isinstance(arr, Tensor):  # computed on the device
        out = arr
    else:
        if type(arr) is not np.ndarray:
            arr = np.asarray(arr)  # (not ascontiguousarray: it makes 0-d results 1-d)
        out = torch.from_numpy(arr if arr.flags.c_contiguous else arr.copy())
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


def _gradient(grad, like: Tensor) -> Tensor:
    """A gradient from the rules as a tensor of its argument's dtype and device."""
    if type(grad) is np.ndarray and like.is_cpu and grad.flags.c_contiguous:  # the common case
        out = torch.from_numpy(grad)
        return out if out.dtype == like.dtype else out.to(like.dtype)
    out = _as_tensor(grad, like.dtype)
    return out if like.is_cpu and out.is_cpu or out.device == like.device else out.to(like.device)


# --- custom operators: the compiled path, and torch.func's way to the values ----------------


@compat.custom_op("softorder::forward", "(str spec, Tensor[] tensors) -> Tensor[]")
def _forward_op(spec: str, tensors: list[Tensor]) -> list[Tensor]:
    if compat.forward_mode_active():
        # the operator has no forward-mode formula: PyTorch would give a zero tangent (a
        # traced or exported function run under torch.func.jvp or forward_ad)
        raise NotImplementedError(_FORWARD_MODE_OPERATOR)
    call = CallSpec.decode(spec)
    ctx, out = call.run(_arrays(call, tensors))
    # contiguous, as the fake says (a device result along another dim is a moved view, which
    # inductor would assert against the fake's strides)
    outs = [out, *call.rule.residuals(ctx).values()]
    return [_as_tensor(a).contiguous() for a in outs]


@_forward_op.register_fake
def _(spec, tensors):
    call = CallSpec.decode(spec)
    shape, residuals = call.rule.describe(call.arguments(_arrays(call, tensors, fakes=True)))
    x = tensors[call.names.index(call.rule.input_name)]
    dtype = {d: torch.from_numpy(np.empty(0, d)).dtype for _, d in residuals.values()}
    return [x.new_empty(shape), *(x.new_empty(s, dtype=dtype[d]) for s, d in residuals.values())]


def _restore(spec: str, tensors, residuals) -> tuple[CallSpec, object]:
    """The spec and the rule's context for the gradients (from the residuals, if any)."""
    call = CallSpec.decode(spec)
    saved = residuals and dict(
        zip(call.rule.residual_names, map(_as_array, residuals), strict=True)
    )
    return call, call.restore(_arrays(call, tensors), saved)


@compat.custom_op(
    "softorder::backward",
    "(str spec, Tensor[] tensors, Tensor[] residuals, Tensor cotangent) -> Tensor[]",
)
def _backward_op(
    spec: str, tensors: list[Tensor], residuals: list[Tensor], cotangent: Tensor
) -> list[Tensor]:
    call, ctx = _restore(spec, tensors, residuals)
    grads = call.gradients(ctx, _as_array(cotangent))
    wanted = call.differentiable()
    # contiguous, as the fake says (not the argument's strides: a transposed input's)
    return [
        _gradient(g, tensors[call.names.index(n)]).contiguous()
        for n, g in zip(wanted, grads, strict=True)
    ]


@_backward_op.register_fake
def _(spec, tensors, residuals, cotangent):
    call = CallSpec.decode(spec)
    like = [tensors[call.names.index(n)] for n in call.differentiable()]
    return [t.new_empty(t.shape) for t in like]


@compat.custom_op(
    "softorder::pushforward",
    "(str spec, Tensor[] tensors, Tensor[] residuals, str tangent_names, Tensor[] tangents, "
    "Tensor like) -> Tensor",
)
def _pushforward_op(
    spec: str,
    tensors: list[Tensor],
    residuals: list[Tensor],
    tangent_names: str,
    tangents: list[Tensor],
    like: Tensor,
) -> Tensor:
    call, ctx = _restore(spec, tensors, residuals)
    tangent_of = dict(zip(json.loads(tangent_names), map(_as_array, tangents), strict=True))
    return _as_tensor(call.rule.jvp(ctx, tangent_of), like.dtype).contiguous()


@_pushforward_op.register_fake
def _(spec, tensors, residuals, tangent_names, tangents, like):
    # the tangent has the result's shape (``like`` gives only its dtype and device)
    call = CallSpec.decode(spec)
    shape, _ = call.rule.describe(call.arguments(_arrays(call, tensors, fakes=True)))
    return like.new_empty(shape)


_FORWARD_MODE_OPERATOR = (
    "softorder: forward-mode derivatives (torch.func.jvp, jacfwd, torch.autograd.forward_ad) "
    "of a softorder operation inside a torch.jit.trace, torch.export or torch.compile graph "
    "are not supported; call the operation in eager code, where forward mode works"
)


# --- second derivatives: refused, never silently zero ----------------------------------------

_SECOND_ORDER = (
    "softorder: second derivatives of softorder operations are not supported (the derivative "
    "of a gradient or of a forward-mode tangent: backward through a create_graph=True "
    "gradient, gradgradcheck, torch.func.grad of grad, hessian, jacfwd(jacrev(...)), jvp of "
    "grad); first derivatives are exact, in reverse and forward mode (for forward mode use "
    "torch.func.jvp or torch.autograd.forward_ad: torch.autograd.functional.jvp "
    "differentiates a gradient)"
)


def _no_second_derivative(ctx, *grads):
    raise NotImplementedError(_SECOND_ORDER)


def _save_nothing(ctx, inputs, output):
    pass


for _op in (_backward_op, _pushforward_op):
    _op.register_autograd(_no_second_derivative, setup_context=_save_nothing)


class _FirstOrderOnly(torch.autograd.Function):
    """``apply(count, *values, *anchors)``: copies of the ``count`` values (gradients or
    tangents computed outside autograd) recorded as depending on the anchors, so that
    differentiating them raises :data:`_SECOND_ORDER`.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(count: int, *tensors: Tensor):
        # copies, not views: a view made in a custom Function refuses in-place updates
        return tuple(t.clone() for t in tensors[:count])

    setup_context = staticmethod(_save_nothing)
    backward = jvp = staticmethod(_no_second_derivative)


def _first_order_only(values: list, anchors) -> list:
    """``values`` (tensors or ``None``) tied to ``anchors`` by :class:`_FirstOrderOnly` when
    they may be differentiated: under torch.func, or in grad mode (``create_graph=True``, or
    a tangent computed in grad mode) when an anchor is tracked by autograd or forward AD.
    """
    if _wrapped(*anchors):  # torch.func: each transform level decides for itself
        anchors = [t for t in anchors if t is not None]
    elif torch.is_grad_enabled():
        unpack = torch.autograd.forward_ad.unpack_dual
        anchors = [
            t
            for t in anchors
            if t is not None and (t.requires_grad or unpack(t).tangent is not None)
        ]
    else:
        return values
    present = [i for i, v in enumerate(values) if v is not None]
    if not anchors or not present:
        return values
    tied = iter(_FirstOrderOnly.apply(len(present), *(values[i] for i in present), *anchors))
    return [next(tied) if v is not None else None for v in values]


def _wrapped(*tensors) -> bool:
    return any(t is not None and compat.is_wrapped(t) for t in tensors)


def _detached(tensors) -> list[Tensor]:
    return [t.detach() for t in tensors]


# --- autograd of the compiled path: the forward operator's formula ---------------------------


def _setup_compiled(ctx, inputs, output):
    spec, tensors = inputs
    ctx.spec, ctx.count = spec, len(tensors)
    ctx.save_for_backward(*tensors, *output[1:])


def _backward_compiled(ctx, grads):
    saved = ctx.saved_tensors
    tensors, residuals = saved[: ctx.count], saved[ctx.count :]
    if grads[0] is None:  # the result was not used
        return None, [None] * len(tensors)
    # (the tensors stay attached: a derivative of the gradient reaches _no_second_derivative)
    return None, CallSpec.decode(ctx.spec).select(
        [t.is_floating_point() for t in tensors],
        lambda: _backward_op(ctx.spec, list(tensors), _detached(residuals), grads[0]),
    )


_forward_op.register_autograd(_backward_compiled, setup_context=_setup_compiled)


# --- vmap: one call with one more batch dimension --------------------------------------------


class _Batched:
    """A call under one ``vmap`` level as one call: the vmapped dimension leads every
    argument (expanded where it is not batched), with the engine's unit dimensions after it
    (:meth:`CallSpec.inserts`); a loss is computed per row (:meth:`CallSpec.vmapped`) and
    reduced here, per vmapped element.
    """

    def __init__(self, size: int, call: CallSpec, tensors, in_dims):
        self.size, self.names, self.reduction = size, call.names, call.reduction
        index = self.names.index(call.rule.input_name)
        batch_ndim = tensors[index].dim() - (in_dims[index] is not None) - 1
        self.shapes = {  # per vmapped element
            arg: tuple(t.shape) if d is None else tuple(t.shape[:d] + t.shape[d + 1 :])
            for arg, t, d in zip(self.names, tensors, in_dims, strict=True)
        }
        ndims = [len(s) for s in self.shapes.values()]
        self.inserts = dict(zip(self.names, call.inserts(ndims, batch_ndim), strict=True))
        self.call = call.vmapped(batch_ndim, size)
        self.spec = _encode(*self.call)
        self.tensors = [
            self.move(a, t, d) for a, t, d in zip(self.names, tensors, in_dims, strict=True)
        ]

    def leading(self, t: Tensor, d) -> Tensor:
        """``t`` with the vmapped dimension first (expanded when ``d`` is ``None``)."""
        return t.movedim(d, 0) if d is not None else t.expand(self.size, *t.shape)

    def move(self, arg: str, t: Tensor, d) -> Tensor:
        """Argument ``arg`` (or a tangent shaped like it) for the batched call."""
        t = self.leading(t, d)
        return t.reshape(t.shape[:1] + (1,) * self.inserts[arg] + t.shape[1:])

    def reduce(self, out: Tensor) -> Tensor:
        """The per-row losses (or their tangents) reduced per vmapped element."""
        if self.reduction == "none" or out.dim() <= 1:
            return out
        dims = tuple(range(1, out.dim()))
        return out.mean(dim=dims) if self.reduction == "mean" else out.sum(dim=dims)

    def cotangent(self, cotangent: Tensor, d) -> Tensor:
        """The cotangent of the per-row losses, from that of their reduction."""
        cotangent = self.leading(cotangent, d)
        if self.reduction == "none":
            return cotangent
        shape = self.call.rule.describe(self.call.arguments(self.tensors))[0]
        if len(shape) <= 1:
            return cotangent.reshape(shape)
        scale = reduction_scale(self.reduction, math.prod(shape[1:]))
        cotangent = cotangent.reshape((self.size,) + (1,) * (len(shape) - 1)).expand(shape)
        return cotangent * scale if scale != 1.0 else cotangent

    def residuals(self, residuals, dims) -> list[Tensor]:
        return [self.leading(r, d) for r, d in zip(residuals, dims, strict=True)]


@torch.library.register_vmap(_backward_op)
def _(info, in_dims, spec, tensors, residuals, cotangent):
    _, tensor_dims, residual_dims, cotangent_dim = in_dims
    batched = _Batched(info.batch_size, CallSpec.decode(spec), tensors, tensor_dims)
    residuals = batched.residuals(residuals, residual_dims)
    cotangent = batched.cotangent(cotangent, cotangent_dim)
    grads = _backward_op(batched.spec, batched.tensors, residuals, cotangent)
    wanted = batched.call.differentiable()
    shapes = [(batched.size, *batched.shapes[n]) for n in wanted]
    return [g.reshape(s) for g, s in zip(grads, shapes, strict=True)], [0] * len(grads)


@torch.library.register_vmap(_pushforward_op)
def _(info, in_dims, spec, tensors, residuals, tangent_names, tangents, like):
    _, tensor_dims, residual_dims, _, tangent_dims, _ = in_dims
    batched = _Batched(info.batch_size, CallSpec.decode(spec), tensors, tensor_dims)
    names = json.loads(tangent_names)
    moved = [batched.move(n, t, d) for n, t, d in zip(names, tangents, tangent_dims, strict=True)]
    residuals = batched.residuals(residuals, residual_dims)
    out = _pushforward_op(batched.spec, batched.tensors, residuals, tangent_names, moved, like)
    return batched.reduce(out), 0


# --- the eager path: autograd Functions that call the rules directly -------------------------


class _Call:
    """One eager call: its spec's parts (cheaper than a CallSpec) and, after the forward pass,
    the rule's context, which the backward and forward-mode passes use.
    """

    __slots__ = ("ctx", "name", "names", "rule", "statics")

    def __init__(self, name: str, names: tuple, statics: dict):
        self.name, self.names, self.statics = name, names, statics
        self.rule, self.ctx = _RULES[name], None

    def spec(self) -> CallSpec:
        return CallSpec(self.name, self.names, tuple(self.statics.items()))

    def residual_tensors(self) -> list[Tensor]:
        """The residuals of the forward pass; none when it ran as another call (``vmap``)."""
        if self.ctx is None:
            return []
        return [_as_tensor(a) for a in self.rule.residuals(self.ctx).values()]


def _values(ctx, call: _Call, *tensors: Tensor) -> Tensor:
    """The result of a call's forward pass; the rule's context is left in ``call.ctx``. With
    ``ctx`` (:class:`_PlainOperation`'s forward) the call and the tensors are saved there.
    """
    if ctx is not None:
        ctx.call = call
        ctx.save_for_backward(*tensors)
    rule = call.rule
    if len(tensors) == 1 and tensors[0].is_cpu and "cpu" not in _ON_DEVICE:  # the common case
        call.ctx = context = rule.prepare(tensors[0].numpy(), **call.statics)
    else:
        arrays = dict(zip(call.names, _arrays(call, tensors), strict=True))
        call.ctx = context = rule.prepare(**call.statics, **arrays)
    out = rule.forward(context)
    if type(out) is np.ndarray and out.flags.c_contiguous:  # the common case
        return torch.from_numpy(out)
    return _as_tensor(out)


class _Operation(compat.FastApplyFunction):
    """Eager autograd for one call: reverse mode, forward mode and ``vmap``."""

    @staticmethod
    def forward(call: _Call, *tensors: Tensor) -> Tensor:
        return _values(None, call, *tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call, *tensors = inputs
        ctx.save_for_backward(*tensors)
        if compat.forward_mode_possible():
            ctx.save_for_forward(*tensors)
            ctx.dtype = output.dtype  # for tangents
            # no zero tangents in place of missing ones: a tangent given for an argument
            # without derivatives (p_k) must be told from none (refuse_derivatives)
            ctx.set_materialize_grads(False)

    @staticmethod
    def vmap(info, in_dims, call, *tensors):
        batched = _Batched(info.batch_size, call.spec(), tensors, in_dims[1:])
        spec = batched.call
        out = _Operation.apply(_Call(spec.op, spec.names, dict(spec.statics)), *batched.tensors)
        return batched.reduce(out), 0

    @staticmethod
    def backward(ctx, cotangent):
        call, tensors = ctx.call, ctx.saved_tensors
        refuse_derivatives(call.name, call.rule, call.names, ctx.needs_input_grad[1:])
        if compat.is_wrapped(cotangent) or any(map(compat.is_wrapped, tensors)):
            # under torch.func the values reach NumPy only through a custom operator
            spec, residuals = call.spec(), call.residual_tensors()
            grads = spec.select(
                ctx.needs_input_grad[1:],
                lambda: _backward_op(
                    _encode(*spec), _detached(tensors), residuals, cotangent.detach()
                ),
            )
            return None, *_first_order_only(grads, (*tensors, cotangent))
        needs = ctx.needs_input_grad  # (the first is the call's)
        grads, values = [None] * len(needs), None
        for i, position in gradient_positions(call.rule, call.names):
            if needs[i + 1]:
                if values is None:
                    values = call.rule.vjp(call.ctx, _as_array(cotangent))
                grads[i + 1] = _gradient(values[position], tensors[i])
        if not torch.is_grad_enabled():  # plain eager backward: the gradients are values
            return tuple(grads)
        return None, *_first_order_only(grads[1:], (*tensors, cotangent))

    @staticmethod
    def jvp(ctx, _call_tangent, *tangents):
        call, saved = ctx.call, ctx.saved_tensors
        refuse_derivatives(call.name, call.rule, call.names, [t is not None for t in tangents])
        given = [
            (name, t)
            for name, t in zip(call.names, tangents, strict=True)
            if t is not None and name in call.rule.differentiable
        ]
        if _wrapped(*(t for _, t in given), *saved):
            out = _pushforward_op(
                _encode(*call.spec()),
                _detached(saved),
                call.residual_tensors(),
                json.dumps([name for name, _ in given]),
                _detached(t for _, t in given),
                torch.empty((), dtype=ctx.dtype, device=saved[0].device),
            )
        else:
            tangent_of = {name: _as_array(t) for name, t in given}
            out = _as_tensor(call.rule.jvp(call.ctx, tangent_of), ctx.dtype)
        return _first_order_only([out], (*saved, *tangents))[0]


@compat.direct_backward
class _PlainOperation(compat.FastApplyFunction):
    """:class:`_Operation` outside transforms and dual levels, in PyTorch's older form
    (``forward`` sets up the context: one Python call less); its backward goes straight to
    the rule in the common case (one CPU input, grad mode off). This is the per-call floor.
    """

    forward = staticmethod(_values)

    @staticmethod
    def backward(ctx, cotangent):
        tensors = ctx.saved_tensors  # (also PyTorch's check for in-place changes)
        if (
            len(tensors) != 1
            or torch.is_grad_enabled()  # (create_graph)
            or not cotangent.is_cpu
            or "cpu" in _ON_DEVICE
            or compat.is_wrapped(cotangent)
        ):
            return _Operation.backward(ctx, cotangent)
        call = ctx.call  # (grad mode is off here: numpy() takes the cotangent as it is)
        # the input is the only tensor: alpha is a number, whose gradient nobody asks for
        call.ctx.alpha_wanted = False
        grad = call.rule.vjp(call.ctx, cotangent.numpy())[_INPUT_POSITIONS[call.name]]
        return None, _gradient(grad, tensors[0])


# --- the public functions' call --------------------------------------------------------------


def _run(name: str, x, arguments: dict) -> Tensor:
    """Operation ``name`` (the name: dynamo in torch 2.15 reads a wrapped function's
    ``__name__`` as its code's) on the input ``x`` and the public function's other
    ``arguments``, ``dim`` as ``axis``. The common case (plain settings and numbers, a plain CPU
    tensor of a wide float dtype, a valid int ``dim``, no transform) is decided first, in few
    steps: this is the per-call floor.
    """
    statics = arguments
    for arg, value in arguments.items():
        if type(value) in _PLAIN_TYPES:
            continue
        data = _plain_data(value)
        if data is None:
            break
        if statics is arguments:
            statics = dict(arguments)
        statics[arg] = data
    else:
        if (
            type(x) is Tensor
            and x.is_cpu
            and x.dtype in _WIDE_FLOATS
            and x.layout is _STRIDED
            and "cpu" not in _ON_DEVICE
            and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing()
            and not (compat.transforms_active() or compat.is_wrapped(x) or compat.dual_level_open())
        ):
            try:
                shape = x.shape
            except RuntimeError:  # a nested tensor (PyTorch's "internal error"): refused
                _check_dense(x, _INPUT_NAMES[name])
                raise
            dim = arguments.get("axis", -1)
            if type(dim) is int and -len(shape) <= dim < len(shape) and shape[dim]:
                call = _Call(name, (_INPUT_NAMES[name],), statics)
                if x.requires_grad and torch.is_grad_enabled():
                    return _PlainOperation.c_apply(call, x)
                return _values(None, call, x)  # nothing to differentiate: no Function
    input_name = _INPUT_NAMES[name]
    if not isinstance(x, Tensor):
        if type(x).__module__.startswith("torch.fx"):  # a Proxy: torch.fx.symbolic_trace
            raise TypeError(
                f"softorder: torch.fx.symbolic_trace cannot trace into {name} (it runs NumPy "
                f"kernels): make it a leaf of the graph with torch.fx.wrap({name!r}) at the top "
                f"of the module that calls it (as 'from softorder.bridges.torch import {name}'),"
                " or use torch.compile or torch.export, which record it as an operator"
            )
        raise TypeError(f"{input_name} must be a torch.Tensor; got {type(x).__name__}")
    if not x.is_floating_point():  # (the engine computes integers; this bridge refuses them)
        raise TypeError(f"{input_name} must be a floating point tensor; got dtype {x.dtype}")
    compiling = torch.compiler.is_compiling()
    if compiling:
        _traceable(name, arguments, x.dim())
    every = {input_name: x, **arguments}
    names, statics = checks.split_arguments(_POSITIONAL[name], every, _is_tensor)
    tensors = [_tensor(every[arg], arg) for arg in names]
    # (torch.jit.trace: sizes are traced values, so the operator checks for an empty dim)
    tracing = torch.jit.is_tracing()
    if "axis" in statics:
        dim, shape = statics["axis"], x.shape
        if not (type(dim) is int and -x.dim() <= dim < x.dim() and (tracing or shape[dim])):
            statics["axis"] = checks.check_axis(dim, tuple(shape), input_name, "dim")
    if compiling or tracing:
        # torch.jit.trace records the custom operator (a call of the NumPy kernels would be
        # recorded as its result: a constant, whatever the traced function is given later)
        if torch.is_grad_enabled():  # (the compiled backward cannot tell which it is asked for)
            _refuse_derivatives(name, names, tuple(t.requires_grad for t in tensors))
        out = _forward_op(_encode(name, names, tuple(statics.items())), tensors)[0]
    else:
        call = _Call(name, names, statics)
        if compat.transforms_active() or any(map(compat.is_wrapped, tensors)):
            out = _Operation.apply(call, *tensors)
        elif compat.dual_level_open():  # (FastApplyFunction.apply's checks, made)
            out = _Operation.c_apply(call, *tensors)
        else:
            out = _PlainOperation.c_apply(call, *tensors)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _plain_data(value):
    """An argument that the common case passes to the rules as data, with nothing to
    differentiate: a CPU tensor that does not require grad (labels, ranks, ``p_k``, of an
    integer or a wide float dtype) as a NumPy view, a list or tuple of plain values as it is;
    ``None`` for anything else (the general path's), under ``torch.compile`` (dynamo cannot
    trace ``is_wrapped``), under torch.func transforms (where even ``detach`` wraps) and under
    ``torch.jit.trace`` (which would record a NumPy view's values as constants).
    """
    if torch.compiler.is_compiling() or compat.transforms_active() or torch.jit.is_tracing():
        return None
    if type(value) is Tensor:
        if (
            value.is_cpu
            and value.layout is _STRIDED
            and not value.requires_grad
            and (value.dtype in _WIDE_FLOATS or not value.is_floating_point())
            and not value.is_nested
            and not compat.is_wrapped(value)
        ):
            return value.numpy(force=True)
        return None
    if type(value) in (list, tuple) and all(type(v) in _PLAIN_TYPES for v in value):
        return value
    return None


def _is_tensor(value) -> bool:
    return isinstance(value, Tensor)


def _tensor(t: Tensor, name: str) -> Tensor:
    """A tensor argument as the rules take it: dense, on a device with kernels, in the
    engine's compute dtype (:func:`softorder._engine.call.compute_dtype`).
    """
    _check_dense(t, name)
    if not t.is_cpu:
        _backend_for(t.device)
    if t.is_floating_point() and t.dtype not in _WIDE_FLOATS:
        t = t.to(getattr(torch, compute_dtype(str(t.dtype).removeprefix("torch."))))
    return t


def _backend_for(device: torch.device) -> None:
    """Check that tensors of ``device`` can be computed on: CUDA tensors run the numba-cuda
    kernels (:mod:`softorder.bridges._torch_device`); other devices raise (no silent copy).
    """
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise NotImplementedError(
            f"softorder has no kernels for {device.type} tensors; move the input to the CPU "
            "explicitly, e.g. x.cpu(), if a host round trip is acceptable"
        )
    try:
        from softorder.bridges import _torch_device
    except ImportError as error:  # pragma: no cover - depends on the installation
        raise ImportError(
            "softorder's CUDA kernels need the numba-cuda package: "
            'pip install "softorder[cuda]" (or "numba-cuda[cu12]" / "numba-cuda[cu13]")'
        ) from error
    _torch_device.backend_for(device)


def _check_dense(t: Tensor, name: str) -> None:
    """``TypeError`` naming softorder for a tensor the kernels cannot read as one array
    (where PyTorch's own errors speak of other things).
    """
    if t.is_nested:
        raise TypeError(
            f"softorder does not take nested tensors ({name}): give rows of one length, e.g. "
            f"torch.nested.to_padded_tensor({name}, float('-inf')), a padding that "
            "soft_topk(largest=True) ignores"
        )
    if t.layout is not _STRIDED:
        raise TypeError(
            f"softorder takes dense (strided) tensors; {name} has layout {t.layout}: "
            f"pass {name}.to_dense()"
        )


# --- torch.compile: what dynamo traces, and what it refuses ----------------------------------


def _traceable(name: str, arguments: dict, ndim: int) -> None:
    """The arguments as torch.compile can pass them, in place: NumPy scalars (which dynamo
    traces as arrays) and numbers that are data (which it may turn into symbols, which the
    constant spec cannot hold) as tensors; settings given as NumPy values refused.
    """
    _no_transforms_when_compiling()
    for arg, value in arguments.items():
        numpy = isinstance(value, (np.ndarray, np.generic))
        if arg not in _POSITIONAL[name]:  # a setting
            if arg == "axis" and type(value) is int:
                # a dim that changed between calls is a symbol (of type int, to dynamo), which
                # the constant spec cannot hold: comparing specializes it (a loop: dynamo
                # before PyTorch 2.7 cannot trace next() with a default)
                for d in range(-ndim, ndim):
                    if value == d:
                        arguments[arg] = d
                        break
                else:  # (out of range; a symbol, which _check_dim cannot take, gets dynamo's)
                    _check_dim(value, ndim, _INPUT_NAMES[name])
            elif arg == "axis" and not numpy:
                _check_dim(value, ndim, _INPUT_NAMES[name])
            elif numpy:
                shown = "dim" if arg == "axis" else arg
                _refuse(
                    f"softorder under torch.compile: {shown} must be a Python int or bool, not "
                    f"a NumPy value (e.g. {shown}=int(value) or bool(value))"
                )
        elif numpy and value.ndim == 0:
            arguments[arg] = torch.as_tensor(value)
        elif type(value) in (float, int) or type(value) in (list, tuple) and _rectangular(value):
            # numbers (also in a list: k, q, alpha, labels, p_k, target ranks) become symbols
            # when they change between calls; an int label stays an integer
            floats = arg in checks.FLOAT_ARGUMENTS or type(value) is float
            arguments[arg] = torch.tensor(value, dtype=torch.float64 if floats else None)
            if arguments[arg].is_floating_point():
                arguments[arg] = arguments[arg].to(torch.float64)


def _rectangular(value) -> bool:
    """Whether nested lists or tuples of Python numbers have one length per level (anything
    else is left to the engine's check, whose error names the argument).
    """
    if not value or type(value[0]) not in (list, tuple):
        return all(type(v) in (int, float, bool) for v in value)
    length = len(value[0])
    return all(type(v) in (list, tuple) and len(v) == length and _rectangular(v) for v in value)


@compat.mark_constant  # run, not traced, by torch.compile
def _no_transforms_when_compiling() -> None:
    """Refuse forward mode in compiled code, where the custom operators would give zero
    tangents, and the other torch.func transforms, which the compiled path's operators do not
    support (PyTorch's own error there speaks of fake tensors and setup_context). Run at
    trace time, where functorch's stack holds the transforms traced.
    """
    if compat.forward_mode_active():
        raise NotImplementedError(
            "softorder under torch.compile: forward-mode derivatives (torch.func.jvp, "
            "jacfwd, forward_ad) are not supported in compiled code; call the softorder "
            "operation outside torch.compile, where forward mode works"
        )
    if compat.transforms_traced():
        raise NotImplementedError(
            "softorder under torch.compile: torch.func transforms (vmap, grad, vjp, jacrev) "
            "are not supported in compiled code; apply them outside torch.compile, where "
            "they work, or compile the function without the transform (torch.autograd "
            "gradients and batch dimensions work in compiled code)"
        )


@compat.mark_constant  # run, not traced, by torch.compile: its error keeps its message
def _check_dim(dim, ndim: int, name: str) -> None:
    """The eager path's error for a ``dim`` that is no int, or out of range: raised in traced
    code, dynamo would report an "Observed exception" without its text.
    """
    checks.check_axis(dim, (1,) * ndim, name, "dim")


@compat.mark_constant  # run, not traced, by torch.compile: its error keeps its message
def _refuse_derivatives(name: str, names: tuple, wanted: tuple) -> None:
    refuse_derivatives(name, _RULES[name], names, wanted)


@compat.mark_constant  # run, not traced, by torch.compile
def _refuse(message: str) -> None:
    """Raise ``TypeError(message)`` from traced code with its text: dynamo runs this function
    and reports what it raised, while a ``raise`` in traced code loses the message.
    """
    raise TypeError(message)


_TORCH = Dialect(
    names={"axis": "dim"},
    words=(
        (r"``axis``", "``dim``"),
        (r"\ban axis\b", "a dimension"),
        (r"\bAxis\b", "Dimension"),
        (r"\baxis\b", "dimension"),
        (r"\baxes\b", "dimensions"),
        (r"\ban array\b", "a tensor"),
        (r"\barray\b", "tensor"),
        (r"\bndarray\b", "Tensor"),
    ),
    types=(
        (r"float or array_like", "float, sequence or Tensor"),
        (r"\barray_like\b", "Tensor"),
        (r"\bndarray\b", "Tensor"),
    ),
    kinds={"p_k": "sequence or Tensor"},
    about="The PyTorch version of :func:`softorder.{name}`: the same kernels and values.",
    note=(
        "PyTorch: the input must be a floating-point tensor (narrower ones are computed in "
        "float32) on the CPU or, with ``numba-cuda``, a CUDA device; the result has its "
        "dtype and device. Differentiable in {differentiable} (when tensors that require "
        "grad): reverse and forward mode, :mod:`torch.func` transforms, and reverse mode "
        "under :func:`torch.compile`. Second derivatives, and derivatives in other arguments, "
        "raise ``NotImplementedError``."
    ),
)


@documented(operations.soft_topk, _TORCH)
def soft_topk(
    x: Tensor, k: float | Tensor, alpha: float | Tensor = 1.0, *, dim: int = -1, largest=True
) -> Tensor:
    """
    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> p = sot.soft_topk(torch.tensor([3.0, 1.0, 2.0, -5.0]), 2, alpha=0.01)
    >>> p.round(decimals=3), float(p.sum())
    (tensor([1., 0., 1., 0.]), 2.0)
    """
    return _run("soft_topk", x, {"k": k, "alpha": alpha, "largest": largest, "axis": dim})


@documented(operations.log_soft_topk, _TORCH)
def log_soft_topk(
    x: Tensor, k: float | Tensor, alpha: float | Tensor = 1.0, *, dim: int = -1, largest=True
) -> Tensor:
    """
    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> sot.log_soft_topk(torch.tensor([0.0, 2000.0], dtype=torch.float64), 1, alpha=1.0)
    tensor([-1000.6931,    -0.0000], dtype=torch.float64)
    """
    return _run("log_soft_topk", x, {"k": k, "alpha": alpha, "largest": largest, "axis": dim})


@documented(operations.soft_rank, _TORCH)
def soft_rank(
    x: Tensor, alpha: float | Tensor = 1.0, *, dim: int = -1, descending: bool = False
) -> Tensor:
    """
    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> sot.soft_rank(torch.tensor([0.5, -1.0, 3.0]), alpha=0.01)
    tensor([2., 1., 3.])
    """
    return _run("soft_rank", x, {"alpha": alpha, "descending": descending, "axis": dim})


@documented(operations.soft_sort, _TORCH)
def soft_sort(
    x: Tensor, alpha: float | Tensor = 1.0, *, dim: int = -1, descending: bool = False
) -> Tensor:
    """
    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> sot.soft_sort(torch.tensor([2.0, -1.0, 0.5]), alpha=0.001)
    tensor([-1.0000,  0.5000,  2.0000])
    """
    return _run("soft_sort", x, {"alpha": alpha, "descending": descending, "axis": dim})


@documented(operations.soft_quantile, _TORCH)
def soft_quantile(
    x: Tensor, q: float | Tensor, alpha: float | Tensor = 1.0, *, dim: int = -1
) -> Tensor:
    """
    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> x = torch.tensor([4.0, 1.0, 3.0, 2.0], dtype=torch.float64)
    >>> sot.soft_quantile(x, torch.tensor([0.25, 0.75]), alpha=1e-3)
    tensor([1.5000, 3.5000], dtype=torch.float64)
    """
    return _run("soft_quantile", x, {"q": q, "alpha": alpha, "axis": dim})


@documented(operations.soft_permutation, _TORCH)
def soft_permutation(
    x: Tensor, alpha: float | Tensor = 1.0, *, dim: int = -1, descending: bool = False
) -> Tensor:
    """
    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> x = torch.tensor([0.2, -3.0, 1.0])
    >>> P = sot.soft_permutation(x, alpha=0.01)
    >>> P @ x
    tensor([-3.0000,  0.2000,  1.0000])
    """
    return _run("soft_permutation", x, {"alpha": alpha, "descending": descending, "axis": dim})


@documented(operations.topk_cross_entropy, _TORCH)
def topk_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    p_k,
    alpha: float | Tensor = 1.0,
    *,
    reduction: str = "mean",
    split_top1: bool = False,
) -> Tensor:
    """
    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> logits = torch.tensor([[2.0, 1.0, 0.1, -1.0], [0.0, 3.0, 1.0, 2.0]], requires_grad=True)
    >>> loss = sot.topk_cross_entropy(logits, torch.tensor([1, 0]), [0.5, 0.5], alpha=0.5)
    >>> loss.backward()
    >>> round(loss.item(), 4), logits.grad.shape
    (2.4966, torch.Size([2, 4]))
    """
    arguments = {"labels": labels, "p_k": p_k, "alpha": alpha, "reduction": reduction}
    return _run("topk_cross_entropy", logits, {**arguments, "split_top1": split_top1})


@documented(operations.permutation_cross_entropy, _TORCH)
def permutation_cross_entropy(
    x: Tensor,
    target_ranks: Tensor,
    alpha: float | Tensor = 1.0,
    *,
    reduction: str = "mean",
    descending: bool = False,
) -> Tensor:
    """
    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> x = torch.tensor([[0.1, 2.0, -1.0]])
    >>> good = sot.permutation_cross_entropy(x, torch.tensor([[2, 3, 1]]), alpha=0.1)
    >>> bad = sot.permutation_cross_entropy(x, torch.tensor([[1, 2, 3]]), alpha=0.1)
    >>> bool(good < bad)
    True
    """
    arguments = {"target_ranks": target_ranks, "alpha": alpha, "reduction": reduction}
    return _run("permutation_cross_entropy", x, {**arguments, "descending": descending})


@documented(operations.topk_cross_entropy, _TORCH, drop=("Returns", "Raises", "Notes"))
class TopKCrossEntropyLoss(nn.Module):
    """Top-k cross-entropy as a module (Petersen et al. 2022, eqs. 2 and 4).

    Parameters
    ----------
    alpha : float or Tensor
        LapSum scale; pass an :class:`torch.nn.Parameter` to learn it.
    method : str
        ``"lapsum"`` (this library's kernels), or one of ``softorder.baselines.METHODS`` to
        compute the same loss with another relaxation for comparison.
    temperature : float, optional
        The temperature of a baseline method (ignored for ``"lapsum"``, which uses alpha).
    top_m : int, optional
        Relax only the ``top_m`` largest logits, the true class always among them (the DiffTopK
        paper's subset trick for many classes); see ``softorder.baselines.topk_cross_entropy``.

    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> loss_fn = sot.TopKCrossEntropyLoss([0.0, 0.0, 1.0], alpha=0.5)
    >>> logits = torch.randn(8, 10, requires_grad=True)
    >>> loss = loss_fn(logits, torch.randint(0, 10, (8,)))
    >>> loss.backward(); loss.shape
    torch.Size([])
    """

    def __init__(
        self,
        p_k,
        alpha: float | Tensor = 1.0,
        *,
        reduction: str = "mean",
        split_top1: bool = False,
        method: str = "lapsum",
        temperature: float | None = None,
        top_m: int | None = None,
    ):
        super().__init__()
        self.register_buffer("p_k", torch.as_tensor(p_k, dtype=torch.float64))
        self.alpha, self.reduction, self.split_top1 = alpha, reduction, split_top1
        self.method, self.temperature, self.top_m = method, temperature, top_m
        if method != "lapsum":
            from softorder import baselines

            if method not in baselines.METHODS:
                raise ValueError(
                    f"method must be 'lapsum' or one of {baselines.METHODS}; got {method!r}"
                )

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The loss of ``logits`` (``(..., C)``) against integer ``labels`` (``(...)``)."""
        settings = {"reduction": self.reduction, "split_top1": self.split_top1}
        if self.method == "lapsum" and self.top_m is None:
            return topk_cross_entropy(logits, labels, self.p_k, self.alpha, **settings)
        from softorder import baselines

        return baselines.topk_cross_entropy(
            logits,
            labels,
            self.p_k,
            method=self.method,
            temperature=self.alpha if self.method == "lapsum" else self.temperature,
            top_m=self.top_m,
            **settings,
        )


@documented(operations.permutation_cross_entropy, _TORCH, drop=("Returns", "Raises", "Notes"))
class PermutationCrossEntropyLoss(nn.Module):
    """Permutation cross-entropy as a module: see :func:`permutation_cross_entropy`.

    Parameters
    ----------
    alpha : float or Tensor
        LapSum scale; pass an :class:`torch.nn.Parameter` to learn it.

    Examples
    --------
    >>> import torch, softorder.bridges.torch as sot
    >>> loss_fn = sot.PermutationCrossEntropyLoss(alpha=0.1)
    >>> scores = torch.tensor([[0.1, 2.0, -1.0]], requires_grad=True)
    >>> loss = loss_fn(scores, torch.tensor([[2, 3, 1]]))
    >>> loss.backward(); bool(loss < 0.1)
    True
    """

    def __init__(
        self, alpha: float | Tensor = 1.0, *, reduction: str = "mean", descending: bool = False
    ):
        super().__init__()
        self.alpha, self.reduction, self.descending = alpha, reduction, descending

    def forward(self, x: Tensor, target_ranks: Tensor) -> Tensor:
        """The loss of scores ``x`` (``(..., n)``) against 1-based ``target_ranks``."""
        settings = {"reduction": self.reduction, "descending": self.descending}
        return permutation_cross_entropy(x, target_ranks, self.alpha, **settings)
