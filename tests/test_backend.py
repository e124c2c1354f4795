"""How :func:`softorder._engine.backend.backend_of` chooses a backend, without a GPU."""

import sys

import numpy as np
import pytest

from softorder._engine import backend as _backend


class _FakeDeviceArray:
    """Claims to be a device array, as CuPy or a numba device array would."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": (3,), "typestr": "<f8", "data": (0, False), "version": 3}


class _Sharded:
    """Raises on the attribute, as a sharded JAX array does."""

    @property
    def __cuda_array_interface__(self):
        raise ValueError("not one device array")


@pytest.fixture
def fresh(monkeypatch):
    """The registry as at import: no lookups, the device backend not loaded."""
    monkeypatch.setattr(_backend, "_lookups", [])
    monkeypatch.setattr(_backend, "_device_backend_loaded", False)
    return monkeypatch


def test_host_values_stay_on_numpy(fresh):
    for value in (np.ones(3), [1.0, 2.0], 3.0, _Sharded()):
        assert _backend.backend_of(value) is _backend.NUMPY
    assert not _backend._device_backend_loaded


def test_device_array_without_numba_cuda_raises_every_time(fresh):
    import softorder._engine.backends

    fresh.setitem(sys.modules, "softorder._engine.backends.numba_cuda", None)  # import fails
    fresh.delattr(
        softorder._engine.backends, "numba_cuda", raising=False
    )  # even if imported before
    for _ in range(2):  # never a silent fall back to NumPy
        with pytest.raises(ImportError, match="softorder.*numba-cuda"):
            _backend.backend_of(_FakeDeviceArray())
    assert _backend._lookups == []


def test_registered_lookup_comes_first(fresh):
    marker = object()
    lookup = lambda x: marker if isinstance(x, str) else None  # noqa: E731
    _backend.register(lookup)
    _backend.register(lookup)  # once only
    assert _backend._lookups == [lookup]
    assert _backend.backend_of("a") is marker
    assert _backend.backend_of(np.ones(2)) is _backend.NUMPY
    _backend.unregister(lookup)
    assert _backend.backend_of("a") is _backend.NUMPY
