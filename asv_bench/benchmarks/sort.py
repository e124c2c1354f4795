"""Soft sort and soft quantile: softorder (NumPy, PyTorch, JAX) and its peers torchsort,
diffsort and ott-jax.
"""

from ._common import (
    ALPHA,
    BATCH_N,
    BATCHES,
    DTYPES,
    KINDS,
    N_VALUES,
    PEER_STRENGTH,
    QUADRATIC_MAX_N,
    _JaxForwardOp,
    _JaxOp,
    _NumpyOp,
    _TorchOp,
    batch_shape,
    make_input,
    require,
    skip_above,
)


class SoftSort(_NumpyOp):
    """``softorder.soft_sort`` of one row of standard normal data."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        softorder = require("softorder")
        self.prepare_op(softorder.soft_sort, (make_input("random", (n,), dtype),), {"alpha": ALPHA})


class SoftSortInputs(_NumpyOp):
    """``softorder.soft_sort`` of one float64 row of each input kind."""

    params = ((1_000, 100_000), KINDS)
    param_names = ("n", "kind")

    def setup(self, n, kind):
        softorder = require("softorder")
        self.prepare_op(softorder.soft_sort, (make_input(kind, (n,)),), {"alpha": ALPHA})


class SoftSortBatched(_NumpyOp):
    """``softorder.soft_sort`` along the last axis of a batch."""

    params = (BATCHES, BATCH_N, DTYPES)
    param_names = ("batch", "n", "dtype")

    def setup(self, batch, n, dtype):
        softorder = require("softorder")
        x = make_input("random", batch_shape(batch) + (n,), dtype)
        self.prepare_op(softorder.soft_sort, (x,), {"alpha": ALPHA})


class SoftQuantile(_NumpyOp):
    """``softorder.soft_quantile`` at q = 0.1, 0.5, 0.9 of one row."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        softorder = require("softorder")
        x = make_input("random", (n,), dtype)
        self.prepare_op(softorder.soft_quantile, (x, [0.1, 0.5, 0.9]), {"alpha": ALPHA})


class TorchSoftSort(_TorchOp):
    """The PyTorch bridge: ``softorder.bridges.torch.soft_sort``."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        sot = require("softorder.bridges.torch")
        self.prepare_torch(lambda t: sot.soft_sort(t, ALPHA), make_input("random", (n,), dtype))


class JaxSoftSort(_JaxOp):
    """The JAX bridge: ``softorder.bridges.jax.soft_sort`` under ``jax.jit``."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        soj = require("softorder.bridges.jax")
        self.prepare_jax(lambda a: soj.soft_sort(a, ALPHA), make_input("random", (n,), dtype))


class TorchsortSoftSort(_TorchOp):
    """Peer: ``torchsort.soft_sort`` (Blondel et al. 2020, isotonic regression)."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        torchsort = require("torchsort")
        x = make_input("random", (1, n), dtype)
        self.prepare_torch(
            lambda t: torchsort.soft_sort(t, regularization_strength=PEER_STRENGTH), x
        )


class DiffsortSoftSort(_TorchOp):
    """Peer: ``diffsort.DiffSortNet`` (bitonic network; sorted values and n x n matrix)."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        skip_above(n, QUADRATIC_MAX_N, "dense n x n sorting-network layers")
        diffsort = require("diffsort")
        net = diffsort.DiffSortNet("bitonic", n, steepness=10.0)
        self.prepare_torch(lambda t: net(t)[0], make_input("random", (1, n), dtype))


class OttSoftSort(_JaxForwardOp):
    """Peer: ``ott.tools.soft_sort.sort`` (default epsilon; Sinkhorn to n targets: n x n).

    Forward only: its reverse-mode derivative fails in ott-jax 0.6 ("Reverse-mode
    differentiation does not work for lax.while_loop"), with or without implicit
    differentiation.
    """

    params = (N_VALUES,)
    param_names = ("n",)

    def setup(self, n):
        skip_above(n, QUADRATIC_MAX_N, "Sinkhorn with an n x n cost matrix")
        soft_sort = require("ott.tools.soft_sort")
        self.prepare_jax(soft_sort.sort, make_input("random", (n,), "float32"))
