"""Every private PyTorch API the PyTorch bridge uses, in one place.

:mod:`softorder.bridges.torch` uses only public PyTorch APIs besides the entry points here.
Each says what happens when a PyTorch release lacks its private API: a slower public path
where there is one, an error naming softorder where there is none.
``tests/test_torch_compat.py`` checks every entry point against the installed torch; the
versions checked (hence ``torch>=2.6``) and how to check another are in ``docs/pytorch.rst``
and ``CONTRIBUTING.md``. Importing this module imports nothing beyond ``torch`` itself (not
``torch._dynamo``, which costs seconds).
"""

from __future__ import annotations

import importlib
import types

import torch

__all__ = [
    "TORCH_VERSION",
    "FastApplyFunction",
    "custom_op",
    "direct_backward",
    "dual_level_open",
    "is_fake",
    "is_wrapped",
    "mark_constant",
    "transforms_active",
    "forward_mode_active",
    "forward_mode_possible",
    "transforms_traced",
    "unwrap_dead_wrappers",
]

TORCH_VERSION = torch.__version__
_forward_ad = torch.autograd.forward_ad  # (its _current_level: the open dual level, or -1)


def _private(module: str, name: str):
    """``module.name`` from torch, or ``None`` when this torch lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _missing(what: str) -> str:
    return (
        f"softorder's PyTorch bridge needs {what}, which torch {TORCH_VERSION} does not "
        "have (checked with torch 2.13.0); please report this with your torch version"
    )


#: ``is_wrapped(t)``: whether tensor ``t`` is wrapped by a torch.func transform (it has no
#: storage: the bridge reaches its values through a custom operator).
#: ``torch._C._functorch.is_functorch_wrapped_tensor``, with no public equivalent: without it
#: the bridge refuses to import.
is_wrapped = _private("torch._C._functorch", "is_functorch_wrapped_tensor")
if is_wrapped is None:  # pragma: no cover - depends on the torch release
    raise ImportError(_missing("torch._C._functorch.is_functorch_wrapped_tensor"))


_transforms_active = _private("torch._C", "_are_functorch_transforms_active")


def _always() -> bool:
    return True


#: ``transforms_active()``: whether a torch.func transform is running
#: (``torch._C._are_functorch_transforms_active``). Without it, ``True``: every call then
#: takes :meth:`torch.autograd.Function.apply` (correct, slower).
transforms_active = _always if _transforms_active is None else _transforms_active


_interpreters = _private("torch._functorch.pyfunctorch", "retrieve_all_functorch_interpreters")


def forward_mode_active() -> bool:
    """Whether forward-mode AD is running: a ``torch.func.jvp`` (or ``jacfwd``) transform on
    functorch's interpreter stack
    (``torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters``; without it, not
    checked), or a ``torch.autograd.forward_ad.dual_level``.
    """
    if getattr(_forward_ad, "_current_level", -1) >= 0:
        return True
    if _interpreters is None:  # pragma: no cover - depends on the torch release
        return False
    jvp = torch._C._functorch.TransformType.Jvp
    return any(i.key() == jvp for i in _interpreters())


def transforms_traced() -> bool:
    """Whether a torch.func transform is on functorch's interpreter stack (under
    torch.compile: one being traced; ``retrieve_all_functorch_interpreters``, without it not
    checked).
    """
    return _interpreters is not None and bool(_interpreters())


def forward_mode_possible() -> bool:
    """Whether a forward-mode derivative may be asked of a call made now, cheaply: a
    :func:`dual_level_open` or :func:`transforms_active`.
    """
    return getattr(_forward_ad, "_current_level", 0) >= 0 or transforms_active()


def dual_level_open() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open
    (``torch.autograd.forward_ad._current_level``; without it, ``True``).
    """
    return getattr(_forward_ad, "_current_level", 0) >= 0


_unwrap_dead_wrappers = _private("torch._functorch.utils", "unwrap_dead_wrappers")


def unwrap_dead_wrappers(args: tuple) -> tuple | None:
    """``args`` without the wrappers of finished torch.func transforms, as
    :meth:`torch.autograd.Function.apply` unwraps them
    (``torch._functorch.utils.unwrap_dead_wrappers``); ``None`` when this torch lacks it.
    """
    return None if _unwrap_dead_wrappers is None else _unwrap_dead_wrappers(args)


_FakeTensor = _private("torch._subclasses", "FakeTensor")


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake (or meta) tensor, without data:
    ``isinstance(t, torch._subclasses.FakeTensor)``, or, without that class, a class named
    ``FakeTensor`` among ``t``'s classes.
    """
    if t.device.type == "meta":
        return True
    if _FakeTensor is not None:
        return isinstance(t, _FakeTensor)
    return any(c.__name__ == "FakeTensor" for c in type(t).__mro__)  # pragma: no cover


#: The attribute :func:`torch.compiler.assume_constant_result` sets (torch 2.4-2.13).
CONSTANT_MARKER = "_dynamo_marked_constant"


def mark_constant(fn):
    """:func:`torch.compiler.assume_constant_result` (torch.compile runs ``fn`` instead of
    tracing it) without its import of ``torch._dynamo``: that decorator only sets
    :data:`CONSTANT_MARKER` (``tests/test_torch_compat.py`` checks that it still does).
    """
    setattr(fn, CONSTANT_MARKER, True)
    return fn


class FastApplyFunction(torch.autograd.Function):
    """A :class:`torch.autograd.Function` whose ``apply`` skips the binding of the arguments
    to ``forward``'s signature with :mod:`inspect` (subclasses take positional arguments, no
    defaults): outside torch.func transforms it calls the C implementation
    (``torch._C._FunctionBase.apply``) that ``Function.apply`` ends up calling.

    ``c_apply(*args)`` is that C implementation itself, for a caller that has made
    :meth:`apply`'s checks already: no transform is active and no argument is a wrapped tensor.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # (a docs build mocks torch: Function is no type there)
        base = torch.autograd.Function
        cls.c_apply = super(base, cls).apply if isinstance(base, type) else None

    @classmethod
    def apply(cls, *args):
        if transforms_active():
            return super().apply(*args)
        for t in args:
            if isinstance(t, torch.Tensor) and is_wrapped(t):  # a transform's leftover output
                unwrapped = unwrap_dead_wrappers(args)
                if unwrapped is None:  # pragma: no cover - depends on the torch release
                    return super().apply(*args)
                args = unwrapped
                break
        return cls.c_apply(*args)


def direct_backward(cls: type) -> type:
    """Class decorator for a :class:`torch.autograd.Function` with a ``backward`` (and no
    ``vjp``): its autograd node (``cls._backward_cls``, a
    ``torch.autograd.function.BackwardCFunction``) calls ``backward`` directly, not through
    ``BackwardCFunction.apply``, which looks up ``backward`` and ``vjp`` on every call and ends
    up calling it. Without that node class, or for a Function that ``apply`` treats otherwise
    (a ``vjp``, ``boxed_grads_call``), ``cls`` is left as it is.
    """
    node = cls.__dict__.get("_backward_cls")
    function = torch.autograd.Function
    if (
        isinstance(node, type)
        and isinstance(getattr(node, "apply", None), types.FunctionType)
        and node.apply.__qualname__ == "BackwardCFunction.apply"
        and getattr(cls, "vjp", function.vjp) is function.vjp
        and not getattr(cls, "boxed_grads_call", False)
        and cls.backward is not function.backward
    ):
        node.apply = cls.backward  # (a plain function: bound to the node, which is the ctx)
    return cls


# --- public APIs used in one form that every declared torch accepts ---------------------------


def custom_op(name: str, schema: str):
    """:func:`torch.library.custom_op` with an explicit schema (not one inferred from string
    annotations, which some releases cannot read) and no mutated arguments.
    """
    return torch.library.custom_op(name, mutates_args=(), schema=schema)
