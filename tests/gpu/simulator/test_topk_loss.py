"""GPU top-k cross-entropy (forward, VJP) against the CPU kernels, in numba's CUDA simulator.

The kernels see ``r = -logits``: an infinite ``r`` below is a logit of the opposite sign.
"""

import numpy as np
import pytest

from softorder.core import topk_loss as cpu
from softorder.core.cuda import topk_loss as gpu
from tests.gpu.simulator.harness import compare, rows_of, sample, work

INF = np.inf

# The simulator runs the kernels on NumPy scalars, which warn where a GPU (and the CPU kernels,
# compiled) silently produce inf - inf = NaN: ``offset_z`` computes exactly that and then
# checks for it.


def _batch():
    """Ties and a wide gap (row 0), a -inf logit as the label (row 1: no k can select it, the
    loss is infinite), a NaN row, a +inf logit as the label (row 3); alpha per row.
    """
    x = sample(np.random.default_rng(0), 4, 8)  # x[1, 0] = inf, x[2, 1] = nan
    x[3, 5] = -INF
    labels = np.array([3, 0, 4, 5])
    cot = np.array([1.3, -0.7, 2.0, 0.5])
    return x, np.array([0.3, 1.0, 0.05, 2.0]), labels, cot


def _edge():
    """A +inf logit with the label elsewhere (the split form's softmax part is infinite), two
    +inf logits one of which is the label, values 300 alphas apart (integer targets in log
    space), and a zero cotangent.
    """
    x = np.array(
        [
            [0.3, -INF, 1.2, -0.5, 2.0, 0.0],
            [-INF, 0.4, -INF, 1.0, 1.0, 3.0],
            np.arange(6) * 300.0,
            [0.5, 0.1, 0.9, 0.2, 0.7, 0.3],
        ]
    )
    labels = np.array([2, 2, 1, 4])
    cot = np.array([1.0, 0.8, -1.5, 0.0])
    return x, np.array([0.5, 0.7, 1.0, 0.4]), labels, cot


CASES = {"batch": _batch, "edge": _edge}
PARAMS = [
    (case, split, pk1) for case in sorted(CASES) for split in (False, True) for pk1 in (0, 0.3, 1)
]


def _forward_args(case, split, pk1):
    """The forward's arguments, with ``P_K = (pk1, 0.6 (1 - pk1), 0.4 (1 - pk1))`` per row."""
    x, alpha, labels, _ = CASES[case]()
    xs, order = rows_of(x)
    rows, n = xs.shape
    pk = np.tile([pk1, 0.6 * (1.0 - pk1), 0.4 * (1.0 - pk1)], (rows, 1))
    with np.errstate(divide="ignore"):
        log_pk = np.log(pk)
    K = pk.shape[1]
    return [
        xs,
        order,
        alpha,
        labels,
        log_pk,
        split,
        np.ascontiguousarray(pk[:, 0]),
        np.empty(rows),
        np.empty((rows, K), dtype=np.int64),
        np.empty((rows, K)),
        work(rows, cpu.FORWARD_WORK, n),
    ]


@pytest.mark.parametrize("case, split, pk1", PARAMS)
def test_forward(case, split, pk1):
    args = _forward_args(case, split, pk1)
    loss = compare(cpu.topk_loss_forward, gpu.topk_loss_forward, args, [7, 8, 9])[7]
    if case == "batch":
        assert np.isnan(loss[2]) and not np.isnan(loss[[0, 1, 3]]).any()
        assert loss[1] == INF  # in every form: no k, nor the softmax, selects a -inf logit


@pytest.mark.parametrize("case, split, pk1", PARAMS)
def test_vjp(case, split, pk1):
    forward = _forward_args(case, split, pk1)
    cpu.topk_loss_forward(*forward)
    xs, order, alpha, labels, log_pk, split, pk1s, loss, anchor, offset, _ = forward
    rows, n = xs.shape
    cot = CASES[case]()[3]
    args = [xs, order, alpha, labels, log_pk, split, pk1s, anchor, offset, cot]
    args += [np.empty((rows, n)), np.empty(rows), work(rows, cpu.GRADIENT_WORK, n)]
    x_bar, alpha_bar = compare(cpu.topk_loss_vjp, gpu.topk_loss_vjp, args, [10, 11])[10:12]
    nan = np.isnan(xs).any(axis=1)
    assert np.isnan(x_bar[nan]).all() and not np.isnan(x_bar[~nan]).any()
    infinite = np.isinf(loss)
    assert (x_bar[infinite] == 0.0).all() and (alpha_bar[infinite] == 0.0).all()
    if case == "batch":
        assert np.abs(x_bar[0]).max() > 0.0
