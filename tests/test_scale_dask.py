"""Dask: softorder.dask on arrays chunked along batch axes equals the NumPy call on the whole
batch, values and gradients, with the threaded scheduler and with a 2-process LocalCluster.
"""

import os
import subprocess
import sys

import dask
import numpy as np
import pytest

import softorder

da = pytest.importorskip("dask.array")
sdask = pytest.importorskip("softorder.dask")

N = 7


@pytest.fixture
def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 4, N))
    x[0, 0, :3] = 0.25  # ties
    return x


def _cases(x, given: str = "dask"):
    """(op, NumPy arguments, dask arguments) for each operation and kind of argument; the
    per-row arguments of the dask call ``given`` as dask arrays, NumPy arrays or lists.
    """
    rng = np.random.default_rng(4)
    batch = x.shape[:-1]
    chunks = (2, 3, N)
    xd = da.from_array(x, chunks=chunks)
    alpha_rows = rng.uniform(0.2, 2.0, size=batch)
    k_rows = rng.uniform(0.5, N - 0.5, size=batch)
    k_several = rng.uniform(0.5, N - 0.5, size=batch + (3,))
    q_several = rng.uniform(0.05, 0.95, size=batch + (2,))
    labels = rng.integers(0, N, size=batch)
    target_ranks = np.argsort(rng.random(x.shape), axis=-1) + 1
    p_k_rows = rng.dirichlet(np.ones(3), size=batch)

    def d(a):  # per-row arguments (dask arrays chunked otherwise than x)
        if given == "numpy":
            return a.copy()
        if given == "list":
            return a.tolist()
        return da.from_array(a, chunks=(3, 2) + a.shape[2:])

    return [
        (softorder.soft_rank, (x, 0.5), (xd, 0.5), {}),
        (softorder.soft_rank, (x, alpha_rows), (xd, d(alpha_rows)), {"descending": True}),
        (softorder.soft_sort, (x, 0.3), (xd, 0.3), {}),
        (softorder.soft_topk, (x, 2.5, 0.4), (xd, 2.5, 0.4), {}),
        (softorder.soft_topk, (x, k_rows, 0.4), (xd, d(k_rows), 0.4), {"largest": False}),
        (softorder.soft_topk, (x, k_several, 0.4), (xd, d(k_several), 0.4), {}),
        (softorder.log_soft_topk, (x, 3, alpha_rows), (xd, 3, d(alpha_rows)), {}),
        (softorder.soft_quantile, (x, 0.3, 0.5), (xd, 0.3, 0.5), {}),
        (softorder.soft_quantile, (x, q_several, 0.5), (xd, d(q_several), 0.5), {}),
        (softorder.soft_permutation, (x, 0.5), (xd, 0.5), {}),
        (
            softorder.topk_cross_entropy,
            (x, labels, [0.2, 0.3, 0.5], 0.5),
            (xd, d(labels), [0.2, 0.3, 0.5], 0.5),
            {},
        ),
        (
            softorder.topk_cross_entropy,
            (x, labels, p_k_rows, 0.5),
            (xd, d(labels), d(p_k_rows), 0.5),
            {"reduction": "none", "split_top1": True},
        ),
        (
            softorder.permutation_cross_entropy,
            (x, target_ranks, 0.5),
            (xd, d(target_ranks), 0.5),
            {"reduction": "sum"},
        ),
    ]


def _ids():
    return [
        f"{op.__name__}-{i}"
        for i, (op, *_) in enumerate(_cases(np.zeros((5, 4, N)) + np.arange(N)))
    ]


@pytest.mark.parametrize("given", ["dask", "numpy", "list"])
@pytest.mark.parametrize("case", range(len(_ids())), ids=_ids())
def test_values_and_gradients_equal_the_whole_batch(data, case, given):
    op, np_args, dask_args, kwargs = _cases(data, given)[case]
    expected, reference = softorder.vjp(op, *np_args, **kwargs)
    out = sdask.apply(op, *dask_args, **kwargs)
    if out.ndim:
        assert out.chunks[:2] == ((2, 2, 1), (3, 1))  # split like x along the batch axes
    got = out.compute(scheduler="threads")
    assert got.shape == np.shape(expected) and got.dtype == np.asarray(expected).dtype
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)

    cotangent = np.random.default_rng(5).normal(size=np.shape(expected))
    value, pullback = sdask.vjp(op, *dask_args, **kwargs)
    np.testing.assert_allclose(value.compute(scheduler="threads"), expected, rtol=1e-12)
    grads = pullback(cotangent if cotangent.ndim else float(cotangent))
    expected_grads = reference(cotangent)
    assert len(grads) == len(expected_grads)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        got_grad = grad.compute(scheduler="threads")
        assert got_grad.shape == np.shape(expected_grad)
        np.testing.assert_allclose(got_grad, expected_grad, rtol=1e-10, atol=1e-12)


def test_float32_keeps_its_dtype(data):
    x = data.astype(np.float32)
    got = sdask.apply(softorder.soft_rank, da.from_array(x, chunks=(1, 4, N)), 0.5).compute()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, softorder.soft_rank(x, 0.5))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_reduced_losses_and_shared_gradients_round_once(data, dtype):
    """A reduced loss, its cotangent's share of each row and a shared argument's gradient
    are computed in float64 and rounded once, as the NumPy API does: in float32 (float16) the
    losses were rounded, then summed; the cotangent 1.3 was rounded, then divided; the
    chunks' alpha gradients were rounded, then summed: off by several ulps.
    """
    x = data.astype(dtype)
    xd = da.from_array(x, chunks=(2, 3, N))
    target_ranks = np.argsort(np.argsort(data, axis=-1), axis=-1) + 1
    for reduction in ("mean", "sum"):
        expected, reference = softorder.vjp(
            softorder.permutation_cross_entropy, x, target_ranks, 0.5, reduction=reduction
        )
        value, pullback = sdask.vjp(
            softorder.permutation_cross_entropy, xd, target_ranks, 0.5, reduction=reduction
        )
        grads = dask.compute(*pullback(1.3), scheduler="threads")
        expected_grads = reference(1.3)
        if dtype == np.float64:  # (the chunks' sums add up in another order)
            np.testing.assert_allclose(value.compute(), expected, rtol=1e-14)
            np.testing.assert_allclose(grads[1], expected_grads[1], rtol=1e-14)
        else:
            np.testing.assert_array_equal(value.compute(), expected)
            np.testing.assert_array_equal(grads[1], expected_grads[1])
        np.testing.assert_array_equal(grads[0], expected_grads[0])
        assert value.dtype == grads[0].dtype == grads[1].dtype == dtype
    q_bar, alpha_bar = dask.compute(
        *sdask.vjp(softorder.soft_quantile, xd, 0.3, 0.5)[1](np.ones(x.shape[:-1], dtype))[1:]
    )
    _, reference = softorder.vjp(softorder.soft_quantile, x, 0.3, 0.5)
    expected_q, expected_alpha = reference(np.ones(x.shape[:-1], dtype))[1:]
    if dtype != np.float64:
        np.testing.assert_array_equal(q_bar, expected_q)
        np.testing.assert_array_equal(alpha_bar, expected_alpha)
    # one chunk: the mean is the NumPy API's to the bit in float64 too
    value, pullback = sdask.vjp(
        softorder.permutation_cross_entropy, da.from_array(x), target_ranks, 0.5
    )
    expected, reference = softorder.vjp(softorder.permutation_cross_entropy, x, target_ranks, 0.5)
    np.testing.assert_array_equal(value.compute(), expected)
    np.testing.assert_array_equal(pullback(1.3)[0].compute(), reference(1.3)[0])


def test_shared_arguments_are_checked_and_broadcast_over_the_whole_batch(data):
    """A shared argument is checked against the whole batch, as the NumPy API checks it:
    alpha of shape (2, 4) for a batch (5, 4) chunked by 2 rows was taken by every task (each
    chunk's rows broadcast with it), silently; one that broadcasts along a chunked axis
    (alpha of shape (5, 1)) is split with the rows, its gradient summed back to its shape
    (every task raised "does not broadcast to the batch shape (2, 3)").
    """
    xd = da.from_array(data, chunks=(2, 3, N))
    with pytest.raises(ValueError, match=r"alpha of shape \(2, 4\) does not broadcast"):
        sdask.apply(softorder.soft_rank, xd, np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"k of shape \(2, 1, 2\) does not broadcast"):
        sdask.apply(softorder.soft_topk, xd, np.full((2, 1, 2), 3.0), 0.5)
    rng = np.random.default_rng(6)
    for op, args in (
        (softorder.soft_rank, (rng.uniform(0.2, 2.0, (5, 1)),)),
        (softorder.soft_rank, (rng.uniform(0.2, 2.0, (4,)),)),
        (softorder.soft_sort, (rng.uniform(0.2, 2.0, (5, 1, 1)),)),  # (the keepdims shape)
        (softorder.soft_topk, (rng.uniform(0.5, N - 0.5, (5, 1, 2)), 0.5)),
        (softorder.soft_quantile, (rng.uniform(0.1, 0.9, (1, 4)), rng.uniform(0.2, 2.0, (5, 1)))),
    ):
        for dtype in (np.float64, np.float32):
            x = data.astype(dtype)
            expected, reference = softorder.vjp(op, x, *args)
            value, pullback = sdask.vjp(op, da.from_array(x, chunks=(2, 3, N)), *args)
            np.testing.assert_array_equal(value.compute(), expected)
            cotangent = rng.normal(size=expected.shape).astype(dtype)
            grads = dask.compute(*pullback(cotangent), scheduler="threads")
            for grad, expected_grad in zip(grads, reference(cotangent), strict=True):
                assert grad.shape == expected_grad.shape and grad.dtype == expected_grad.dtype
                np.testing.assert_allclose(grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_a_single_row(data):
    x = data[0, 0]
    got = sdask.apply(softorder.soft_topk, da.from_array(x), 2, 0.5).compute()
    np.testing.assert_allclose(got, softorder.soft_topk(x, 2, 0.5), rtol=1e-12)


def test_split_rows_are_refused(data):
    xd = da.from_array(data, chunks=(5, 4, 3))
    with pytest.raises(ValueError, match=r"must hold whole rows.*split into chunks \(3, 3, 1\)"):
        sdask.apply(softorder.soft_rank, xd, 0.5)
    with pytest.raises(ValueError, match="must hold whole rows"):
        sdask.vjp(softorder.topk_cross_entropy, xd, np.zeros((5, 4), int), [1.0])
    # the advertised fix works
    got = sdask.apply(softorder.soft_rank, xd.rechunk({-1: -1}), 0.5).compute()
    np.testing.assert_allclose(got, softorder.soft_rank(data, 0.5), rtol=1e-12)


def test_bad_calls_are_refused(data):
    xd = da.from_array(data, chunks=(2, 4, N))
    with pytest.raises(ValueError, match="last axis.*moveaxis"):
        sdask.apply(softorder.soft_rank, xd, 0.5, axis=0)
    with pytest.raises(ValueError, match="alpha, a dask array, is a per-row argument"):
        sdask.apply(softorder.soft_rank, xd, da.ones((4,)))
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        sdask.apply(softorder.soft_rank, xd[xd[:, 0, 0] > 0], 0.5)
    with pytest.raises(TypeError, match="x must be a dask array"):
        sdask.apply(softorder.soft_rank, data, 0.5)
    with pytest.raises(TypeError, match="not a softorder operation"):
        sdask.apply(np.sort, xd)
    with pytest.raises(ValueError, match="reduction must be one of"):
        sdask.apply(softorder.topk_cross_entropy, xd, np.zeros((5, 4), int), [1.0], reduction="x")
    _, pullback = sdask.vjp(softorder.soft_rank, xd, 0.5)
    with pytest.raises(ValueError, match="cotangent must have the result's shape"):
        pullback(np.ones(3))
    # a bad value is the NumPy API's error, raised when the task runs
    with pytest.raises(ValueError, match="alpha must be positive"):
        sdask.apply(softorder.soft_rank, xd, -1.0).compute(scheduler="sync")


def test_import_softorder_does_not_import_dask():
    code = "import sys, softorder; sys.exit('dask' in sys.modules or 'distributed' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_local_cluster_of_two_processes(data):
    distributed = pytest.importorskip("distributed")
    labels = np.random.default_rng(6).integers(0, N, size=data.shape[:-1])
    xd = da.from_array(data, chunks=(2, 2, N))
    with (
        distributed.LocalCluster(
            n_workers=2,
            processes=True,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address=None,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        ranks = sdask.apply(softorder.soft_rank, xd, 0.5)
        loss, pullback = sdask.vjp(
            softorder.topk_cross_entropy, xd, da.from_array(labels, chunks=(2, 2)), [0.5, 0.5]
        )
        logits_bar, alpha_bar = pullback(1.0)
        got = client.compute([ranks, loss, logits_bar, alpha_bar], sync=True)
        # two worker processes other than this one, on the loopback
        workers = client.run(os.getpid)
        assert len(set(workers.values()) - {os.getpid()}) == 2
        assert all(address.startswith("tcp://127.0.0.1:") for address in workers)
    np.testing.assert_allclose(got[0], softorder.soft_rank(data, 0.5), rtol=1e-12)
    expected, reference = softorder.vjp(softorder.topk_cross_entropy, data, labels, [0.5, 0.5])
    np.testing.assert_allclose(got[1], expected, rtol=1e-12)
    for grad, expected_grad in zip(got[2:], reference(1.0), strict=True):
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-10, atol=1e-12)
