"""The framework-neutral engine between the public APIs and the kernels.

Every path (the NumPy API, the PyTorch and JAX bridges, :mod:`softorder.dask`) goes through
this package, and this package calls :mod:`softorder.core`. Where a change goes: see
``README.md`` in this folder.
"""
