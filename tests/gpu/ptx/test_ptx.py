"""Every GPU kernel compiles to PTX for compute capability 8.0 and 9.0, with no GPU present.

This runs NVVM from the CUDA compiler libraries that ``numba-cuda[cu13]`` installs, so code
that only the simulator accepts (Python objects, allocation, unsupported NumPy calls inside a
kernel) fails here.

numba-cuda 0.30 compiles a device function called by a kernel for "the current device's"
compute capability even inside ``compile_ptx(..., cc=...)``, and asks the driver for it,
which fails with no driver. The fixture answers that question with the capability being
compiled for, so the device functions are compiled by the same NVVM for the same target.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import types

import pytest
from numba import cuda

import softorder.core.cuda as gpu
from softorder.core.cuda import _launch, scan

MODULES = [m.name for m in pkgutil.walk_packages(gpu.__path__, gpu.__name__ + ".")]
for _name in MODULES:
    importlib.import_module(_name)
scan._kernels(_launch.threads(), _launch.items())  # the default launch configuration

CAPABILITIES = [(8, 0), (9, 0)]


@pytest.fixture
def target(request, monkeypatch):
    import numba.cuda.dispatcher as dispatcher

    cc = request.param
    monkeypatch.setattr(
        dispatcher, "get_current_device", lambda: types.SimpleNamespace(compute_capability=cc)
    )
    return cc


def test_every_kernel_is_registered():
    """A kernel declared with a bare ``cuda.jit`` (not ``_launch.kernel``) would escape this
    file; only device functions may use ``cuda.jit`` directly.
    """
    for name in MODULES:
        source = inspect.getsource(importlib.import_module(name))
        assert not re.search(r"@cuda\.jit(?!\(device=True)", source), name
    assert len(_launch.KERNELS) >= 10


@pytest.mark.parametrize("target", CAPABILITIES, indirect=True, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("name", sorted(_launch.KERNELS))
def test_kernel_compiles_to_ptx(name, target):
    fn, signature = _launch.KERNELS[name]
    ptx, _ = cuda.compile_ptx(fn, signature, cc=target)
    assert f".target sm_{target[0]}{target[1]}" in ptx
    assert ".entry" in ptx
