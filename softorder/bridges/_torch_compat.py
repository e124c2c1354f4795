"""Every private PyTorch API the PyTorch bridge uses, in one place.

:mod:`softorder.bridges.torch` uses only public PyTorch APIs (``torch.library.custom_op``,
``torch.autograd.Function``, ``torch.func``, ``torch.compiler``) besides the entry points
here. Each says what it is for, and what happens when a PyTorch release no longer has the
private API: a slower public path where there is one, a clear error naming softorder where
there is none. ``tests/test_torch_compat.py`` checks every entry point against the installed
torch.

Checked with torch 2.6.0, 2.13.0 (the version CI pins) and 2.15.0: the torch test files pass
on each (``pyproject.toml`` ignores two warnings that torch itself raises on 2.6 and 2.15).
Hence ``torch>=2.6`` in ``pyproject.toml``. On older releases the torch tests fail with
errors, not wrong values: on 2.5.1 second derivatives and ``vmap`` of
``jacrev``/``jacfwd`` hit an internal assert of functorch (``savedLocalDispatchKeySet_``); on
2.4.0 custom operators cannot be differentiated under
torch.func at all (their autograd has no ``setup_context``), and ``register_vmap`` is missing.

To check another torch (a second CI job; about 3 GB of wheels, the torch tests take a minute)::

    python -m venv /tmp/torch-2.6 && /tmp/torch-2.6/bin/pip install torch==2.6.0 numpy numba \
        scipy pytest hypothesis
    PYTHONPATH=. /tmp/torch-2.6/bin/python -m pytest -p no:cacheprovider tests/test_torch_*.py \
        docs/pytorch.rst softorder/bridges/torch.py

Importing this module imports nothing beyond ``torch`` itself (in particular not
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


#: ``is_wrapped(t)``: whether tensor ``t`` is wrapped by a torch.func transform (``grad``,
#: ``vjp``, ``jvp``, ``vmap``, ``jacrev``...). Such tensors have no storage, so the bridge
#: reaches their values only through a custom operator (the dispatcher unwraps every level on
#: the way in). ``torch._C._functorch.is_functorch_wrapped_tensor`` (a builtin, used as it is:
#: it runs on every backward); there is no public equivalent, so without it the bridge refuses
#: to import.
is_wrapped = _private("torch._C._functorch", "is_functorch_wrapped_tensor")
if is_wrapped is None:  # pragma: no cover - depends on the torch release
    raise ImportError(_missing("torch._C._functorch.is_functorch_wrapped_tensor"))


_transforms_active = _private("torch._C", "_are_functorch_transforms_active")


def _always() -> bool:
    return True


#: ``transforms_active()``: whether a torch.func transform is running
#: (``torch._C._are_functorch_transforms_active``, a builtin, used as it is: it runs on every
#: eager call). :class:`FastApplyFunction` takes its shortcut only outside transforms. Without
#: the private API it always answers ``True``: every call then takes
#: :meth:`torch.autograd.Function.apply` (correct, about 20 us slower per call).
transforms_active = _always if _transforms_active is None else _transforms_active


_interpreters = _private("torch._functorch.pyfunctorch", "retrieve_all_functorch_interpreters")


def forward_mode_active() -> bool:
    """Whether forward-mode AD is running: a ``torch.func.jvp`` (or ``jacfwd``) transform
    anywhere on functorch's interpreter stack
    (``torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters``), or a
    ``torch.autograd.forward_ad.dual_level``. The compiled path asks this at trace time,
    where the custom operators would drop tangents. Without the private API, only the
    ``dual_level`` half is checked.
    """
    if getattr(_forward_ad, "_current_level", -1) >= 0:
        return True
    if _interpreters is None:  # pragma: no cover - depends on the torch release
        return False
    jvp = torch._C._functorch.TransformType.Jvp
    return any(i.key() == jvp for i in _interpreters())


def forward_mode_possible() -> bool:
    """Whether a forward-mode derivative may be asked of a call made now, cheaply (every eager
    call asks): a ``torch.autograd.forward_ad.dual_level`` is open
    (``torch.autograd.forward_ad._current_level``) or a torch.func transform is running
    (:func:`transforms_active`), ``torch.func.jvp`` among them. Without the private level it
    answers ``True``.
    """
    return getattr(_forward_ad, "_current_level", 0) >= 0 or transforms_active()


def dual_level_open() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open
    (``torch.autograd.forward_ad._current_level``): :func:`forward_mode_possible` without
    the transforms, for a caller that asked :func:`transforms_active` already. Without the
    private level it answers ``True``.
    """
    return getattr(_forward_ad, "_current_level", 0) >= 0


_unwrap_dead_wrappers = _private("torch._functorch.utils", "unwrap_dead_wrappers")


def unwrap_dead_wrappers(args: tuple) -> tuple | None:
    """``args`` with the wrappers of finished torch.func transforms removed (what
    :meth:`torch.autograd.Function.apply` does to the outputs of a transform reused outside
    it), from ``torch._functorch.utils.unwrap_dead_wrappers``; ``None`` when this torch lacks
    it (the caller then uses ``Function.apply``, which unwraps them itself).
    """
    return None if _unwrap_dead_wrappers is None else _unwrap_dead_wrappers(args)


_FakeTensor = _private("torch._subclasses", "FakeTensor")


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (shapes and dtypes without data: torch.compile's
    tracing, a custom operator's fake implementation), which the bridge passes to the rules
    for shapes only: ``isinstance(t, torch._subclasses.FakeTensor)``, or, without that class,
    a class named ``FakeTensor`` among ``t``'s classes. Meta tensors count as fake.
    """
    if t.device.type == "meta":
        return True
    if _FakeTensor is not None:
        return isinstance(t, _FakeTensor)
    return any(c.__name__ == "FakeTensor" for c in type(t).__mro__)  # pragma: no cover


#: The attribute :func:`torch.compiler.assume_constant_result` sets (torch 2.4-2.13).
CONSTANT_MARKER = "_dynamo_marked_constant"


def mark_constant(fn):
    """:func:`torch.compiler.assume_constant_result` without its import of ``torch._dynamo``
    (1.5-3 s, which ``import torch``, importing the bridge and every eager call avoid): that
    decorator only sets :data:`CONSTANT_MARKER`, which dynamo reads when it traces ``fn``, so
    that torch.compile runs ``fn`` instead of tracing it. ``tests/test_torch_compat.py`` checks
    that PyTorch's decorator still sets the same marker (and the ``fullgraph=True`` tests
    would break if dynamo stopped reading it).
    """
    setattr(fn, CONSTANT_MARKER, True)
    return fn


class FastApplyFunction(torch.autograd.Function):
    """A :class:`torch.autograd.Function` whose ``apply`` skips the per-call argument binding.

    :meth:`torch.autograd.Function.apply` binds the arguments to ``forward``'s signature with
    :mod:`inspect` on every call (about 20 us, a third of the bridge's fixed cost). Subclasses
    are always called with positional arguments and no defaults, so outside torch.func
    transforms (:func:`transforms_active`) this goes straight to the C implementation
    (``torch._C._FunctionBase.apply``), which is what ``Function.apply`` ends up calling. Under
    transforms, or when a private API is missing, it is ``Function.apply`` unchanged.

    ``c_apply(*args)`` is that C implementation itself, for a caller that has made
    :meth:`apply`'s checks already: no transform is active and no argument is a wrapped tensor.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # the C implementation bound to the subclass, looked up once (a super() per call
        # costs); a docs build mocks torch, where Function is no type and nothing runs
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
    ``vjp``): its autograd node calls ``backward`` directly.

    The autograd engine runs a Python Function's backward through the ``apply`` method of its
    node class (``cls._backward_cls``, a ``torch.autograd.function.BackwardCFunction``),
    which looks up ``backward`` and ``vjp`` and checks that only one is defined on every call
    (about 0.3 us, 1% of the bridge's per-call floor at n = 1e2). The decorator makes the
    node class's ``apply`` the ``backward`` itself, which is what that method ends up
    calling (checked with torch 2.6.0, 2.13.0 and 2.14.1). Without the private node class,
    or for a Function that ``apply`` treats otherwise (a ``vjp``, ``boxed_grads_call``),
    ``cls`` is left as it is.
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
    """:func:`torch.library.custom_op` with an explicit schema and no mutated arguments.

    Giving the schema, instead of letting PyTorch infer it from the annotations, does not
    depend on how a release reads annotations: torch 2.4 could not read those of a module
    that uses ``from __future__ import annotations`` (they are strings).
    """
    return torch.library.custom_op(name, mutates_args=(), schema=schema)
