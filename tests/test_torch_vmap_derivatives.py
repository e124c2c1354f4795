"""Derivatives under ``torch.func.vmap`` (``jacrev``, ``jacfwd``, ``vmap(grad(...))``): each
vmapped backward or forward-mode pass is one more batch dimension of a single call; checked
against per-row loops of plain autograd and against finite differences."""

import pytest

torch = pytest.importorskip("torch")

from torch.func import grad, jacfwd, jacrev, vmap  # noqa: E402

import softorder.bridges.torch as sot  # noqa: E402

GEN = torch.Generator().manual_seed(12)
ROW = torch.tensor([0.5, -1.0, 3.0, 2.0, 0.7], dtype=torch.float64)
LABELS = torch.tensor([1, 4, 0])
P_K = [0.3, 0.7]

# one function of a (3, 5) tensor per operation (the losses reduce to a scalar)
OPERATIONS = {
    "soft_topk": lambda x: sot.soft_topk(x, 2.5, 0.6),
    "soft_topk_dim0_smallest": lambda x: sot.soft_topk(x, 1.5, 0.6, dim=0, largest=False),
    "log_soft_topk": lambda x: sot.log_soft_topk(x, 2.0, 0.6),
    "soft_rank": lambda x: sot.soft_rank(x, 0.5, descending=True),
    "soft_sort": lambda x: sot.soft_sort(x, 0.4),
    "soft_quantile_many": lambda x: sot.soft_quantile(x, torch.tensor([[0.2, 0.7]]), 0.5),
    # several targets per row as nested lists (static values, not tensors)
    "soft_quantile_many_listed": lambda x: sot.soft_quantile(x, [[0.2, 0.7]], 0.5),
    "soft_topk_several_k_listed": lambda x: sot.soft_topk(x, [[1.0, 2.5]], 0.6),
    "soft_permutation": lambda x: sot.soft_permutation(x, 0.5),
    "topk_cross_entropy_mean": lambda x: sot.topk_cross_entropy(x, LABELS, P_K, 0.5),
    "topk_cross_entropy_none": lambda x: sot.topk_cross_entropy(
        x, LABELS, P_K, 0.5, reduction="none", split_top1=True
    ),
    "permutation_cross_entropy_sum": lambda x: sot.permutation_cross_entropy(
        x, torch.tensor([[2, 1, 5, 4, 3]] * 3), 0.5, reduction="sum"
    ),
    # labels and ranks as plain lists (static values, shaped like the batch)
    "topk_cross_entropy_listed_labels": lambda x: sot.topk_cross_entropy(x, [1, 4, 0], P_K, 0.5),
    "permutation_cross_entropy_listed_ranks": lambda x: sot.permutation_cross_entropy(
        x, [[2, 1, 5, 4, 3], [1, 2, 3, 4, 5], (5, 4, 3, 2, 1)], 0.5
    ),
}


@pytest.fixture(params=list(OPERATIONS), ids=list(OPERATIONS))
def op(request):
    return OPERATIONS[request.param]


def _x():
    return torch.randn(3, 5, generator=GEN, dtype=torch.float64)


def _jacobian_by_backward(fn, x):
    """The Jacobian row by row, each one plain (eager) backward."""
    out = fn(x)
    rows = []
    for i in range(out.numel()):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(leaf).reshape(-1)[i], leaf)
        rows.append(g)
    return torch.stack(rows).reshape(out.shape + x.shape)


def _jacobian_by_differences(fn, x, h=1e-6):
    columns = []
    for j in range(x.numel()):
        step = torch.zeros(x.numel(), dtype=x.dtype)
        step[j] = h
        step = step.reshape(x.shape)
        columns.append((fn(x + step) - fn(x - step)) / (2 * h))
    out_shape = columns[0].shape
    return torch.stack(columns, dim=-1).reshape(out_shape + x.shape)


def test_jacrev_and_jacfwd_equal_backward_row_by_row(op):
    x = _x()
    expected = _jacobian_by_backward(op, x)
    torch.testing.assert_close(jacrev(op)(x), expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(jacfwd(op)(x), expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(expected, _jacobian_by_differences(op, x), rtol=1e-5, atol=1e-7)


def test_vmap_of_grad_equals_a_loop_of_grads(op):
    xs = torch.randn(4, 3, 5, generator=GEN, dtype=torch.float64)
    weights = torch.randn(op(xs[0]).shape, generator=GEN, dtype=torch.float64)

    def scalar(x):
        return (op(x) * weights).sum()

    expected = torch.stack([torch.func.grad(scalar)(x) for x in xs])
    torch.testing.assert_close(vmap(grad(scalar))(xs), expected, rtol=1e-12, atol=1e-14)


def test_the_issue_reproductions():
    x = torch.tensor([[0.5, -1.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.0]])
    per_row = vmap(grad(lambda r: sot.soft_rank(r, 0.5)[0]))(x)
    for i in range(2):
        leaf = x[i].clone().requires_grad_()
        sot.soft_rank(leaf, 0.5)[0].backward()
        torch.testing.assert_close(per_row[i], leaf.grad)
    jac = jacfwd(lambda r: sot.soft_rank(r, 0.5))(x[0])
    torch.testing.assert_close(jac, jacrev(lambda r: sot.soft_rank(r, 0.5))(x[0]))
    torch.testing.assert_close(jac, _jacobian_by_backward(lambda r: sot.soft_rank(r, 0.5), x[0]))


def test_one_rows_targets_as_a_list():
    """``soft_quantile(row, [0.25, 0.75])``: a list of several targets of one row stays several
    per row under vmap (the vmapped axis must not read it as one target per row)."""
    q = [0.25, 0.75]
    as_tensor = torch.tensor(q, dtype=torch.float64)
    jac = jacrev(lambda r: sot.soft_quantile(r, q, 0.5))(ROW)
    torch.testing.assert_close(jac, jacrev(lambda r: sot.soft_quantile(r, as_tensor, 0.5))(ROW))
    torch.testing.assert_close(
        jac, _jacobian_by_backward(lambda r: sot.soft_quantile(r, q, 0.5), ROW)
    )
    xs = _x()
    rows = vmap(lambda r: sot.soft_topk(r, (1.0, 2.5), 0.6))(xs)
    torch.testing.assert_close(rows, torch.stack([sot.soft_topk(r, (1.0, 2.5), 0.6) for r in xs]))
    assert rows.shape == (3, 2, 5)
    jacobians = vmap(jacrev(lambda r: sot.soft_quantile(r, q, 0.5)))(xs)
    for jacobian, row in zip(jacobians, xs, strict=True):
        torch.testing.assert_close(
            jacobian, _jacobian_by_backward(lambda r: sot.soft_quantile(r, q, 0.5), row)
        )


def test_listed_labels_and_ranks_under_nested_vmap():
    """Labels and ranks given as plain lists are shaped like each vmapped element's batch: the
    vmapped call gets one copy per element, at every level."""
    xs = torch.randn(2, 4, 3, 5, generator=GEN, dtype=torch.float64)
    ranks = [[2, 1, 5, 4, 3], [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]]

    def losses(x):
        top = sot.topk_cross_entropy(x, [1, 4, 0], P_K, 0.5, reduction="none")
        return top, sot.permutation_cross_entropy(x, ranks, 0.5, reduction="sum")

    def gradients(x):
        return grad(lambda r: sum(loss.sum() for loss in losses(r)))(x)

    got, got_grads = vmap(vmap(losses))(xs), vmap(vmap(gradients))(xs)
    assert got[0].shape == (2, 4, 3) and got[1].shape == (2, 4)
    for i in range(2):
        for j in range(4):
            leaf = xs[i, j].clone().requires_grad_()
            top, perm = losses(leaf)
            torch.testing.assert_close(got[0][i, j], top)
            torch.testing.assert_close(got[1][i, j], perm)
            (top.sum() + perm).backward()
            torch.testing.assert_close(got_grads[i, j], leaf.grad)


def test_jacobians_in_alpha_k_and_q():
    x = _x()

    def topk(k, alpha):
        return sot.soft_topk(x, k, alpha)

    k, alpha = torch.tensor(2.5, dtype=torch.float64), torch.tensor(0.6, dtype=torch.float64)
    for transform in (jacrev, jacfwd):
        dk, dalpha = transform(topk, argnums=(0, 1))(k, alpha)
        torch.testing.assert_close(dk, _jacobian_by_differences(lambda t: topk(t, alpha), k))
        torch.testing.assert_close(
            dalpha, _jacobian_by_differences(lambda t: topk(k, t), alpha), rtol=1e-6, atol=1e-8
        )
    alphas = torch.tensor([0.3, 0.5, 0.9], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.6]] * 3, dtype=torch.float64)

    def quantile(q, alphas):
        return sot.soft_quantile(x, q, alphas)

    for transform in (jacrev, jacfwd):
        dq, dalphas = transform(quantile, argnums=(0, 1))(q, alphas)
        torch.testing.assert_close(
            dq, _jacobian_by_differences(lambda t: quantile(t, alphas), q), rtol=1e-6, atol=1e-8
        )
        torch.testing.assert_close(
            dalphas,
            _jacobian_by_differences(lambda t: quantile(q, t), alphas),
            rtol=1e-6,
            atol=1e-8,
        )


def test_vmap_of_grad_over_alpha_and_labels():
    xs = torch.randn(4, 3, 5, generator=GEN, dtype=torch.float64)
    alphas = torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64)
    labels = torch.randint(0, 5, (4, 3), generator=GEN)

    def loss(x, y, a):
        return sot.topk_cross_entropy(x, y, P_K, a)

    got_x, got_a = vmap(grad(loss, argnums=(0, 2)))(xs, labels, alphas)
    for i in range(4):
        x, a = xs[i].clone().requires_grad_(), alphas[i].clone().requires_grad_()
        loss(x, labels[i], a).backward()
        torch.testing.assert_close(got_x[i], x.grad)
        torch.testing.assert_close(got_a[i], a.grad)


def test_float32_jacobian():
    x = _x().float()
    fn = OPERATIONS["soft_sort"]
    got = jacrev(fn)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _jacobian_by_backward(fn, x))


def test_vmap_of_jacobians_and_chunked_jacrev():
    xs = torch.randn(3, 2, 5, generator=GEN, dtype=torch.float64)
    for name in ("soft_topk", "topk_cross_entropy_mean"):
        fn = OPERATIONS[name]

        def f(u, fn=fn):
            return fn(u.expand(3, 5))  # the operations' (3, 5) shape, from two rows

        expected = torch.stack([_jacobian_by_backward(f, x[:1]) for x in xs])
        torch.testing.assert_close(vmap(jacrev(f))(xs[:, :1]), expected)
        torch.testing.assert_close(vmap(jacfwd(f))(xs[:, :1]), expected)
    fn = OPERATIONS["soft_sort"]
    x = _x()
    torch.testing.assert_close(jacrev(fn, chunk_size=4)(x), _jacobian_by_backward(fn, x))
