"""Soft sort and soft quantile: softorder (NumPy, PyTorch, JAX) and its peers torchsort,
diffsort and ott-jax.
"""

from ._common import (
    DTYPES,
    N_VALUES,
    QUADRATIC_MAX_N,
    _JaxBridgeRow,
    _JaxForwardOp,
    _SoftorderBatched,
    _SoftorderInputs,
    _SoftorderRow,
    _TorchBridgeRow,
    _TorchOp,
    _TorchsortRow,
    make_input,
    require,
    skip_above,
)


class SoftSort(_SoftorderRow):
    """``softorder.soft_sort`` of one row of standard normal data."""

    op = "soft_sort"


class SoftSortInputs(_SoftorderInputs):
    """``softorder.soft_sort`` of one float64 row of each input kind."""

    op = "soft_sort"


class SoftSortBatched(_SoftorderBatched):
    """``softorder.soft_sort`` along the last axis of a batch."""

    op = "soft_sort"


class SoftQuantile(_SoftorderRow):
    """``softorder.soft_quantile`` at q = 0.1, 0.5, 0.9 of one row."""

    op = "soft_quantile"

    def extra_args(self, n):
        return ([0.1, 0.5, 0.9],)


class TorchSoftSort(_TorchBridgeRow):
    """The PyTorch bridge: ``softorder.bridges.torch.soft_sort``."""

    op = "soft_sort"


class JaxSoftSort(_JaxBridgeRow):
    """The JAX bridge: ``softorder.bridges.jax.soft_sort`` under ``jax.jit``."""

    op = "soft_sort"


class TorchsortSoftSort(_TorchsortRow):
    """Peer: ``torchsort.soft_sort`` (Blondel et al. 2020, isotonic regression)."""

    op = "soft_sort"


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
