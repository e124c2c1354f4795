"""Every backend implements every member of :class:`softorder._engine.backends.protocol.Backend`,
with the protocol's parameters: checked by inspecting the classes (no GPU needed).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

from softorder._engine.backends import protocol
from softorder._engine.backends.numpy_host import NumpyBackend

MEMBERS = protocol.members()


def _device_backends() -> list:
    """The device backends that can be imported here (numba-cuda, torch), by name."""
    found = []
    for module, name in (
        ("softorder._engine.backends.numba_cuda", "NumbaDeviceBackend"),
        ("softorder.bridges._torch_device", "TorchDeviceBackend"),
    ):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except ImportError:
            continue
    return found


BACKENDS = [NumpyBackend, *_device_backends()]


def test_the_protocol_lists_what_the_rules_call():
    assert len(MEMBERS) >= 20
    assert {"kernels", "sort_rows", "from_host", "unbroadcast", "add_product"} <= set(MEMBERS)


def test_every_backend_that_can_be_imported_here_is_checked():
    names = {cls.__name__ for cls in BACKENDS}
    assert "NumpyBackend" in names
    pytest.importorskip("numba.cuda")
    assert "NumbaDeviceBackend" in names


def _parameters(fn) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())[1:]  # without self


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("member", MEMBERS)
def test_backend_implements_member(cls, member):
    declared = inspect.getattr_static(protocol.Backend, member)
    if isinstance(declared, property):  # an attribute: a class attribute, property or annotation
        assert hasattr(cls, member) or member in inspect.get_annotations(cls), (cls, member)
        return
    implemented = inspect.getattr_static(cls, member, None)
    assert callable(implemented), f"{cls.__name__} has no method {member}"
    wanted, got = _parameters(declared), _parameters(implemented)
    # the protocol's parameters, by name and in order; extra ones only with defaults
    assert [p.name for p in got[: len(wanted)]] == [p.name for p in wanted], (cls, member)
    for p, q in zip(wanted, got, strict=False):
        assert (p.default is p.empty) == (q.default is q.empty), (cls, member, p.name)
    assert all(q.default is not q.empty for q in got[len(wanted) :]), (cls, member)


def _backend_calls(path) -> set[str]:
    """Names read off anything called ``backend`` (``ctx.backend.scale``, ``backend.cast``)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == "backend":
                found.add(node.attr)
    return found


def test_the_engine_calls_on_a_backend_only_what_the_protocol_declares():
    engine = pathlib.Path(protocol.__file__).resolve().parent.parent
    used = set()
    for module in ("rules.py", "layout.py", "call.py", "autodiff.py"):
        used |= _backend_calls(engine / module)
    assert {"from_host", "sort_rows", "scale"} <= used  # the scan sees the rules' calls
    assert used <= set(MEMBERS), f"not in the Backend protocol: {sorted(used - set(MEMBERS))}"
