"""Soft rank: softorder (NumPy, PyTorch, JAX) and its peers torchsort and ott-jax."""

from ._common import (
    N_VALUES,
    QUADRATIC_MAX_N,
    _JaxBridgeRow,
    _JaxOp,
    _SoftorderBatched,
    _SoftorderInputs,
    _SoftorderRow,
    _TorchBridgeRow,
    _TorchsortRow,
    make_input,
    require,
    skip_above,
)


class SoftRank(_SoftorderRow):
    """``softorder.soft_rank`` of one row of standard normal data."""

    op = "soft_rank"


class SoftRankInputs(_SoftorderInputs):
    """``softorder.soft_rank`` of one float64 row of each input kind."""

    op = "soft_rank"


class SoftRankBatched(_SoftorderBatched):
    """``softorder.soft_rank`` along the last axis of a batch (rows run in parallel)."""

    op = "soft_rank"


class TorchSoftRank(_TorchBridgeRow):
    """The PyTorch bridge: ``softorder.bridges.torch.soft_rank``."""

    op = "soft_rank"


class JaxSoftRank(_JaxBridgeRow):
    """The JAX bridge: ``softorder.bridges.jax.soft_rank`` under ``jax.jit``."""

    op = "soft_rank"


class TorchsortSoftRank(_TorchsortRow):
    """Peer: ``torchsort.soft_rank`` (Blondel et al. 2020, isotonic regression)."""

    op = "soft_rank"


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
