"""Soft rank: softorder (NumPy, PyTorch, JAX) and its peers torchsort and ott-jax."""

from ._common import (
    ALPHA,
    BATCH_N,
    BATCHES,
    DTYPES,
    KINDS,
    N_VALUES,
    PEER_STRENGTH,
    QUADRATIC_MAX_N,
    _JaxOp,
    _NumpyOp,
    _TorchOp,
    batch_shape,
    make_input,
    require,
    skip_above,
)


class SoftRank(_NumpyOp):
    """``softorder.soft_rank`` of one row of standard normal data."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        softorder = require("softorder")
        self.prepare_op(softorder.soft_rank, (make_input("random", (n,), dtype),), {"alpha": ALPHA})


class SoftRankInputs(_NumpyOp):
    """``softorder.soft_rank`` of one float64 row of each input kind."""

    params = ((1_000, 100_000), KINDS)
    param_names = ("n", "kind")

    def setup(self, n, kind):
        softorder = require("softorder")
        self.prepare_op(softorder.soft_rank, (make_input(kind, (n,)),), {"alpha": ALPHA})


class SoftRankBatched(_NumpyOp):
    """``softorder.soft_rank`` along the last axis of a batch (rows run in parallel)."""

    params = (BATCHES, BATCH_N, DTYPES)
    param_names = ("batch", "n", "dtype")

    def setup(self, batch, n, dtype):
        softorder = require("softorder")
        x = make_input("random", batch_shape(batch) + (n,), dtype)
        self.prepare_op(softorder.soft_rank, (x,), {"alpha": ALPHA})


class TorchSoftRank(_TorchOp):
    """The PyTorch bridge: ``softorder.bridges.torch.soft_rank``."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        sot = require("softorder.bridges.torch")
        self.prepare_torch(lambda t: sot.soft_rank(t, ALPHA), make_input("random", (n,), dtype))


class JaxSoftRank(_JaxOp):
    """The JAX bridge: ``softorder.bridges.jax.soft_rank`` under ``jax.jit``."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        soj = require("softorder.bridges.jax")
        self.prepare_jax(lambda a: soj.soft_rank(a, ALPHA), make_input("random", (n,), dtype))


class TorchsortSoftRank(_TorchOp):
    """Peer: ``torchsort.soft_rank`` (Blondel et al. 2020, isotonic regression)."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        torchsort = require("torchsort")
        x = make_input("random", (1, n), dtype)
        self.prepare_torch(
            lambda t: torchsort.soft_rank(t, regularization_strength=PEER_STRENGTH), x
        )


class OttSoftRank(_JaxOp):
    """Peer: ``ott.tools.soft_sort.ranks`` (default epsilon; Sinkhorn to n targets: n x n).

    ``implicit_diff=None`` (unrolled backward): the default implicit differentiation fails
    in ott-jax 0.6 with a singular linear system for a random cotangent.
    """

    params = (N_VALUES,)
    param_names = ("n",)

    def setup(self, n):
        skip_above(n, QUADRATIC_MAX_N, "Sinkhorn with an n x n cost matrix")
        soft_sort = require("ott.tools.soft_sort")
        self.prepare_jax(
            lambda a: soft_sort.ranks(a, implicit_diff=None), make_input("random", (n,), "float32")
        )
