"""Framework bridges: the softorder operations as PyTorch and JAX functions.

Each bridge is a separate module, imported on demand so that softorder itself needs neither
framework: ``import softorder.bridges.jax as soj`` or ``import softorder.bridges.torch``.
Both route every operation through the same rules as the NumPy API
(:mod:`softorder._engine.rules`), so values and gradients agree with :func:`softorder.vjp`.
"""
