"""The backends of the rules: where a call's arrays live and which kernels run on them.

* :mod:`~softorder._engine.backends.protocol`: :class:`Backend`, the interface every backend
  implements (what the rules call).

* :mod:`~softorder._engine.backends.numpy_host`: host arrays and the CPU kernels of
  :mod:`softorder.core` (the NumPy API, the JAX bridge on the CPU, CPU tensors), and the host
  helpers every backend shares.
* :mod:`~softorder._engine.backends.numba_cuda`: device arrays of any framework
  (``__cuda_array_interface__``) and the GPU kernels of :mod:`softorder.core.cuda`; needs
  numba-cuda, loaded the first time a device array is seen.
* The PyTorch bridge's backend for CUDA tensors lives with the bridge
  (:mod:`softorder.bridges._torch_device`).

:mod:`softorder._engine.backend` chooses among them for each input. The backends import the kernels
below them and nothing above them; this package's ``__init__`` imports nothing.
"""
