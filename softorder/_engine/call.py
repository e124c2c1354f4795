"""One call of an operation as the bridges pass it around: the call spec, the dtype policy,
``vmap`` axis insertion, loss reduction under ``vmap``, residual packing and the callbacks'
bodies, written once for every framework.

A bridge splits a call into its *arrays* (the framework's tensors: the input, ``alpha``, ``k``,
...) and its *statics* (plain Python values that choose what is computed: ``axis``, flags,
``reduction``; and, in PyTorch, numbers given as numbers). :class:`CallSpec` holds the
statics and the operation's name; it is hashable (JAX's ``nondiff_argnums``) and encodes to
a string (PyTorch's custom operators, which ``torch.compile`` treats as constants).
:class:`Call` adds what a bridge must declare before the data exists (the result's and
residuals' shapes and dtypes) and runs the rule on the arrays a callback receives.

Under ``vmap`` a bridge makes one call with the vmapped axes in front of every argument
(:meth:`CallSpec.vmapped`, :meth:`CallSpec.inserts`); a loss is then computed per row
(``reduction="none"``) and reduced by the bridge per vmapped element.
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from softorder._engine.autodiff import Rule, rule_named
from softorder._engine.checks import check_input_dtype
from softorder._engine.layout import BATCH_SHAPED, axes_after_leading, several_per_row

#: the arguments a callback may receive as 0-d arrays that pass to the rules as numbers
_SCALARS = frozenset(("alpha", "k", "q"))
_F64 = np.dtype(np.float64)


def compute_dtype(name: str) -> str:
    """The dtype a bridge computes a floating input of dtype ``name`` in: float32 and float64
    in themselves, narrower floats (float16, bfloat16, ...) in float32, the result cast back
    to the input's dtype. The kernels always run in float64; this is the dtype of the values
    they are given and give back.

    Examples
    --------
    >>> compute_dtype("bfloat16"), compute_dtype("float64")
    ('float32', 'float64')
    """
    return name if name in ("float32", "float64") else "float32"


def input_dtypes(dtype, name: str, default) -> tuple[np.dtype, np.dtype]:
    """The dtype a call on an input ``name`` of ``dtype`` computes in, and its result's dtype:
    a floating input in :func:`compute_dtype`, its result in its own dtype; an integer or bool
    input in ``default`` (the framework's default float), both; ``TypeError`` naming ``name``
    for any other (complex, ...).

    Examples
    --------
    >>> input_dtypes(np.float16, "x", np.float64), input_dtypes(np.int32, "x", np.float32)
    ((dtype('float32'), dtype('float16')), (dtype('float32'), dtype('float32')))
    """
    if check_input_dtype(dtype, name):
        return np.dtype(compute_dtype(np.dtype(dtype).name)), np.dtype(dtype)
    return np.dtype(default), np.dtype(default)


class CallSpec(NamedTuple):
    """What is static about one call: the operation, the names of its array arguments (in
    signature order) and its static arguments as ``((name, value), ...)``.

    Examples
    --------
    >>> spec = CallSpec("soft_rank", ("x",), (("axis", -1), ("descending", False)))
    >>> CallSpec.decode(spec.encode()) == spec
    True
    >>> spec.vmapped(1).statics  # one more leading axis: the axis counts from the end
    (('axis', -1), ('descending', False))
    >>> loss = CallSpec("permutation_cross_entropy", ("x",), (("target_ranks", [2, 1]),))
    >>> loss.vmapped(0, size=3).statics  # the ranks of each of 3 rows
    (('target_ranks', [[2, 1], [2, 1], [2, 1]]),)
    """

    op: str  # the operation's name in the NumPy API
    names: tuple  # the array arguments
    statics: tuple  # ((name, value), ...)

    @property
    def rule(self) -> Rule:
        return rule_named(self.op)

    def encode(self) -> str:
        """The spec as one string: JSON round-trips every static exactly (floats as their
        shortest repr, NaN and infinities as NaN/Infinity, -0.0 as -0.0).
        """
        return json.dumps([self.op, self.names, self.statics])

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def decode(text: str) -> CallSpec:
        """The spec :meth:`encode` gave ``text`` for."""
        op, names, statics = json.loads(text)
        return CallSpec(op, tuple(names), tuple((key, value) for key, value in statics))

    def arguments(self, arrays) -> dict:
        """The rule's arguments: the statics and ``arrays`` (one per name)."""
        arguments = dict(self.statics)
        arguments.update(zip(self.names, arrays, strict=True))
        return arguments

    def differentiable(self) -> list[str]:
        """The array arguments the operation has gradients for, in the rule's order."""
        return [name for name in self.rule.differentiable if name in self.names]

    @property
    def reduction(self) -> str:
        """The loss reduction (``"none"`` for an operation that is not a loss)."""
        return dict(self.statics).get("reduction", "none")

    def select(self, needs_grad, gradients: Callable[[], list]) -> list:
        """One gradient per array argument: ``gradients()`` lists those of
        :meth:`differentiable`'s arguments; ``None`` where ``needs_grad`` (one flag per array
        argument) says no gradient is needed, or none is defined. ``gradients`` is not called
        when no gradient is needed.
        """
        names, wanted = self.names, self.differentiable()
        out = [None] * len(names)
        if not any(needs_grad[names.index(n)] for n in wanted):
            return out
        for name, grad in zip(wanted, gradients(), strict=True):
            i = names.index(name)
            out[i] = grad if needs_grad[i] else None
        return out

    def vmapped(self, batch_ndim: int, size: int | None = None) -> CallSpec:
        """The spec of the call that takes the arrays with one more leading (vmapped) axis of
        ``size`` in front: the axis counted from the end (the input has ``batch_ndim + 1`` axes
        per vmapped element) and a loss computed per row (the bridge reduces per element).
        Static sequences follow the arrays: several targets of a row get one more leading
        axis, and labels or ranks (shaped like the batch, never broadcast) one copy per
        vmapped element, which needs ``size``.
        """
        statics = dict(self.statics)
        if "axis" in statics:
            statics["axis"] = statics["axis"] % (batch_ndim + 1) - (batch_ndim + 1)
        if "reduction" in statics:
            statics["reduction"] = "none"
        for name, value in statics.items():
            if isinstance(value, (list, tuple)) and several_per_row(name, value, batch_ndim):
                # several targets per row as a plain sequence (k, q): one more leading axis,
                # or the vmapped axis would read them as one target per row
                statics[name] = [value] if isinstance(value, list) else (value,)
            elif name in BATCH_SHAPED and isinstance(value, (list, tuple)) and size is not None:
                statics[name] = [value] * size
        return self._replace(statics=tuple(statics.items()))

    def inserts(self, ndims, batch_ndim: int) -> tuple:
        """Per array argument of ``ndims`` axes (per vmapped element): the unit axes to insert
        after the vmapped axes so that it still lines up with the input's ``batch_ndim``
        batch axes (:func:`~softorder._engine.layout.axes_after_leading`).
        """
        input_name = self.rule.input_name
        return tuple(
            0 if name == input_name else axes_after_leading(name, ndim, batch_ndim)
            for name, ndim in zip(self.names, ndims, strict=True)
        )

    def run(self, arrays) -> tuple[Any, Any]:
        """The forward pass over ``arrays``: the rule's context and the result."""
        rule = self.rule
        ctx = rule.prepare(**self.arguments(arrays))
        return ctx, rule.forward(ctx)

    def restore(self, arrays, residuals: dict | None) -> Any:
        """The rule's context for the gradients: rebuilt from the residuals, or, when there are
        none (the forward pass ran as another call, e.g. under ``vmap``), computed again.
        """
        if not residuals:
            return self.run(arrays)[0]
        return self.rule.restore(self.arguments(arrays), residuals)

    def gradients(self, ctx, cotangent) -> list:
        """The gradients of :meth:`differentiable`'s arguments, in that order."""
        rule = self.rule
        grads = dict(zip(rule.differentiable, rule.vjp(ctx, cotangent), strict=True))
        return [grads[name] for name in self.differentiable()]


def refuse_derivatives(op: str, rule: Rule, names, wanted) -> None:
    """Raise ``NotImplementedError`` naming softorder when ``wanted`` (one flag per array
    argument ``names``) asks for a derivative in an argument that operation ``op`` has none in
    (``p_k`` of the top-k loss): the bridges' transforms would otherwise leave it out, a
    silent zero or missing gradient.

    Examples
    --------
    >>> rule = rule_named("topk_cross_entropy")
    >>> refuse_derivatives("topk_cross_entropy", rule, ("logits", "labels"), (True, False))
    >>> refuse_derivatives("topk_cross_entropy", rule, ("logits", "p_k"), (True, True))
    Traceback (most recent call last):
    ...
    NotImplementedError: softorder: topk_cross_entropy has no derivative in p_k (it is ...
    """
    for name, flag in zip(names, wanted, strict=True):
        if flag and name not in rule.differentiable:
            *others, last = rule.differentiable
            listed = f"{', '.join(others)} and {last}" if others else last
            raise NotImplementedError(
                f"softorder: {op} has no derivative in {name} (it is differentiable in "
                f"{listed} only); treat {name} as a constant"
            )


@functools.lru_cache(maxsize=256)
def gradient_positions(rule: Rule, names: tuple) -> tuple:
    """``(i, j)`` for each array argument ``names[i]`` that is ``rule.differentiable[j]``: where
    each gradient of ``rule.vjp`` goes among a call's array arguments.
    """
    return tuple(
        (i, rule.differentiable.index(name))
        for i, name in enumerate(names)
        if name in rule.differentiable
    )


def reduction_scale(reduction: str, rows: int) -> float:
    """The cotangent of each row's loss per unit cotangent of the reduced loss."""
    return 1.0 / max(rows, 1) if reduction == "mean" else 1.0


class Call(NamedTuple):
    """A call as a bridge declares it before any data exists (JAX's callbacks need result
    shapes up front), and the callbacks' bodies on the arrays they receive, which may carry
    leading vmapped axes (``vmap_method="broadcast_all"``).
    """

    spec: CallSpec
    x_ndim: int  # axes of the input (without vmapped axes)
    inserts: tuple  # per array argument: unit axes to insert after the vmapped axes
    result: tuple  # (shape, dtype name) of the result (without vmapped axes)
    residuals: tuple  # ((name, shape, dtype name, stored dtype name), ...)
    differentiable: tuple  # positions of the array arguments that get gradients

    @classmethod
    def plan(cls, spec: CallSpec, arrays: dict, compute: str, words: bool = False) -> Call:
        """The call of ``spec`` on ``arrays`` (anything with ``shape``, by name), computing in
        ``compute``; with ``words`` 64-bit residuals are stored as pairs of uint32 words (a
        framework without 64-bit arrays: JAX without x64).
        """
        rule = spec.rule
        shapes = [tuple(arrays[name].shape) for name in spec.names]
        x_ndim = len(arrays[rule.input_name].shape)
        batch_ndim = x_ndim - 1
        described = {**dict(spec.statics), **arrays}
        result_shape, residuals = rule.describe(described)

        def stored(dtype) -> str:
            return "uint32" if words and np.dtype(dtype).itemsize == 8 else np.dtype(dtype).name

        return cls(
            spec=spec,
            x_ndim=x_ndim,
            inserts=spec.inserts([len(s) for s in shapes], batch_ndim),
            result=(tuple(result_shape), np.dtype(compute).name),
            residuals=tuple(
                (name, tuple(shape), np.dtype(dtype).name, stored(dtype))
                for name, (shape, dtype) in residuals.items()
            ),
            differentiable=tuple(spec.names.index(name) for name in rule.differentiable),
        )

    def stored_shapes(self) -> list[tuple]:
        """``(shape, stored dtype name)`` of each residual as :meth:`pack` stores it."""
        out = []
        for _, shape, dtype, stored in self.residuals:
            words = np.dtype(dtype).itemsize // np.dtype(stored).itemsize
            out.append((tuple(shape[:-1]) + (shape[-1] * words,), stored))
        return out

    def arguments(self, arrays, host: bool = True) -> dict:
        """The rule's arguments from the arrays a callback received: the unit axes of
        :attr:`inserts` after the leading (vmapped) axes. ``host=False`` (the device path):
        the input is a device array and passes as it is (it never gets unit axes); the others
        are host arrays.

        On the host each array is a NumPy array the kernels can take without compiling again
        (numba compiles every kernel anew for read-only arrays, and NumPy views of a
        framework's buffers are read-only): a read-only one is copied, unless it never reaches
        a kernel as it is (an input that is not float64 is converted first). A 0-d floating
        ``alpha``, ``k`` or ``q`` (one value for every row, as a callback receives a scalar)
        passes as a Python float: the same value, checked the same way, on the rules' fast
        path for scalars.
        """
        spec = self.spec
        arguments = dict(spec.statics)
        input_name = spec.rule.input_name
        lead = None
        for name, arr, insert in zip(spec.names, arrays, self.inserts, strict=True):
            if host:
                if type(arr) is not np.ndarray:
                    arr = np.asarray(arr)
                if arr.ndim == 0 and name in _SCALARS and arr.dtype.kind == "f":
                    arguments[name] = float(arr)  # exact: a float32 widens exactly
                    continue
                if not arr.flags.writeable and (name != input_name or arr.dtype == _F64):
                    arr = arr.copy()
            if insert:
                if lead is None:
                    lead = len(np.shape(arrays[0])) - self.x_ndim
                arr = arr.reshape(arr.shape[:lead] + (1,) * insert + arr.shape[lead:])
            arguments[name] = arr
        return arguments

    def pack(self, residuals: dict, backend=None) -> list:
        """Residuals as the framework can hold them (see :meth:`plan`'s ``words``: a bit-exact
        view along the last axis). With ``backend`` (a device backend) they stay on the device.
        """
        out = []
        for name, _, dtype, stored in self.residuals:
            if backend is None:
                arr = np.ascontiguousarray(residuals[name], dtype=dtype)
            else:
                arr = backend.cast(residuals[name], np.dtype(dtype))  # no copy when it is one
            out.append(arr if stored == dtype else arr.view(stored))
        return out

    def unpack(self, stored: tuple, host: bool = True) -> dict:
        """The residuals from what :meth:`pack` stored (device arrays stay where they are);
        on the host as arrays the kernels can take without compiling again (read-only ones,
        such as NumPy views of a framework's buffers, are copied).
        """
        out = {}
        for (name, _, dtype, stored_dtype), arr in zip(self.residuals, stored, strict=True):
            if host:
                arr = np.asarray(arr)
                if not arr.flags.writeable or not arr.flags.c_contiguous:
                    arr = np.array(arr, order="C")  # (a copy: writable)
                out[name] = arr if stored_dtype == dtype else arr.view(dtype)
            else:
                out[name] = arr if stored_dtype == dtype else arr.view(dtype)
        return out

    def forward(self, arrays, keep: bool, backend=None) -> list:
        """The result (in the compute dtype on the host), and the packed residuals when
        ``keep``. With ``backend`` the input is a device array and so are the results.
        """
        rule = self.spec.rule
        ctx = rule.prepare(**self.arguments(arrays, host=backend is None))
        out = rule.forward(ctx)
        out = out if backend is not None else np.asarray(out, dtype=self.result[1])
        if not keep:
            return [out]
        return [out, *self.pack(rule.residuals(ctx), backend)]

    def forward_into(self, arrays, outs: list) -> None:
        """:meth:`forward` on the host, written into ``outs`` (writable NumPy arrays of the
        declared result and, when there are more, the stored residuals): each value cast
        once, as it is written (the same values, to the bit, as :meth:`forward`'s).

        When it keeps residuals, a small call also keeps its context for the backward pass
        that follows (:func:`_recall`).
        """
        arrays = [np.asarray(arr) for arr in arrays]
        rule = self.spec.rule
        key = _key(self, arrays) if len(outs) > 1 else None
        # a kept context outlives the callback, and the arrays it received are views of the
        # framework's buffers (writable ones, in some JAX versions), which the framework may
        # free or reuse once the callback returns: a context to keep is built from copies
        own = arrays if key is None else [a if a.flags.owndata else a.copy() for a in arrays]
        ctx = rule.prepare(**self.arguments(own))
        outs[0][...] = rule.forward(ctx)
        if len(outs) == 1:
            return
        residuals = rule.residuals(ctx)
        for (name, _, dtype, stored), target in zip(self.residuals, outs[1:], strict=True):
            (target if stored == dtype else target.view(dtype))[...] = residuals[name]
        if key is not None:
            _keep(key, self, ctx)

    def backward_flat(self, flat, launch=None, wanted: tuple | None = None) -> list:
        """:meth:`backward` of a callback that receives the arrays, then the stored
        residuals, then the cotangent; with ``launch`` (a device backend's
        :class:`~softorder._engine.backends.numba_cuda.Launch`) they are device buffers.
        """
        count = len(self.spec.names)
        if launch is None:
            return self.backward(flat[:count], flat[count:-1], flat[-1], wanted=wanted)
        arrays = launch.arguments(flat[:count])
        stored = [launch.wrap(b) for b in flat[count:-1]]
        return self.backward(arrays, stored, launch.wrap(flat[-1]), host=False, wanted=wanted)

    def backward(
        self, arrays, stored, cotangent, host: bool = True, wanted: tuple | None = None
    ) -> list:
        """The gradients of the :attr:`differentiable` arguments (of those at the positions
        ``wanted`` when given): on the host in their arguments' dtypes and shapes; on the
        device (``host=False``) as the rule gives them.
        """
        grads = self._wanted(self._gradients(arrays, stored, cotangent, host), wanted)
        if not host:
            return grads
        return [
            np.asarray(grad, dtype=np.asarray(arrays[i]).dtype).reshape(np.shape(arrays[i]))
            for i, grad in zip(self._positions(wanted), grads, strict=True)
        ]

    def backward_into(self, flat, outs: list, wanted: tuple | None = None) -> None:
        """:meth:`backward_flat` on the host, written into ``outs`` (writable NumPy arrays of
        the shapes and dtypes of the :attr:`differentiable` arguments, or of those at the
        positions ``wanted``): each gradient cast once, as it is written (the same values, to
        the bit, as :meth:`backward`'s).

        The context comes from :func:`_recall` when the forward pass on these arguments kept
        it, and is restored from the residuals otherwise.
        """
        count = len(self.spec.names)
        arrays = [np.asarray(arr) for arr in flat[:count]]
        ctx = _recall(self, arrays)
        if ctx is None:
            grads = self._gradients(arrays, flat[count:-1], flat[-1], True)
        else:
            grads = self.spec.rule.vjp(ctx, _host_cotangent(flat[-1]))
        for target, grad in zip(outs, self._wanted(grads, wanted), strict=True):
            target[...] = grad if np.shape(grad) == target.shape else np.reshape(grad, target.shape)

    def _positions(self, wanted: tuple | None) -> tuple:
        """The positions of the arguments whose gradients are returned."""
        return self.differentiable if wanted is None else wanted

    def _wanted(self, grads, wanted: tuple | None) -> list:
        """The rule's gradients (one per :attr:`differentiable` argument) of the arguments at
        the positions ``wanted`` (all when ``None``).
        """
        if wanted is None or wanted == self.differentiable:
            return list(grads)
        return [g for i, g in zip(self.differentiable, grads, strict=True) if i in wanted]

    def _gradients(self, arrays, stored, cotangent, host: bool) -> tuple:
        """The rule's gradients, in the order of ``rule.differentiable`` (which is the order
        of :attr:`differentiable`), in the shapes the rule gives them.
        """
        rule = self.spec.rule
        ctx = rule.restore(self.arguments(arrays, host), self.unpack(stored, host))
        return rule.vjp(ctx, _host_cotangent(cotangent) if host else cotangent)


def _host_cotangent(cotangent) -> np.ndarray:
    """A cotangent a callback received, as an array the kernels can take without compiling
    again (a read-only one copied).
    """
    cotangent = np.asarray(cotangent)
    return cotangent if cotangent.flags.writeable else cotangent.copy()


# The contexts of recent small forward passes on the host, for the backward passes that follow
# them: a backward pass on the same arguments (the same call, the same bytes in every array)
# takes the context its forward pass computed instead of restoring one from the residuals.
# Exact by construction: a context is a function of the call and of its arguments' bytes
# (prepare and forward are deterministic), and the rules' vjp never writes into a context (a
# pullback of the NumPy API may be called several times). A context holds only arrays of its
# own: Call.forward_into builds a context it keeps from copies of the arguments it received.

#: how many contexts are kept, at most; and the largest arguments (bytes in all) whose
#: context is kept, where the Python around the kernels costs as much as they do
_RECENT_COUNT = 8
_RECENT_BYTES = 1 << 16
_RECENT: collections.OrderedDict = collections.OrderedDict()


def _key(call: Call, arrays: list) -> tuple | None:
    """The key of a call on ``arrays`` (host arrays) among the kept contexts, or ``None``
    when the arguments are too large to keep a context for.
    """
    parts: list = [id(call)]
    size = 0
    for arr in arrays:
        size += arr.nbytes
        if size > _RECENT_BYTES:
            return None
        parts += (arr.dtype, arr.shape, arr.tobytes())
    return tuple(parts)


def _keep(key: tuple, call: Call, ctx) -> None:
    """Keep ``ctx``, the context of ``call`` on the arguments of ``key`` (:func:`_key`)."""
    _RECENT[key] = (call, ctx)
    while len(_RECENT) > _RECENT_COUNT:
        try:
            _RECENT.popitem(last=False)
        except KeyError:  # (emptied by another thread)
            break


def _recall(call: Call, arrays: list):
    """The context a forward pass of ``call`` on these same arguments kept, or ``None``."""
    key = _key(call, arrays)
    entry = None if key is None else _RECENT.get(key)
    if entry is None or not (entry[0] is call or entry[0] == call):
        return None  # (an id reused by another call: restored instead)
    return entry[1]
