"""Soft permutation matrix and the permutation cross-entropy: softorder (NumPy, PyTorch, JAX)
and the n x n relaxations NeuralSort and SoftSort (from difftopk).
"""

import numpy as np

from ._common import (
    ALPHA,
    DTYPES,
    QUADRATIC_MAX_N,
    _JaxBridgeRow,
    _SoftorderRow,
    _TorchBridgeRow,
    _TorchOp,
    make_input,
    require,
    skip_above,
)

#: The matrix is the output: n x n doubles (8 MB at n = 1e3, 800 MB at n = 1e4).
MATRIX_N = (100, 1_000, 3_000)


def target_ranks(n: int, batch: tuple[int, ...] = ()) -> np.ndarray:
    """Seeded 1-based target ranks: a random permutation of 1..n per row."""
    rng = np.random.default_rng(7)
    return rng.permuted(np.broadcast_to(np.arange(1, n + 1), batch + (n,)), axis=-1)


class _TargetRanks:
    """Mixin: the extra argument is the target ranks of one row."""

    def extra_args(self, n):
        return (target_ranks(n),)


class SoftPermutation(_SoftorderRow):
    """``softorder.soft_permutation`` (the n x n output) of one row."""

    op = "soft_permutation"
    params = (MATRIX_N, DTYPES)


class PermutationCrossEntropy(_TargetRanks, _SoftorderRow):
    """``softorder.permutation_cross_entropy`` of one row (no n x n matrix)."""

    op = "permutation_cross_entropy"


class TorchPermutationCrossEntropy(_TargetRanks, _TorchBridgeRow):
    """The PyTorch bridge: ``softorder.bridges.torch.permutation_cross_entropy``."""

    op = "permutation_cross_entropy"


class JaxPermutationCrossEntropy(_TargetRanks, _JaxBridgeRow):
    """The JAX bridge: ``softorder.bridges.jax.permutation_cross_entropy`` under ``jax.jit``."""

    op = "permutation_cross_entropy"


class TorchSoftPermutation(_TorchBridgeRow):
    """The PyTorch bridge: ``softorder.bridges.torch.soft_permutation``."""

    op = "soft_permutation"
    params = (MATRIX_N, DTYPES)


class NeuralSortPermutation(_TorchOp):
    """Peer: ``difftopk.NeuralSort`` (Grover et al. 2019): n x n, float32 only."""

    params = (MATRIX_N,)
    param_names = ("n",)

    def setup(self, n):
        skip_above(n, 3 * QUADRATIC_MAX_N, "n x n matrices")
        difftopk = require("difftopk")
        net = difftopk.NeuralSort(tau=ALPHA)
        self.prepare_torch(net, make_input("random", (1, n), "float32"))


class SoftSortPermutation(_TorchOp):
    """Peer: ``difftopk.SoftSort`` (Prillo et al. 2020), an n x n relaxed permutation."""

    params = (MATRIX_N, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        skip_above(n, 3 * QUADRATIC_MAX_N, "n x n matrices")
        difftopk = require("difftopk")
        net = difftopk.SoftSort(tau=ALPHA)
        self.prepare_torch(net, make_input("random", (1, n), dtype))
