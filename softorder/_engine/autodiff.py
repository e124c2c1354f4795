"""Gradients without a framework: every operation is a :class:`Rule` (prepare, forward, vjp,
jvp), and :func:`vjp` / :func:`jvp` run any public operation through its rule.

The bridges (PyTorch, JAX) use the same rules, so each operation's plumbing exists once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from softorder._engine.layout import Layout


class Rule:
    """How one operation maps onto the core kernels.

    ``prepare`` validates the arguments (named as in the public signature) and returns a
    context; ``forward`` computes the result and keeps in the context what the gradients need
    (O(n) per row); ``vjp`` returns one gradient per name in ``differentiable``; ``jvp`` takes a
    dict of tangents keyed by those names (missing ones are zero).

    For the bridges, a rule also describes its result and residuals from the arguments'
    shapes alone (:meth:`describe`), hands its residuals out as arrays (:meth:`residuals`) and
    rebuilds a context from them without sorting again (:meth:`restore`). Residuals have shape
    ``batch_shape + (width,)``, so extra leading batch axes (``vmap``) pass through them.
    """

    differentiable: tuple[str, ...] = ()
    input_name = "x"  # the argument that is sorted
    #: the residuals :meth:`residuals` hands out, in order: the sort order, then what the
    #: forward pass saves (each target's anchor and offset, for most rules)
    residual_names: tuple[str, ...] = ("order", "anchor", "offset")

    def prepare(self, order=None, **arguments: Any) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def forward(self, ctx: Any) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def vjp(self, ctx: Any, cotangent: Any) -> tuple:  # pragma: no cover - interface
        raise NotImplementedError

    def jvp(self, ctx: Any, tangents: dict) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def result(self, layout: Layout, arguments: dict) -> tuple[str, tuple]:  # pragma: no cover
        """The result's kind (see :data:`softorder._engine.layout.KINDS`, or ``"scalar"``) and its
        core shape.
        """
        raise NotImplementedError

    def target_count(self, layout: Layout, arguments: dict) -> int:  # pragma: no cover
        """How many inversion targets per row the forward pass keeps."""
        raise NotImplementedError

    def saved_widths(self, layout: Layout, arguments: dict) -> dict:
        """Name -> (width, dtype) of each array the forward pass saves, per row."""
        m = self.target_count(layout, arguments)
        return {"anchor": (m, np.int64), "offset": (m, np.float64)}

    def layout(self, arguments: dict) -> Layout:
        shape = np.shape(arguments[self.input_name])
        return Layout.of(shape, arguments.get("axis", -1), self.input_name)

    def describe(self, arguments: dict) -> tuple[tuple, dict]:
        """The result's shape and ``{name: (shape, dtype)}`` of the residuals, from the
        arguments' shapes and static values only (no data is read).
        """
        layout = self.layout(arguments)
        kind, core_shape = self.result(layout, arguments)
        shape = () if kind == "scalar" else layout.user_shape(kind, core_shape)
        widths = {"order": (layout.n, np.int64), **self.saved_widths(layout, arguments)}
        assert tuple(widths) == self.residual_names
        batch = layout.batch_shape
        return shape, {name: (batch + (w,), np.dtype(t)) for name, (w, t) in widths.items()}

    def residuals(self, ctx: Any) -> dict:
        """What the gradients of ``ctx`` need, as arrays shaped as :meth:`describe` says."""
        rows = ctx.rows
        arrays = {"order": rows.order, **ctx.saved}
        assert tuple(arrays) == self.residual_names
        return {name: a.reshape(rows.batch_shape + a.shape[1:]) for name, a in arrays.items()}

    def restore(self, arguments: dict, residuals: dict) -> Any:
        """A context ready for :meth:`vjp` / :meth:`jvp`, rebuilt from the arguments of a
        forward call and its :meth:`residuals`.
        """
        ctx = self.prepare(**arguments, order=residuals["order"])
        rows = ctx.rows.rows
        for name, arr in residuals.items():
            if name != "order":
                width = tuple(arr.shape)[-1]  # (numba's simulated device shapes refuse -1)
                ctx.saved[name] = ctx.rows.backend.contiguous(arr).reshape(rows, width)
        return ctx


#: the rule of each public operation, by the operation's name (filled by :func:`operation`)
RULES: dict[str, Rule] = {}


def rule_named(name: str) -> Rule:
    """The rule of the public operation ``name`` (e.g. ``"soft_rank"``)."""
    return RULES[name]


def operation(rule: Rule) -> Callable:
    """Make a public function run ``rule``; the decorated function supplies the signature and
    the documentation, its body is not executed.
    """

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        RULES[fn.__name__] = rule
        binder = _binder(signature)
        prepare, forward = rule.prepare, rule.forward
        start = _starter(signature, prepare)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                ctx = start(*args, **kwargs)
            except TypeError as error:
                if error.__traceback__.tb_next is not None:
                    raise  # raised inside the rule (an argument's own check), not by the binding
                ctx = prepare(**_bind_slowly(signature, args, kwargs))
            return forward(ctx)

        run.rule = rule
        run.signature = signature
        run.binder = binder  # (the arguments by name; TypeError where a call would raise)
        run.start = start  # (the rule's context of a call, see _starter)
        # what vjp reads of the operation, in one lookup
        run.vjp_entry = (start, forward, rule.vjp, rule, signature)
        return run

    return decorate


def bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call by name, defaults filled in, as ``signature.bind`` gives them.

    A function compiled from ``signature`` (:func:`_binder`) binds them: Python's own
    argument binding costs a fraction of ``Signature.bind``, a tenth of a small call. A call
    it refuses (a missing, unknown or repeated argument) goes through ``Signature.bind`` for
    its error message.
    """
    entry = _BINDERS.get(id(signature))  # (hashing a Signature is slow)
    if entry is None or entry[0] is not signature:
        entry = _BINDERS[id(signature)] = (signature, _binder(signature))
    try:
        return entry[1](*args, **kwargs)
    except TypeError:
        return _bind_slowly(signature, args, kwargs)


def _bind_slowly(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    full = signature.bind(*args, **kwargs)
    full.apply_defaults()
    return dict(full.arguments)


def _binder(signature: inspect.Signature) -> Callable[..., dict]:
    """A function with the parameters of ``signature`` (names, kinds, defaults) that returns
    its arguments as a dict in signature order; it raises ``TypeError`` where a call of
    ``signature`` would.
    """
    params = signature.parameters.values()
    body = ", ".join(f"{p.name!r}: {p.name}" for p in params)
    return _generated(signature, f"{{{body}}}", {}) or (
        lambda *args, **kwargs: _bind_slowly(signature, args, kwargs)
    )


def _starter(signature: inspect.Signature, prepare: Callable) -> Callable:
    """A function with the parameters of ``signature`` that returns ``prepare`` of its
    arguments by name: :func:`_binder`'s binding, without the dict it builds and ``prepare``
    unpacks again (a tenth of a small call's Python). A call that does not bind raises
    ``TypeError`` before the function's frame exists, so a caller tells it apart from a
    ``TypeError`` of ``prepare`` by its traceback (no entry after the caller's own).
    """
    names = list(signature.parameters)
    try:
        own = [
            p.name
            for p in inspect.signature(prepare).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD
        ]
    except (TypeError, ValueError):
        own = []
    if own[: len(names)] == names:  # the same order: passed by position (cheaper)
        body = ", ".join(names)
    else:
        body = ", ".join(f"{name}={name}" for name in names)
    return _generated(signature, f"_prepare({body})", {"_prepare": prepare}) or (
        lambda *args, **kwargs: prepare(**_bind_slowly(signature, args, kwargs))
    )


def _generated(signature: inspect.Signature, returns: str, names: dict) -> Callable | None:
    """A function with the parameters of ``signature`` (names, kinds, defaults) that returns
    the expression ``returns`` of them and of ``names``; ``None`` for a signature with
    positional-only or variadic parameters.
    """
    params = list(signature.parameters.values())
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return None
    text, keyword_only = [], False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            text.append("*")
            keyword_only = True
        text.append(p.name if p.default is p.empty else f"{p.name}=_default{i}")
    namespace = {f"_default{i}": p.default for i, p in enumerate(params)} | names
    exec(f"def generated({', '.join(text)}):\n    return {returns}\n", namespace)
    return namespace["generated"]  # (the names and kinds come from a signature: identifiers)


_BINDERS: dict = {}


def rule_of(fn: Callable) -> Rule:
    rule = getattr(fn, "rule", None)
    if not isinstance(rule, Rule):
        raise TypeError(f"{getattr(fn, '__name__', fn)!r} is not a softorder operation")
    return rule


def vjp(fn: Callable, *args, **kwargs) -> tuple[np.ndarray, Callable]:
    """Evaluate a softorder operation and return its result with a pullback.

    Parameters
    ----------
    fn : callable
        A softorder operation, e.g. :func:`softorder.soft_rank`.
    *args, **kwargs
        Its arguments, exactly as for a direct call.

    Returns
    -------
    out : ndarray
        ``fn(*args, **kwargs)``.
    pullback : callable
        ``pullback(cotangent)`` takes an array shaped like ``out`` and returns a tuple with the
        gradient for each differentiable argument, in signature order: ``(x_bar, alpha_bar)``
        for rank/sort/permutation, ``(x_bar, k_bar, alpha_bar)`` for top-k,
        ``(x_bar, q_bar, alpha_bar)`` for quantile, ``(logits_bar, alpha_bar)`` and
        ``(x_bar, alpha_bar)`` for the losses. Each gradient has its argument's shape; it may
        be called several times.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> x = np.array([0.3, -1.2, 2.0])
    >>> ranks, pullback = softorder.vjp(softorder.soft_rank, x, alpha=0.5)
    >>> x_bar, alpha_bar = pullback(np.array([1.0, 0.0, 0.0]))
    >>> x_bar.shape, float(alpha_bar) < 0.0
    ((3,), True)
    """
    entry = getattr(fn, "vjp_entry", None)
    if type(entry) is not tuple or len(entry) != 5 or not isinstance(entry[3], Rule):
        rule = rule_of(fn)
        ctx = rule.prepare(**bind(fn.signature, args, kwargs))
        forward, rule_vjp = rule.forward, rule.vjp
    else:
        start, forward, rule_vjp, rule, signature = entry
        try:
            ctx = start(*args, **kwargs)
        except TypeError as error:
            if error.__traceback__.tb_next is not None:
                raise  # raised inside the rule (an argument's own check), not by the binding
            ctx = rule.prepare(**_bind_slowly(signature, args, kwargs))
    out = forward(ctx)

    def pullback(cotangent):
        return rule_vjp(ctx, cotangent)

    return out, pullback


def jvp(fn: Callable, primals: tuple, tangents: tuple, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """Evaluate a softorder operation and its forward-mode derivative.

    Parameters
    ----------
    fn : callable
        A softorder operation.
    primals : tuple or list
        Positional arguments of ``fn`` (e.g. ``(x, k, alpha)`` for :func:`soft_topk`).
    tangents : tuple or list
        One tangent per primal, same shapes; ``None`` (or a missing trailing entry) means zero.
        Tangents of arguments that are not differentiable (axis, labels, ...) must be ``None``.
    **kwargs
        Keyword arguments of ``fn`` (not differentiated).

    Returns
    -------
    out, out_dot : ndarray
        ``fn(*primals, **kwargs)`` and its directional derivative along the tangents.

    Examples
    --------
    >>> import numpy as np, softorder
    >>> x = np.array([0.3, -1.2, 2.0])
    >>> p, p_dot = softorder.jvp(softorder.soft_topk, (x, 1, 0.5), (None, None, 1.0))
    >>> round(float(p_dot.sum()), 12)  # memberships always sum to k
    0.0
    """
    rule = rule_of(fn)
    # An array would be unpacked row by row into x, k, alpha... and could run (as JAX's jvp,
    # only tuples and lists are taken).
    for name, value in (("primals", primals), ("tangents", tangents)):
        if not isinstance(value, (tuple, list)):
            raise TypeError(
                f"{name} must be a tuple (or list) of {getattr(fn, '__name__', 'fn')}'s "
                f"positional arguments, e.g. (x, alpha); got {type(value).__name__}"
            )
    if len(tangents) > len(primals):
        raise ValueError(f"got {len(tangents)} tangents for {len(primals)} primals")
    arguments = bind(fn.signature, tuple(primals), kwargs)
    names = list(fn.signature.parameters)[: len(primals)]
    tangent_of = {}
    for name, tangent in zip(names, tangents, strict=False):
        if tangent is None:
            continue
        if name not in rule.differentiable:
            raise ValueError(f"{fn.__name__} is not differentiable in {name!r}; pass None")
        tangent_of[name] = tangent
    ctx = rule.prepare(**arguments)
    out = rule.forward(ctx)
    return out, rule.jvp(ctx, tangent_of)
