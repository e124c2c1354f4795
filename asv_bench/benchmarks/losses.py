"""Top-k cross-entropy (Petersen et al. 2022) on a batch of logits: softorder (NumPy, PyTorch,
JAX) and difftopk's ``TopKCrossEntropyLoss``.
"""

import numpy as np

from ._common import (
    ALPHA,
    DTYPES,
    QUADRATIC_MAX_N,
    _JaxOp,
    _NumpyOp,
    _TorchOp,
    make_input,
    require,
    skip_above,
)

#: Number of classes C; the batch is 64 samples.
CLASSES = (10, 100, 1_000, 10_000)
BATCH = 64
#: P_K for k = 1..5.
P_K = (0.5, 0.2, 0.1, 0.1, 0.1)


def labels(c: int) -> np.ndarray:
    """Seeded labels, one per sample."""
    return np.random.default_rng(3).integers(0, c, size=BATCH)


class TopkCrossEntropy(_NumpyOp):
    """``softorder.topk_cross_entropy`` (mean over 64 samples), K = 5."""

    params = (CLASSES, DTYPES)
    param_names = ("classes", "dtype")

    def setup(self, classes, dtype):
        softorder = require("softorder")
        logits = make_input("random", (BATCH, classes), dtype)
        self.prepare_op(
            softorder.topk_cross_entropy, (logits, labels(classes), P_K), {"alpha": ALPHA}
        )


class TorchTopkCrossEntropy(_TorchOp):
    """The PyTorch bridge: ``softorder.bridges.torch.topk_cross_entropy``."""

    params = (CLASSES, DTYPES)
    param_names = ("classes", "dtype")

    def setup(self, classes, dtype):
        sot = require("softorder.bridges.torch")
        torch = require("torch")
        y, p_k = torch.from_numpy(labels(classes)), torch.tensor(P_K)
        self.prepare_torch(
            lambda t: sot.topk_cross_entropy(t, y, p_k.to(t.dtype), ALPHA),
            make_input("random", (BATCH, classes), dtype),
        )


class JaxTopkCrossEntropy(_JaxOp):
    """The JAX bridge: ``softorder.bridges.jax.topk_cross_entropy`` under ``jax.jit``."""

    params = (CLASSES, DTYPES)
    param_names = ("classes", "dtype")

    def setup(self, classes, dtype):
        soj = require("softorder.bridges.jax")
        y, p_k = labels(classes), np.asarray(P_K, dtype=dtype)
        self.prepare_jax(
            lambda a: soj.topk_cross_entropy(a, y, p_k, ALPHA),
            make_input("random", (BATCH, classes), dtype),
        )


class DifftopkTopkCrossEntropy(_TorchOp):
    """Peer: ``difftopk.TopKCrossEntropyLoss`` (dense bitonic network, float32)."""

    params = (CLASSES,)
    param_names = ("classes",)

    def setup(self, classes):
        skip_above(classes, QUADRATIC_MAX_N, "dense n x n sorting-network layers")
        difftopk = require("difftopk")
        torch = require("torch")
        loss = difftopk.TopKCrossEntropyLoss(
            "bitonic__non_sparse",
            inverse_temperature=10.0,
            p_k=list(P_K),
            n=classes,
            distribution="cauchy",
        )
        y = torch.from_numpy(labels(classes))
        self.prepare_torch(lambda t: loss(t, y), make_input("random", (BATCH, classes), "float32"))
