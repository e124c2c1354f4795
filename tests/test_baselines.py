"""The baseline methods against their papers' defining properties and independent references."""

import math

import pytest
import torch

from softorder import baselines as bl

torch.set_default_dtype(torch.float32)
F64 = torch.float64
PERM = bl.PERMUTATION_METHODS
# Temperatures at which each method is within 1e-3 of the hard result on inputs one unit apart,
# and the options it needs to get there (Sinkhorn converges slowly at small temperatures).
SHARP = {
    "neuralsort": (0.02, {}),
    "softsort": (0.02, {}),
    "sinkhorn": (0.1, {"n_iter": 3000}),
    "soft_topk_ot": (0.1, {"n_iter": 3000}),
    "odd_even_network": (0.02, {}),
    "bitonic_network": (0.02, {}),
}


def spaced(batch, n, seed=0):
    """Rows that are random permutations of 0..n-1 (neighbours one unit apart)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=g) for _ in range(batch)]).to(F64)


def hard_permutation(x, descending):
    order = torch.argsort(x, dim=-1, descending=descending)
    return torch.nn.functional.one_hot(order, x.shape[-1]).to(x.dtype)


def hard_memberships(x, big_k):
    ranks = torch.argsort(torch.argsort(x, dim=-1, descending=True), dim=-1)  # 0 = largest
    ks = torch.arange(1, big_k + 1).reshape(big_k, 1)
    return (ranks.unsqueeze(-2) < ks).to(x.dtype)


# --- independent references -------------------------------------------------------------


def naive_neuralsort(x, tau):
    """Grover et al. eq. for one row, descending, with explicit loops."""
    n = len(x)
    rows = []
    for i in range(1, n + 1):
        logits = [
            ((n + 1 - 2 * i) * x[j] - sum(abs(x[j] - x[m]) for m in range(n))) / tau
            for j in range(n)
        ]
        rows.append(torch.softmax(torch.stack(logits), 0))
    return torch.stack(rows)


def naive_softsort(x, tau):
    s = sorted(x.tolist(), reverse=True)
    return torch.stack([torch.softmax(-(si - x).abs() / tau, 0) for si in s])


def naive_ot_plan(x, anchors, mu, nu, eps, iters=20000):
    """Linear-domain Sinkhorn with the full squared cost (no reduction)."""
    kernel = torch.exp(-((x[:, None] - anchors[None, :]) ** 2) / eps)
    q = torch.ones_like(nu)
    for _ in range(iters):
        p = mu / (kernel @ q)
        q = nu / (kernel.T @ p)
    return p[:, None] * kernel * q[None, :]


def logistic_topk(x, k, eps):
    """The closed form of SOFT top-k: sigmoid((2 x - t) / eps) summing to k (bisection in t)."""
    lo, hi = float(2 * x.min()) - 60 * eps, float(2 * x.max()) + 60 * eps
    for _ in range(200):
        t = (lo + hi) / 2
        if float(torch.sigmoid((2 * x - t) / eps).sum()) > k:
            lo = t
        else:
            hi = t
    return torch.sigmoid((2 * x - t) / eps)


# --- definitions ---------------------------------------------------------------------------


def test_neuralsort_matches_its_formula():
    x = torch.randn(6, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(bl.neuralsort(x, 0.7, descending=True), naive_neuralsort(x, 0.7))
    torch.testing.assert_close(bl.neuralsort(x, 0.7), naive_neuralsort(-x, 0.7))


def test_softsort_matches_its_formula():
    x = torch.randn(6, dtype=F64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(bl.softsort(x, 0.7, descending=True), naive_softsort(x, 0.7))
    torch.testing.assert_close(bl.softsort(x, 0.7), naive_softsort(-x, 0.7))


def test_sinkhorn_sort_is_the_full_cost_transport_plan():
    """The reduced cost gives the plan of the paper's squared cost (x_i - y_j)^2."""
    n, eps = 6, 1.5
    x = torch.randn(n, dtype=F64, generator=torch.Generator().manual_seed(3))
    anchors = torch.arange(n, dtype=F64)
    mass = torch.full((n,), 1 / n, dtype=F64)
    plan = naive_ot_plan(x, anchors, mass, mass, eps)
    torch.testing.assert_close(bl.sinkhorn_sort(x, eps, n_iter=2000), n * plan.T)


def test_soft_topk_ot_is_the_two_anchor_plan_and_logistic():
    n, k, eps = 7, 3, 0.8
    x = torch.randn(n, dtype=F64, generator=torch.Generator().manual_seed(4))
    a = bl.soft_topk_ot(x, k, eps, n_iter=2000)
    mu = torch.full((n,), 1 / n, dtype=F64)
    nu = torch.tensor([(n - k) / n, k / n], dtype=F64)
    plan = naive_ot_plan(x, torch.tensor([0.0, 1.0], dtype=F64), mu, nu, eps)
    torch.testing.assert_close(a, n * plan[:, 1])
    torch.testing.assert_close(a, logistic_topk(x, k, eps))
    torch.testing.assert_close(
        bl.soft_topk_ot(x, k, eps, largest=False, n_iter=2000), logistic_topk(-x, k, eps)
    )


def test_sorting_network_single_comparator():
    x = torch.tensor([0.3, -0.2], dtype=F64)
    alpha = torch.sigmoid(torch.tensor(-0.5 / 0.25, dtype=F64))  # P(x0 is the smaller)
    expected = torch.tensor([[alpha, 1 - alpha], [1 - alpha, alpha]], dtype=F64)
    for network in ("odd_even", "bitonic"):
        torch.testing.assert_close(bl.sorting_network(x, 0.25, network=network), expected)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9])
def test_bitonic_network_sorts_every_permutation_hard(n):
    x = spaced(20, n, seed=n)
    for network in ("odd_even", "bitonic"):
        p = bl.sorting_network(x, 1e-3, network=network)
        torch.testing.assert_close(p, hard_permutation(x, False))


# --- stochasticity ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", PERM)
@pytest.mark.parametrize("descending", [False, True])
def test_rows_are_stochastic(method, descending):
    x = torch.randn(3, 7, dtype=F64, generator=torch.Generator().manual_seed(5))
    p = bl.relaxed_permutation(x, method, 0.5, descending=descending)
    assert p.shape == (3, 7, 7)
    assert bool((p >= 0).all())
    torch.testing.assert_close(p.sum(-1), torch.ones(3, 7, dtype=F64))


@pytest.mark.parametrize("method", ["odd_even_network", "bitonic_network", "sinkhorn"])
@pytest.mark.parametrize("tau", [0.3, 3.0])
def test_columns_are_stochastic_where_the_paper_says(method, tau):
    x = torch.randn(2, 6, dtype=F64, generator=torch.Generator().manual_seed(6))
    options = {"n_iter": 3000} if method == "sinkhorn" else {}
    p = bl.relaxed_permutation(x, method, tau, **options)
    torch.testing.assert_close(p.sum(-2), torch.ones(2, 6, dtype=F64))


@pytest.mark.parametrize("method", ["neuralsort", "softsort"])
def test_row_softmax_methods_are_not_column_stochastic(method):
    x = torch.tensor([0.0, 1.0, 1.1, 1.2], dtype=F64)
    p = bl.relaxed_permutation(x, method, 1.0)
    assert float((p.sum(-2) - 1).abs().max()) > 0.05  # as their papers state


# --- hard limits ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", PERM)
@pytest.mark.parametrize("descending", [False, True])
def test_permutation_tends_to_the_hard_one(method, descending):
    tau, options = SHARP[method]
    x = spaced(4, 7, seed=7)
    p = bl.relaxed_permutation(x, method, tau, descending=descending, **options)
    torch.testing.assert_close(p, hard_permutation(x, descending), atol=1e-3, rtol=0)
    torch.testing.assert_close(
        p @ x.unsqueeze(-1),
        x.sort(-1, descending=descending).values.unsqueeze(-1),
        atol=1e-2,
        rtol=0,
    )


@pytest.mark.parametrize("method", bl.METHODS)
def test_memberships_tend_to_the_hard_top_k(method):
    tau, options = SHARP[method]
    x = spaced(3, 8, seed=8)
    m = bl.topk_memberships(x, 5, method, tau, **options)
    torch.testing.assert_close(m, hard_memberships(x, 5), atol=1e-3, rtol=0)


# --- memberships -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", bl.METHODS)
@pytest.mark.parametrize("tau", [0.3, 2.0])
def test_memberships_sum_to_k(method, tau):
    """Every method's rows sum to k: row-stochastic P, or (SOFT) the anchor marginal k/n."""
    x = torch.randn(2, 3, 9, dtype=F64, generator=torch.Generator().manual_seed(9))
    m = bl.topk_memberships(x, 4, method, tau)
    assert m.shape == (2, 3, 4, 9)
    ks = torch.arange(1.0, 5.0, dtype=F64).expand(2, 3, 4)
    torch.testing.assert_close(m.sum(-1), ks)
    assert bool((m >= 0).all())


@pytest.mark.parametrize(
    "method", ["sinkhorn", "soft_topk_ot", "odd_even_network", "bitonic_network"]
)
def test_memberships_are_at_most_one_for_column_stochastic_methods(method):
    x = torch.randn(4, 9, dtype=F64, generator=torch.Generator().manual_seed(10))
    m = bl.topk_memberships(x, 8, method, 0.5, **({"n_iter": 3000} if "s" in method[:2] else {}))
    assert float(m.max()) <= 1 + 1e-9
    assert bool((m[..., 1:, :] >= m[..., :-1, :] - 1e-9).all())  # the top k grows with k


@pytest.mark.parametrize("method", bl.METHODS)
def test_batches_equal_rows_alone(method):
    x = torch.randn(2, 3, 6, dtype=F64, generator=torch.Generator().manual_seed(11))
    m = bl.topk_memberships(x, 3, method, 0.7)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(m[i, j], bl.topk_memberships(x[i, j], 3, method, 0.7))


@pytest.mark.parametrize("method", PERM)
def test_top_rows_alone_equal_the_full_matrix(method):
    x = torch.randn(2, 7, dtype=F64, generator=torch.Generator().manual_seed(12))
    full = bl.relaxed_permutation(x, method, 0.6, descending=True)
    top = bl.relaxed_permutation(x, method, 0.6, descending=True, rows=3)
    torch.testing.assert_close(top, full[..., :3, :])


def test_float32_runs_in_float32():
    x = torch.randn(3, 10)
    for method in bl.METHODS:
        m = bl.topk_memberships(x, 2, method, 0.5)
        assert m.dtype == torch.float32 and bool(torch.isfinite(m).all())


# --- gradients -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", bl.METHODS)
def test_gradcheck_memberships(method):
    x = torch.randn(2, 5, dtype=F64, generator=torch.Generator().manual_seed(13))
    x.requires_grad_(True)
    tau = torch.tensor(0.8, dtype=F64, requires_grad=True)
    options = {"n_iter": 20} if method in ("sinkhorn", "soft_topk_ot") else {}
    assert torch.autograd.gradcheck(
        lambda x, tau: bl.topk_memberships(x, 3, method, tau, **options), (x, tau)
    )


@pytest.mark.parametrize("method", PERM)
def test_gradcheck_permutation(method):
    x = torch.randn(2, 5, dtype=F64, generator=torch.Generator().manual_seed(14))
    x.requires_grad_(True)
    options = {"n_iter": 20} if method == "sinkhorn" else {}
    assert torch.autograd.gradcheck(
        lambda x: bl.relaxed_permutation(x, method, 0.6, **options), (x,)
    )


@pytest.mark.parametrize("method", bl.METHODS)
@pytest.mark.parametrize("split_top1", [False, True])
def test_gradcheck_topk_cross_entropy(method, split_top1):
    logits = torch.randn(3, 6, dtype=F64, generator=torch.Generator().manual_seed(15))
    logits.requires_grad_(True)
    labels = torch.tensor([0, 3, 5])
    options = {"n_iter": 20} if method in ("sinkhorn", "soft_topk_ot") else {}
    assert torch.autograd.gradcheck(
        lambda z: bl.topk_cross_entropy(
            z,
            labels,
            [0.2, 0.3, 0.5],
            method=method,
            temperature=0.7,
            split_top1=split_top1,
            **options,
        ),
        (logits,),
    )


@pytest.mark.parametrize("method", PERM)
def test_gradcheck_permutation_cross_entropy(method):
    x = torch.randn(2, 5, dtype=F64, generator=torch.Generator().manual_seed(16))
    x.requires_grad_(True)
    ranks = torch.stack([torch.randperm(5) for _ in range(2)]) + 1
    options = {"n_iter": 20} if method == "sinkhorn" else {}
    assert torch.autograd.gradcheck(
        lambda x: bl.permutation_cross_entropy(x, ranks, method=method, temperature=0.6, **options),
        (x,),
    )


# --- losses ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", bl.METHODS)
def test_topk_cross_entropy_is_eq_2_and_eq_4(method):
    logits = torch.randn(4, 7, dtype=F64, generator=torch.Generator().manual_seed(17))
    labels = torch.tensor([0, 6, 2, 2])
    p_k = torch.tensor([0.1, 0.0, 0.5, 0.4], dtype=F64)
    m = bl.topk_memberships(logits, 4, method, 0.9)[torch.arange(4), :, labels]  # (4, K)
    eq2 = -torch.log((p_k * m).sum(-1))
    got = bl.topk_cross_entropy(
        logits, labels, p_k, method=method, temperature=0.9, reduction="none"
    )
    torch.testing.assert_close(got, eq2)
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    eq4 = 0.1 * ce - 0.9 * torch.log((p_k[1:] * m[:, 1:]).sum(-1))
    got4 = bl.topk_cross_entropy(
        logits, labels, p_k, method=method, temperature=0.9, reduction="none", split_top1=True
    )
    torch.testing.assert_close(got4, eq4)
    mean = bl.topk_cross_entropy(logits, labels, p_k, method=method, temperature=0.9)
    total = bl.topk_cross_entropy(
        logits, labels, p_k, method=method, temperature=0.9, reduction="sum"
    )
    torch.testing.assert_close(mean, eq2.mean())
    torch.testing.assert_close(total, eq2.sum())


def test_split_with_only_top1_is_the_softmax_loss():
    logits = torch.randn(3, 5, dtype=F64, requires_grad=True)
    labels = torch.tensor([1, 2, 4])
    loss = bl.topk_cross_entropy(logits, labels, [1.0], method="neuralsort", split_top1=True)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, labels))
    loss.backward()
    assert bool(torch.isfinite(logits.grad).all())


@pytest.mark.parametrize("method", bl.METHODS)
def test_topk_cross_entropy_hard_limit(method):
    tau, options = SHARP[method]
    logits = spaced(3, 8, seed=18)
    ranks = torch.argsort(torch.argsort(logits, -1, descending=True), -1)
    in_top3 = torch.nonzero(ranks[0] == 2).item()  # rank 3: in the top 3, not the top 2
    labels = torch.tensor([in_top3, int(ranks[1].argmin()), int(ranks[2].argmin())])
    loss = bl.topk_cross_entropy(
        logits, labels, [0.0, 0.0, 1.0], method=method, temperature=tau, reduction="none", **options
    )
    torch.testing.assert_close(loss, torch.zeros(3, dtype=F64), atol=2e-3, rtol=0)
    loss = bl.topk_cross_entropy(
        logits, labels, [0.5, 0.5, 0.0], method=method, temperature=tau, reduction="none", **options
    )
    assert float(loss[0]) > 3  # not in the top 2: the loss grows without bound as tau -> 0
    torch.testing.assert_close(loss[1:], torch.zeros(2, dtype=F64), atol=2e-3, rtol=0)


@pytest.mark.parametrize("method", PERM)
def test_permutation_cross_entropy_picks_the_true_entries(method):
    x = torch.randn(3, 6, dtype=F64, generator=torch.Generator().manual_seed(19))
    ranks = torch.stack([torch.randperm(6) for _ in range(3)]) + 1
    for descending in (False, True):
        p = bl.relaxed_permutation(x, method, 0.8, descending=descending)
        expected = -torch.log(p.gather(-2, (ranks - 1).unsqueeze(-2))).sum((-1, -2))
        got = bl.permutation_cross_entropy(
            x, ranks, method=method, temperature=0.8, reduction="none", descending=descending
        )
        torch.testing.assert_close(got, expected)


# --- arguments -----------------------------------------------------------------------------


def test_bad_arguments_are_named():
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="method"):
        bl.topk_memberships(x, 2, "quicksort")
    with pytest.raises(ValueError, match="method"):
        bl.relaxed_permutation(x, "soft_topk_ot")
    with pytest.raises(ValueError, match="temperature"):
        bl.topk_memberships(x, 2, "softsort", -1.0)
    with pytest.raises(ValueError, match="temperature"):
        bl.neuralsort(x, math.inf)
    with pytest.raises(ValueError, match="K"):
        bl.topk_memberships(x, 5, "softsort")
    with pytest.raises(TypeError, match="floating"):
        bl.softsort(torch.arange(5))
    with pytest.raises(ValueError, match="rows"):
        bl.neuralsort(x, rows=6)
    with pytest.raises(ValueError, match="network"):
        bl.sorting_network(x, network="bubble")
    with pytest.raises(ValueError, match="k must"):
        bl.soft_topk_ot(x, 5)
    with pytest.raises(ValueError, match="n_iter"):
        bl.sinkhorn_sort(x, n_iter=0)
    labels = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="p_k"):
        bl.topk_cross_entropy(x, labels, [0.5, 0.4], method="softsort")
    with pytest.raises(ValueError, match="p_k"):
        bl.topk_cross_entropy(x, labels, [0.2] * 5, method="softsort")
    with pytest.raises(ValueError, match="labels"):
        bl.topk_cross_entropy(x, torch.tensor([0, 5]), [1.0], method="softsort")
    with pytest.raises(TypeError, match="labels"):
        bl.topk_cross_entropy(x, torch.tensor([0.0, 1.0]), [1.0], method="softsort")
    with pytest.raises(ValueError, match="reduction"):
        bl.topk_cross_entropy(x, labels, [1.0], method="softsort", reduction="avg")
    with pytest.raises(ValueError, match="target_ranks"):
        bl.permutation_cross_entropy(x, torch.zeros(2, 5, dtype=torch.long), method="softsort")


def test_inputs_are_not_modified():
    x = torch.randn(2, 6)
    before = x.clone()
    for method in bl.METHODS:
        bl.topk_memberships(x, 3, method, 0.5)
    torch.testing.assert_close(x, before, rtol=0, atol=0)


# --- LapSum through the same entry point ---------------------------------------------------


def test_lapsum_through_the_entry_point():
    sot = pytest.importorskip("softorder.bridges.torch")
    x = torch.randn(3, 8, dtype=F64, generator=torch.Generator().manual_seed(20))
    m = bl.topk_memberships(x, 3, "lapsum", 0.5)
    for k in range(1, 4):
        torch.testing.assert_close(m[..., k - 1, :], sot.soft_topk(x, float(k), 0.5))
    labels = torch.tensor([0, 4, 7])
    torch.testing.assert_close(
        bl.topk_cross_entropy(x, labels, [0.5, 0.0, 0.5], method="lapsum", temperature=0.5),
        sot.topk_cross_entropy(x, labels, [0.5, 0.0, 0.5], 0.5),
    )
