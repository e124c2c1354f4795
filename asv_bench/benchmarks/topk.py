"""Soft top-k (k = n / 10): softorder (NumPy, PyTorch, JAX) and its peers difftopk and ott-jax."""

from ._common import (
    ALPHA,
    BATCH_N,
    BATCHES,
    DTYPES,
    KINDS,
    N_VALUES,
    QUADRATIC_MAX_N,
    SINKHORN_MAX_N,
    _JaxOp,
    _NumpyOp,
    _TorchOp,
    batch_shape,
    make_input,
    require,
    skip_above,
    top_k,
)


class SoftTopk(_NumpyOp):
    """``softorder.soft_topk`` of one row of standard normal data."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        softorder = require("softorder")
        x = make_input("random", (n,), dtype)
        self.prepare_op(softorder.soft_topk, (x, top_k(n)), {"alpha": ALPHA})


class LogSoftTopk(_NumpyOp):
    """``softorder.log_soft_topk`` of one row."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        softorder = require("softorder")
        x = make_input("random", (n,), dtype)
        self.prepare_op(softorder.log_soft_topk, (x, top_k(n)), {"alpha": ALPHA})


class SoftTopkInputs(_NumpyOp):
    """``softorder.soft_topk`` of one float64 row of each input kind."""

    params = ((1_000, 100_000), KINDS)
    param_names = ("n", "kind")

    def setup(self, n, kind):
        softorder = require("softorder")
        x = make_input(kind, (n,))
        self.prepare_op(softorder.soft_topk, (x, top_k(n)), {"alpha": ALPHA})


class SoftTopkBatched(_NumpyOp):
    """``softorder.soft_topk`` along the last axis of a batch."""

    params = (BATCHES, BATCH_N, DTYPES)
    param_names = ("batch", "n", "dtype")

    def setup(self, batch, n, dtype):
        softorder = require("softorder")
        x = make_input("random", batch_shape(batch) + (n,), dtype)
        self.prepare_op(softorder.soft_topk, (x, top_k(n)), {"alpha": ALPHA})


class TorchSoftTopk(_TorchOp):
    """The PyTorch bridge: ``softorder.bridges.torch.soft_topk``."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        sot = require("softorder.bridges.torch")
        k = top_k(n)
        self.prepare_torch(lambda t: sot.soft_topk(t, k, ALPHA), make_input("random", (n,), dtype))


class JaxSoftTopk(_JaxOp):
    """The JAX bridge: ``softorder.bridges.jax.soft_topk`` under ``jax.jit``."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        soj = require("softorder.bridges.jax")
        k = top_k(n)
        self.prepare_jax(lambda a: soj.soft_topk(a, k, ALPHA), make_input("random", (n,), dtype))


class DifftopkSoftTopk(_TorchOp):
    """Peer: ``difftopk.DiffTopkNet`` (bitonic network, dense; memberships = row sums).

    Its layers are dense n x n matrices (O(n^2 log^2 n)); it computes in float32 only.
    """

    params = (N_VALUES,)
    param_names = ("n",)

    def setup(self, n):
        skip_above(n, QUADRATIC_MAX_N, "dense n x n sorting-network layers")
        difftopk = require("difftopk")
        net = difftopk.DiffTopkNet("bitonic", n, top_k(n), steepness=10.0, distribution="cauchy")
        x = make_input("random", (1, n), "float32")
        self.prepare_torch(lambda t: net(t)[1].sum(-1), x)


class OttTopkMask(_JaxOp):
    """Peer: ``ott.tools.soft_sort.topk_mask`` (default epsilon; Sinkhorn to 2 targets)."""

    params = (N_VALUES,)
    param_names = ("n",)

    def setup(self, n):
        skip_above(n, SINKHORN_MAX_N, "Sinkhorn iterations")
        soft_sort = require("ott.tools.soft_sort")
        k = top_k(n)
        self.prepare_jax(
            lambda a: soft_sort.topk_mask(a, k=k),
            make_input("random", (n,), "float32"),
        )
