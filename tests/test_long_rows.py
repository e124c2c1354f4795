"""Rows long enough for the paths that only long rows take (the loops that follow a row's
order prefetch ahead from ``core.rows.PREFETCH_FROM`` elements on), against the same
operations on short rows, whose values the brute-force tests check: a long row made of blocks
so far apart that no block's terms reach another (their Laplace weights underflow to 0 or 1
exactly) is, block by block, the blocks' own result, offset by the count of the blocks below;
its elements in random order, so that every read and write by the sort order jumps.
"""

import numba
import numpy as np
import pytest

import softorder
from softorder.core.rows import PREFETCH_FROM

pytestmark = pytest.mark.skipif(
    numba.config.DISABLE_JIT, reason="NUMBA_DISABLE_JIT: Python kernels, too slow here"
)

BLOCK = 1024
BLOCKS = PREFETCH_FROM // BLOCK + 2
ALPHA = 0.3
TOLERANCE = {np.float64: dict(rtol=1e-10, atol=1e-10), np.float32: dict(rtol=2e-6, atol=2e-6)}


def blocks_row(dtype):
    """``(x, where)``: a shuffled long row of :data:`BLOCKS` blocks, block ``j`` about
    ``1e4 * j``, and ``where[j]``: the positions of block ``j``'s elements in ``x``.
    """
    rng = np.random.default_rng(11)
    values = rng.standard_normal((BLOCKS, BLOCK)) + 1e4 * np.arange(BLOCKS)[:, None]
    values = values.astype(dtype)
    permutation = rng.permutation(values.size)
    x = np.empty(values.size, dtype)
    x[permutation] = values.ravel()
    return x, permutation.reshape(BLOCKS, BLOCK)


def pullback(op, x, *args, only=None):
    """The result, and the gradient of ``<v, result>`` with ``v``, which is 0 outside the
    positions ``only`` when they are given.
    """
    out, vjp = softorder.vjp(op, x, *args, alpha=ALPHA)
    v = np.cos(np.arange(out.size)).astype(out.dtype).reshape(out.shape)
    if only is not None:
        v[np.setdiff1d(np.arange(v.size), only)] = 0.0
    return out, vjp(v)[0], v


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_soft_rank_and_sort_of_a_long_row_are_its_blocks(dtype):
    x, where = blocks_row(dtype)
    assert x.size >= PREFETCH_FROM
    ranks, rank_grad, v = pullback(softorder.soft_rank, x)
    ordered, sort_grad, u = pullback(softorder.soft_sort, x)
    for j, at in enumerate(where):
        block = x[at]
        out, vjp = softorder.vjp(softorder.soft_rank, block, alpha=ALPHA)
        np.testing.assert_allclose(ranks[at], out + BLOCK * j, **TOLERANCE[dtype])
        np.testing.assert_allclose(rank_grad[at], vjp(v[at])[0], **TOLERANCE[dtype])
        span = slice(j * BLOCK, (j + 1) * BLOCK)  # soft sort's places: the blocks in order
        out, vjp = softorder.vjp(softorder.soft_sort, block, alpha=ALPHA)
        np.testing.assert_allclose(ordered[span], out, **TOLERANCE[dtype])
        np.testing.assert_allclose(sort_grad[at], vjp(u[span])[0], **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("log", [False, True])
def test_soft_topk_of_a_long_row_is_its_blocks(dtype, log):
    """k reaches 300 elements into the fourth block from the top: the blocks above are in,
    those below out, and that block's memberships are its own top 300's. (The log's
    cotangent is that block's alone: the far blocks' logs are finite, linear in the
    threshold, so their cotangents reach the block through it.)
    """
    op = softorder.log_soft_topk if log else softorder.soft_topk
    x, where = blocks_row(dtype)
    k_local, above = 300, 3
    j = BLOCKS - 1 - above
    only = where[j] if log else None
    member, grad, v = pullback(op, x, k_local + BLOCK * above, only=only)
    out, vjp = softorder.vjp(op, x[where[j]], k_local, alpha=ALPHA)
    np.testing.assert_allclose(member[where[j]], out, **TOLERANCE[dtype])
    np.testing.assert_allclose(grad[where[j]], vjp(v[where[j]])[0], **TOLERANCE[dtype])
    if not log:
        np.testing.assert_array_equal(member[where[j + 1 :]], 1.0)
        np.testing.assert_array_equal(member[where[:j]], 0.0)
    others = np.delete(where, j, axis=0)
    np.testing.assert_allclose(grad[others], 0.0, atol=TOLERANCE[dtype]["atol"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_permutation_loss_of_a_long_row_is_its_blocks(dtype):
    """Each block's elements take a permutation of that block's ranks: the boundaries between
    blocks lie far from every element, so the row's loss is the sum of the blocks' losses,
    and each element's gradient its block's.
    """
    x, where = blocks_row(dtype)
    rng = np.random.default_rng(12)
    local = np.argsort(rng.random((BLOCKS, BLOCK)), axis=1) + 1
    target = np.empty(x.size, np.int64)
    target[where] = local + BLOCK * np.arange(BLOCKS)[:, None]
    op = softorder.permutation_cross_entropy
    loss, vjp = softorder.vjp(op, x, target, alpha=ALPHA, reduction="sum")
    grad = vjp(np.asarray(1.0, loss.dtype))[0]
    total = 0.0
    for j, at in enumerate(where):
        block_loss, block_vjp = softorder.vjp(op, x[at], local[j], alpha=ALPHA, reduction="sum")
        total += float(block_loss)
        block_grad = block_vjp(np.asarray(1.0, block_loss.dtype))[0]
        np.testing.assert_allclose(grad[at], block_grad, **TOLERANCE[dtype])
    np.testing.assert_allclose(float(loss), total, rtol=TOLERANCE[dtype]["rtol"] * 10)
