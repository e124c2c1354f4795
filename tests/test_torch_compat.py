"""The private PyTorch APIs of the PyTorch bridge, all in ``softorder.bridges._torch_compat``:
each entry point works on the installed torch, each fallback works, and the bridge itself
names no private torch API."""

import pathlib
import re

import pytest

torch = pytest.importorskip("torch")

import softorder.bridges.torch as sot  # noqa: E402
from softorder.bridges import _torch_compat as compat  # noqa: E402

BRIDGE = pathlib.Path(sot.__file__)


def test_the_bridge_names_no_private_torch_api():
    text = BRIDGE.read_text()
    assert not re.findall(r"torch\._|\b_C\b|_functorch|_subclasses|_dynamo", text)
    assert "_torch_compat" in text


def test_is_wrapped_under_transforms_only():
    x = torch.ones(3)
    seen = []

    def f(t):
        seen.append(compat.is_wrapped(t))
        return t.sum()

    torch.func.grad(f)(x)
    torch.func.vmap(f)(torch.ones(2, 3))
    f(x)
    assert seen == [True, True, False]


def test_transforms_active_under_transforms_only(monkeypatch):
    seen = []

    def f(t):
        seen.append(compat.transforms_active())
        return t.sum()

    torch.func.grad(f)(torch.ones(3))
    f(torch.ones(3))
    assert seen == [True, False]
    assert compat._always() is True  # the fallback, for a torch without the API


def test_forward_mode_active_under_jvp_and_dual_levels_only():
    seen = []

    def f(t):
        seen.append(compat.forward_mode_active())
        return t * 2

    x = torch.ones(3)
    torch.func.jvp(f, (x,), (x,))
    torch.func.vmap(torch.func.jvp, in_dims=(None, 0, 0))(
        f, (torch.ones(2, 3),), (torch.ones(2, 3),)
    )
    torch.func.vmap(lambda t: torch.func.jvp(f, (t,), (t,)))(torch.ones(2, 3))
    torch.func.grad(lambda t: f(t).sum())(x)
    torch.func.vmap(f)(torch.ones(2, 3))
    with torch.autograd.forward_ad.dual_level():
        f(torch.autograd.forward_ad.make_dual(x, x))
    f(x)
    assert seen == [True, True, True, False, False, True, False]


def test_forward_mode_possible_under_transforms_and_dual_levels(monkeypatch):
    seen = []

    def f(t):
        seen.append(compat.forward_mode_possible())
        return t * 2

    x = torch.ones(3)
    torch.func.jvp(f, (x,), (x,))
    torch.func.grad(lambda t: f(t).sum())(x)  # any transform: a jvp may be inside it
    with torch.autograd.forward_ad.dual_level():
        f(x)
    f(x)
    assert seen == [True, True, True, False]
    monkeypatch.delattr(torch.autograd.forward_ad, "_current_level")
    assert compat.forward_mode_possible() is True  # without the private level: always


def test_dual_level_open_inside_dual_levels_only(monkeypatch):
    assert compat.dual_level_open() is False
    with torch.autograd.forward_ad.dual_level():
        assert compat.dual_level_open() is True
    assert compat.dual_level_open() is False
    monkeypatch.delattr(torch.autograd.forward_ad, "_current_level")
    assert compat.dual_level_open() is True  # without the private level: always


def _dead_wrapper() -> torch.Tensor:
    """A tensor wrapped by a torch.func transform that has finished."""
    leaked = []

    def f(t):
        leaked.append(t * 2)
        return t.sum()

    torch.func.grad(f)(torch.ones(3))
    assert compat.is_wrapped(leaked[0])
    return leaked[0]


def test_unwrap_dead_wrappers(monkeypatch):
    (plain,) = compat.unwrap_dead_wrappers((_dead_wrapper(),))
    assert not compat.is_wrapped(plain)
    torch.testing.assert_close(plain, torch.full((3,), 2.0))
    monkeypatch.setattr(compat, "_unwrap_dead_wrappers", None)
    assert compat.unwrap_dead_wrappers((plain,)) is None


@pytest.mark.parametrize("without_the_class", [False, True])
def test_is_fake(monkeypatch, without_the_class):
    from torch._subclasses.fake_tensor import FakeTensorMode

    if without_the_class:
        monkeypatch.setattr(compat, "_FakeTensor", None)
    with FakeTensorMode():
        fake = torch.empty(2, 3)
    assert compat.is_fake(fake)
    assert compat.is_fake(torch.empty(2, device="meta"))
    assert not compat.is_fake(torch.empty(2))


def test_the_constant_marker_is_pytorchs():
    # mark_constant sets what torch.compiler.assume_constant_result sets, without importing
    # dynamo; if PyTorch changes the marker this fails (and so would the fullgraph tests)
    def fn():
        return 0

    torch.compiler.assume_constant_result(fn)
    assert fn.__dict__ == {compat.CONSTANT_MARKER: True}
    assert getattr(sot._encode, compat.CONSTANT_MARKER) is True


class _Double(compat.FastApplyFunction):
    @staticmethod
    def forward(scale, t):
        return t * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[0]

    @staticmethod
    def backward(ctx, g):
        return None, g * ctx.scale

    @staticmethod
    def vmap(info, in_dims, scale, t):
        return t * scale, in_dims[1]


@pytest.mark.parametrize("fallbacks", [False, True])
def test_fast_apply_function(monkeypatch, fallbacks):
    if fallbacks:  # a torch without the private APIs: Function.apply throughout
        monkeypatch.setattr(compat, "transforms_active", compat._always)
        monkeypatch.setattr(compat, "_unwrap_dead_wrappers", None)
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    _Double.apply(3.0, x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 3.0))
    g = torch.func.grad(lambda t: _Double.apply(2.0, t).sum())(torch.ones(2))
    torch.testing.assert_close(g, torch.full((2,), 2.0))
    out = torch.func.vmap(lambda t: _Double.apply(2.0, t))(torch.ones(4, 2))
    torch.testing.assert_close(out, torch.full((4, 2), 2.0))
    dead = _dead_wrapper()
    torch.testing.assert_close(_Double.apply(0.5, dead), torch.ones(3))


class _Triple(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t * 3.0

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors  # (PyTorch's in-place check still runs)
        return g * 3.0


def test_direct_backward():
    triple = compat.direct_backward(type("Triple", (_Triple,), {}))
    assert triple._backward_cls.apply is _Triple.backward
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    (g,) = torch.autograd.grad(triple.apply(x), x, torch.ones(2))
    torch.testing.assert_close(g, torch.full((2,), 3.0))
    y = x.clone()
    out = triple.apply(y)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    # the bridge's plain Functions call their backward directly, the one with a jvp does not
    assert sot._PlainOperation._backward_cls.apply is sot._PlainOperation.backward
    assert sot._Operation._backward_cls.apply.__qualname__ == "BackwardCFunction.apply"


def test_direct_backward_leaves_other_functions_alone():
    with_vjp = type("WithVjp", (torch.autograd.Function,), {"vjp": staticmethod(lambda c, g: g)})
    boxed = type("Boxed", (_Triple,), {"boxed_grads_call": True})
    for cls in (with_vjp, boxed):
        apply = cls._backward_cls.apply
        assert compat.direct_backward(cls) is cls
        assert cls._backward_cls.apply is apply
    without_node = type("NoNode", (), {"backward": staticmethod(lambda c, g: g)})
    assert compat.direct_backward(without_node) is without_node  # a torch without the class


def test_transforms_traced_under_any_torch_func_transform_only():
    seen = []

    def f(t):
        seen.append(compat.transforms_traced())
        return t * 2

    torch.func.vmap(f)(torch.ones(2, 3))
    torch.func.grad(lambda t: f(t).sum())(torch.ones(3))
    f(torch.ones(3))
    assert seen == [True, True, False]
