"""Soft top-k (k = n / 10): softorder (NumPy, PyTorch, JAX) and its peers difftopk and ott-jax."""

from ._common import (
    N_VALUES,
    QUADRATIC_MAX_N,
    SINKHORN_MAX_N,
    _JaxBridgeRow,
    _JaxOp,
    _SoftorderBatched,
    _SoftorderInputs,
    _SoftorderRow,
    _TorchBridgeRow,
    _TorchOp,
    make_input,
    require,
    skip_above,
    top_k,
)


class _TopK:
    """Mixin: the extra argument is k = n / 10."""

    def extra_args(self, n):
        return (top_k(n),)


class SoftTopk(_TopK, _SoftorderRow):
    """``softorder.soft_topk`` of one row of standard normal data."""

    op = "soft_topk"


class SoftTopkK5(_SoftorderRow):
    """``softorder.soft_topk`` of one row with k = 5 (a fixed k: O(n) output work)."""

    op = "soft_topk"

    def extra_args(self, n):
        return (min(5, n - 1),)


class LogSoftTopk(_TopK, _SoftorderRow):
    """``softorder.log_soft_topk`` of one row."""

    op = "log_soft_topk"


class SoftTopkInputs(_TopK, _SoftorderInputs):
    """``softorder.soft_topk`` of one float64 row of each input kind."""

    op = "soft_topk"


class SoftTopkBatched(_TopK, _SoftorderBatched):
    """``softorder.soft_topk`` along the last axis of a batch."""

    op = "soft_topk"


class TorchSoftTopk(_TopK, _TorchBridgeRow):
    """The PyTorch bridge: ``softorder.bridges.torch.soft_topk``."""

    op = "soft_topk"


class JaxSoftTopk(_TopK, _JaxBridgeRow):
    """The JAX bridge: ``softorder.bridges.jax.soft_topk`` under ``jax.jit``."""

    op = "soft_topk"


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
