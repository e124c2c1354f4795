"""The baseline methods against their papers' defining properties and independent references."""

import math
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from softorder import baselines as bl

torch.set_default_dtype(torch.float32)
F64 = torch.float64
PERM = bl.PERMUTATION_METHODS
OT = ("sinkhorn", "soft_topk_ot", "sorted_soft_topk_ot")  # iterated to a tolerance
# Temperatures at which each method is within 1e-3 of the hard result on inputs one unit apart,
# and the options it needs to get there (Sinkhorn converges slowly at small temperatures; SOFT's
# epsilon is on the cost normalised by its maximum, 49 for 0..7).
SHARP = {
    "neuralsort": (0.02, {}),
    "softsort": (0.02, {}),
    "sinkhorn": (0.1, {"n_iter": 5000, "tol": 1e-4}),
    "soft_topk_ot": (0.002, {"tol": 1e-6}),
    "sorted_soft_topk_ot": (5e-4, {"tol": 1e-6}),
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


def naive_ot_plan(x, anchors, mu, nu, eps, iters=20000, normalise=False):
    """Linear-domain Sinkhorn with the full squared cost (no reduction)."""
    cost = (x[:, None] - anchors[None, :]) ** 2
    if normalise:
        cost = cost / cost.max()
    kernel = torch.exp(-cost / eps)
    q = torch.ones_like(nu)
    for _ in range(iters):
        p = mu / (kernel @ q)
        q = nu / (kernel.T @ p)
    return p[:, None] * kernel * q[None, :]


def naive_log_ot_plan(cost, mu, nu, eps, iters):
    """Log-domain Sinkhorn on the dual potentials f, g (Peyre & Cuturi, remark 4.23)."""
    f = torch.zeros_like(mu)
    g = torch.zeros_like(nu)
    for _ in range(iters):
        f = eps * torch.log(mu) - eps * torch.logsumexp((g[None, :] - cost) / eps, dim=1)
        g = eps * torch.log(nu) - eps * torch.logsumexp((f[:, None] - cost) / eps, dim=0)
    return torch.exp((f[:, None] + g[None, :] - cost) / eps)


def lp_plan(cost, mu, nu):
    """The unregularised optimal plan (epsilon -> 0), by linear programming."""
    n, m = cost.shape
    rows = np.kron(np.eye(n), np.ones(m))
    cols = np.kron(np.ones(n), np.eye(m))
    result = linprog(
        cost.numpy().ravel(),
        A_eq=np.vstack((rows, cols)),
        b_eq=np.concatenate((mu.numpy(), nu.numpy())),
        bounds=(0, None),
        method="highs",
    )
    assert result.status == 0
    return torch.tensor(result.x.reshape(n, m))


def soft_cost(x):
    """SOFT's normalised cost for the anchors {0, 1}."""
    cost = (x[:, None] - torch.tensor([0.0, 1.0], dtype=x.dtype)) ** 2
    return cost / cost.max()


def logistic_topk(x, k, scale):
    """sigmoid((2 x - t) / scale) summing to k (bisection in t): SOFT top-k's closed form."""
    lo, hi = float(2 * x.min()) - 60 * scale, float(2 * x.max()) + 60 * scale
    for _ in range(200):
        t = (lo + hi) / 2
        if float(torch.sigmoid((2 * x - t) / scale).sum()) > k:
            lo = t
        else:
            hi = t
    return torch.sigmoid((2 * x - t) / scale)


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
    torch.testing.assert_close(bl.sinkhorn_sort(x, eps, tol=1e-13), n * plan.T)


def test_soft_topk_ot_is_the_normalised_two_anchor_plan_and_logistic():
    n, k, eps = 7, 3, 0.3
    x = torch.randn(n, dtype=F64, generator=torch.Generator().manual_seed(4))
    a = bl.soft_topk_ot(x, k, eps, tol=1e-13)
    mu = torch.full((n,), 1 / n, dtype=F64)
    nu = torch.tensor([(n - k) / n, k / n], dtype=F64)
    anchors = torch.tensor([0.0, 1.0], dtype=F64)
    plan = naive_ot_plan(x, anchors, mu, nu, eps, normalise=True)
    torch.testing.assert_close(a, n * plan[:, 1])
    biggest = float(((x[:, None] - anchors) ** 2).max())  # the authors' C / max C
    torch.testing.assert_close(a, logistic_topk(x, k, biggest * eps))
    biggest = float(((-x[:, None] - anchors) ** 2).max())
    torch.testing.assert_close(
        bl.soft_topk_ot(x, k, eps, largest=False, tol=1e-13), logistic_topk(-x, k, biggest * eps)
    )


def test_converged_plans_match_a_long_log_domain_sinkhorn():
    """Small epsilon, where the linear-domain kernel underflows: an independent dual loop."""
    x = torch.randn(6, dtype=F64, generator=torch.Generator().manual_seed(21))
    mu = torch.full((6,), 1 / 6, dtype=F64)
    nu = torch.tensor([4 / 6, 2 / 6], dtype=F64)
    plan = naive_log_ot_plan(soft_cost(x), mu, nu, 0.01, 20000)
    torch.testing.assert_close(bl.soft_topk_ot(x, 2, 0.01, n_iter=20000, tol=1e-12), 6 * plan[:, 1])
    anchors = torch.arange(6, dtype=F64)
    plan = naive_log_ot_plan((3 * x[:, None] - anchors) ** 2, mu, mu, 1.0, 10000)
    torch.testing.assert_close(bl.sinkhorn_sort(3 * x, 1.0, tol=1e-12), 6 * plan.T)


@pytest.mark.parametrize("k", [2, 2.5])
def test_soft_topk_ot_tends_to_the_linear_programme(k):
    """epsilon -> 0: the unregularised optimal plan (scipy's linprog), fractional k included."""
    x = torch.tensor([0.3, 2.0, -1.0, 1.1, 0.9, -0.4], dtype=F64)
    mu = torch.full((6,), 1 / 6, dtype=F64)
    nu = torch.tensor([(6 - k) / 6, k / 6], dtype=F64)
    exact = 6 * lp_plan(soft_cost(x), mu, nu)[:, 1]
    a = bl.soft_topk_ot(x, k, 2e-3, n_iter=20000, tol=1e-10)
    torch.testing.assert_close(a, exact, atol=1e-6, rtol=0)


def test_sinkhorn_sort_tends_to_the_linear_programme():
    x = torch.tensor([0.3, 4.0, -1.0, 2.2, 1.1], dtype=F64)
    anchors = torch.arange(5, dtype=F64)
    mu = torch.full((5,), 1 / 5, dtype=F64)
    exact = 5 * lp_plan((x[:, None] - anchors) ** 2, mu, mu).T
    torch.testing.assert_close(exact, hard_permutation(x, False))
    p = bl.sinkhorn_sort(x, 0.05, n_iter=20000, tol=1e-10)
    torch.testing.assert_close(p, exact, atol=1e-6, rtol=0)


# --- convergence ---------------------------------------------------------------------------


def sorted_soft_reference(x, k, eps, plan_of):
    """Sorted SOFT top-k from the definition (appendix B): anchors 0..k, masses 1/n and
    (n - k)/n, cost normalised by its maximum; ``plan_of(cost, mu, nu)`` solves the transport."""
    n = len(x)
    cost = (x[:, None] - torch.arange(k + 1, dtype=x.dtype)) ** 2
    cost = cost / cost.max()
    mu = torch.full((n,), 1 / n, dtype=x.dtype)
    nu = torch.tensor([1 / n] * k + [(n - k) / n], dtype=x.dtype)
    return n * plan_of(cost, mu, nu).T


@pytest.mark.parametrize("largest", [True, False])
def test_sorted_soft_topk_is_the_k_plus_one_anchor_plan(largest):
    x = torch.randn(7, dtype=F64, generator=torch.Generator().manual_seed(40))
    z = -x if largest else x
    for k, eps in ((1, 0.2), (3, 0.05), (6, 0.1)):
        plan = sorted_soft_reference(
            z, k, eps, lambda c, m, v, eps=eps: naive_log_ot_plan(c, m, v, eps, 20000)
        )
        a = bl.sorted_soft_topk_ot(x, k, eps, largest=largest, tol=1e-12)
        torch.testing.assert_close(a, plan[:k])
        log_a = bl.log_sorted_soft_topk_ot(x, k, eps, largest=largest, tol=1e-12)
        torch.testing.assert_close(log_a.exp(), a)
        torch.testing.assert_close(a.sum(-1), torch.ones(k, dtype=F64))  # rows exact


@pytest.mark.parametrize("k", [1, 2, 4])
def test_sorted_soft_topk_tends_to_the_linear_programme(k):
    """epsilon -> 0: scipy's optimal plan, which ranks the top k (largest first)."""
    x = torch.tensor([0.3, 2.0, -1.0, 1.1, 0.9, -0.4], dtype=F64)
    exact = sorted_soft_reference(-x, k, 0.0, lambda c, m, v: lp_plan(c, m, v))[:k]
    torch.testing.assert_close(exact, hard_permutation(x, True)[:k])
    a = bl.sorted_soft_topk_ot(x, k, 1e-4, tol=1e-10)  # gaps of 0.2 on a cost scale of 25
    torch.testing.assert_close(a, exact, atol=1e-6, rtol=0)


def test_sorted_soft_topk_in_the_entry_point():
    """Memberships are cumulative sums of its rank rows; the full matrix takes k = n - 1."""
    x = torch.randn(2, 6, dtype=F64, generator=torch.Generator().manual_seed(41))
    rows = bl.sorted_soft_topk_ot(x, 3, 0.1, tol=1e-12)
    m = bl.topk_memberships(x, 3, "sorted_soft_topk_ot", 0.1, tol=1e-12)
    torch.testing.assert_close(m, rows.cumsum(-2))
    p = bl.relaxed_permutation(x, "sorted_soft_topk_ot", 0.1, descending=True, tol=1e-12)
    torch.testing.assert_close(p[..., :5, :], bl.sorted_soft_topk_ot(x, 5, 0.1, tol=1e-12))
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 6, dtype=F64))
    torch.testing.assert_close(p.sum(-2), torch.ones(2, 6, dtype=F64))
    ascending = bl.relaxed_permutation(x, "sorted_soft_topk_ot", 0.1, tol=1e-12)
    torch.testing.assert_close(
        ascending,
        bl.relaxed_permutation(-x, "sorted_soft_topk_ot", 0.1, descending=True, tol=1e-12),
    )


def test_gradcheck_sorted_soft_topk():
    x = torch.randn(2, 6, dtype=F64, generator=torch.Generator().manual_seed(42))
    x.requires_grad_(True)
    eps = torch.tensor(0.3, dtype=F64, requires_grad=True)
    for grad in ("implicit", "unrolled"):
        assert torch.autograd.gradcheck(
            lambda x, eps, grad=grad: bl.log_sorted_soft_topk_ot(
                x, 3, eps, tol=1e-12, n_iter=20000, grad=grad
            ),
            (x, eps),
        )


def test_iterations_stop_at_the_tolerance():
    x = torch.randn(3, 8, dtype=F64, generator=torch.Generator().manual_seed(22))
    for tol in (1e-3, 1e-9):
        p = bl.sinkhorn_sort(x, 0.5, tol=tol)
        assert float((p.sum(-2) - 1).abs().max()) <= tol
        torch.testing.assert_close(p.sum(-1), torch.ones(3, 8, dtype=F64), atol=1e-12, rtol=0)
        a = bl.soft_topk_ot(x, 3, 0.1, tol=tol)
        torch.testing.assert_close(a.sum(-1), torch.full((3,), 3.0, dtype=F64))
        assert float(a.max()) <= 1 + tol
    log_k = bl.sinkhorn.soft_topk_log_kernel(x, 0.1)
    mu = torch.full((3, 8), -math.log(8), dtype=F64)
    nu = torch.log(torch.tensor([5 / 8, 3 / 8], dtype=F64)).expand(3, 2)
    loose = bl.sinkhorn.sinkhorn_potentials(log_k, mu, nu, 10000, 1e-3)[2]
    tight = bl.sinkhorn.sinkhorn_potentials(log_k, mu, nu, 10000, 1e-9)[2]
    assert 1 <= loose < tight < 10000


def test_reaching_the_cap_warns():
    x = torch.arange(6, dtype=F64)
    with pytest.warns(RuntimeWarning, match="sinkhorn_sort: Sinkhorn not converged"):
        bl.sinkhorn_sort(x, 0.05, n_iter=10)
    with pytest.warns(RuntimeWarning, match="soft_topk_ot: Sinkhorn not converged"):
        bl.soft_topk_ot(x, 2, 1e-3, n_iter=10)


@pytest.mark.parametrize("method", OT)
def test_rows_stop_on_their_own(method):
    """Each row meets tol on its own, so batching moves a result by less than tol."""
    x = torch.randn(4, 7, dtype=F64, generator=torch.Generator().manual_seed(23))
    x[0] *= 8  # a sharper row that needs many more iterations
    m = bl.topk_memberships(x, 3, method, 0.3, tol=1e-8)
    for i in range(4):
        alone = bl.topk_memberships(x[i], 3, method, 0.3, tol=1e-8)
        torch.testing.assert_close(m[i], alone, rtol=0, atol=1e-7)


@pytest.mark.parametrize("method", OT)
def test_newton_steps_reach_sinkhorns_fixed_point(method):
    """The implicit path (Sinkhorn, then Newton steps) and plain Sinkhorn agree at tol."""
    x = torch.randn(3, 6, dtype=F64, generator=torch.Generator().manual_seed(24))
    fast = bl.topk_memberships(x, 3, method, 0.2, tol=1e-11)
    slow = bl.topk_memberships(x, 3, method, 0.2, tol=1e-11, n_iter=100000, grad="unrolled")
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-9)


def test_epsilon_scaling_reaches_the_cold_start_fixed_point():
    """Annealed rungs change only the path: the same plan as Sinkhorn + Newton from a cold start."""
    x = torch.randn(3, 12, dtype=F64, generator=torch.Generator().manual_seed(30))
    x[1] = x[0]  # ties between rows do not matter; within a row:
    x[2, 3] = x[2, 7]
    sk = bl.sinkhorn
    problem = sk._sort_problem(x, 0.01)
    u, v, cold, error = sk.sinkhorn_potentials(*problem, 200000, 1e-10, newton=True)
    assert error <= 1e-10
    ua, va, annealed, error = sk.annealed_potentials(*problem, 1000, 1e-10)
    assert error <= 1e-10
    plan = (u.unsqueeze(-1) + problem[0] + v.unsqueeze(-2)).exp()
    plan_annealed = (ua.unsqueeze(-1) + problem[0] + va.unsqueeze(-2)).exp()
    torch.testing.assert_close(plan_annealed, plan, rtol=0, atol=1e-10)
    assert annealed < cold / 2  # and much sooner (67 against 265 iterations when written)


def test_epsilon_scaling_converges_where_a_cold_start_crawls():
    """Near-hard sort plans (the kNN example's regime): the default path reaches tol quickly."""
    x = torch.randn(4, 32, dtype=F64, generator=torch.Generator().manual_seed(31))
    sk = bl.sinkhorn
    cold, _ = sk.iterations_to_converge(x, 0.01, n_iter=300, anneal=False)
    annealed, error = sk.iterations_to_converge(x, 0.01, n_iter=300)
    assert cold == 300 and annealed < 200 and error <= bl.sinkhorn.DEFAULT_TOL
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converged within the default cap
        p = bl.sinkhorn_sort(x, 0.003)
    assert float((p.sum(-2) - 1).abs().max()) <= bl.sinkhorn.DEFAULT_TOL


def test_epsilon_scaling_matches_the_linear_programme_in_the_limit():
    x = torch.tensor([0.3, 4.0, -1.0, 2.2, 1.1, 1.15, -0.95], dtype=F64)
    mu = torch.full((7,), 1 / 7, dtype=F64)
    anchors = torch.arange(7, dtype=F64)
    exact = 7 * lp_plan((x[:, None] - anchors) ** 2, mu, mu).T
    torch.testing.assert_close(bl.sinkhorn_sort(x, 1e-3, tol=1e-10), exact, atol=1e-6, rtol=0)


def test_epsilon_scaling_counts_its_rungs_against_the_cap():
    x = torch.randn(2, 16, dtype=F64, generator=torch.Generator().manual_seed(32))
    problem = bl.sinkhorn._sort_problem(x, 0.003)
    _, _, done, error = bl.sinkhorn.annealed_potentials(*problem, 15, 1e-5)
    assert done <= 15 and error > 1e-5
    with pytest.warns(RuntimeWarning, match="not converged after n_iter=15"):
        bl.sinkhorn_sort(x, 0.003, n_iter=15)


@pytest.mark.parametrize("method", OT)
def test_implicit_gradient_is_the_limit_of_the_unrolled_one(method):
    """Appendix H of the SOFT paper: the unrolled gradient tends to the implicit one."""
    x = torch.randn(2, 6, dtype=F64, generator=torch.Generator().manual_seed(25))
    w = torch.randn(2, 3, 6, dtype=F64, generator=torch.Generator().manual_seed(26))
    grads = []
    for grad in ("implicit", "unrolled"):
        z = x.clone().requires_grad_(True)
        m = bl.topk_memberships(z, 3, method, 0.5, tol=1e-12, n_iter=20000, grad=grad)
        (g,) = torch.autograd.grad((m * w).sum(), z)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-8)


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


@pytest.mark.parametrize(
    "method", ["odd_even_network", "bitonic_network", "sinkhorn", "sorted_soft_topk_ot"]
)
@pytest.mark.parametrize("tau", [0.3, 3.0])
def test_columns_are_stochastic_where_the_paper_says(method, tau):
    x = torch.randn(2, 6, dtype=F64, generator=torch.Generator().manual_seed(6))
    options = {"tol": 1e-10} if method in OT else {}
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


@pytest.mark.parametrize("method", [*OT, "odd_even_network", "bitonic_network"])
def test_memberships_are_at_most_one_for_column_stochastic_methods(method):
    x = torch.randn(4, 9, dtype=F64, generator=torch.Generator().manual_seed(10))
    m = bl.topk_memberships(x, 8, method, 0.5, **({"tol": 1e-10} if method in OT else {}))
    assert float(m.max()) <= 1 + 1e-9
    assert bool((m[..., 1:, :] >= m[..., :-1, :] - 1e-9).all())  # the top k grows with k


@pytest.mark.parametrize("method", bl.METHODS)
def test_batches_equal_rows_alone(method):
    x = torch.randn(2, 3, 6, dtype=F64, generator=torch.Generator().manual_seed(11))
    m = bl.topk_memberships(x, 3, method, 0.7)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(m[i, j], bl.topk_memberships(x[i, j], 3, method, 0.7))


@pytest.mark.parametrize("method", [m for m in PERM if m != "sorted_soft_topk_ot"])
def test_top_rows_alone_equal_the_full_matrix(method):
    """Not sorted SOFT top-k: its first rows solve their own transport problem (test below)."""
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
    options = {"tol": 1e-12} if method in OT else {}
    assert torch.autograd.gradcheck(
        lambda x, tau: bl.topk_memberships(x, 3, method, tau, **options), (x, tau)
    )


@pytest.mark.parametrize("method", PERM)
def test_gradcheck_permutation(method):
    x = torch.randn(2, 5, dtype=F64, generator=torch.Generator().manual_seed(14))
    x.requires_grad_(True)
    options = {"tol": 1e-12} if method in OT else {}
    assert torch.autograd.gradcheck(
        lambda x: bl.relaxed_permutation(x, method, 0.6, **options), (x,)
    )


@pytest.mark.parametrize("method", bl.METHODS)
@pytest.mark.parametrize("split_top1", [False, True])
def test_gradcheck_topk_cross_entropy(method, split_top1):
    logits = torch.randn(3, 6, dtype=F64, generator=torch.Generator().manual_seed(15))
    logits.requires_grad_(True)
    labels = torch.tensor([0, 3, 5])
    options = {"tol": 1e-12} if method in OT else {}
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
    options = {"tol": 1e-12} if method == "sinkhorn" else {}
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
    with pytest.raises(ValueError, match="tol"):
        bl.soft_topk_ot(x, 2, tol=-1.0)
    with pytest.raises(ValueError, match="grad"):
        bl.sinkhorn_sort(x, grad="autograd")
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


def test_sorted_soft_topk_bad_arguments_are_named():
    x = torch.randn(2, 5, dtype=F64)
    for fn in (bl.sorted_soft_topk_ot, bl.log_sorted_soft_topk_ot):
        for k in (0, 5, 2.0, True):
            with pytest.raises(ValueError, match="k must"):
                fn(x, k)
        with pytest.raises(TypeError, match="floating"):
            fn(torch.arange(5), 2)
        with pytest.raises(ValueError, match="temperature"):
            fn(x, 2, 0.0)
        with pytest.raises(ValueError, match="n_iter"):
            fn(x, 2, n_iter=0)
        with pytest.raises(ValueError, match="tol"):
            fn(x, 2, tol=-1.0)
        with pytest.raises(ValueError, match="grad"):
            fn(x, 2, grad="autograd")


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


# --- the top-m subset trick ------------------------------------------------------------------


def far_below(seed, batch=4, classes=12, m=6, gap=60.0):
    """Logits whose classes outside a top group of m lie ``gap`` below it; labels in the group."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, classes, dtype=F64, generator=g)
    logits[:, m:] -= gap
    order = torch.stack([torch.randperm(classes, generator=g) for _ in range(batch)])
    logits = logits.gather(-1, order)
    group = torch.nonzero(logits > -gap / 2)[:, 1].reshape(batch, m)
    labels = group[torch.arange(batch), torch.arange(batch) % m]
    return logits, labels


@pytest.mark.parametrize("method", ["neuralsort", "softsort", "sinkhorn", "lapsum"])
@pytest.mark.parametrize("split_top1", [False, True])
def test_top_m_equals_the_full_loss(method, split_top1):
    """Classes far below the m-th leave these methods' top-K memberships unchanged."""
    if method == "lapsum":
        pytest.importorskip("softorder.bridges.torch")
    logits, labels = far_below(27)
    options = {"tol": 1e-12} if method == "sinkhorn" else {}
    losses, grads = [], []
    for top_m in (None, 6):
        z = logits.clone().requires_grad_(True)
        loss = bl.topk_cross_entropy(
            z,
            labels,
            [0.2, 0.3, 0.5],
            method=method,
            temperature=0.7,
            reduction="none",
            split_top1=split_top1,
            top_m=top_m,
            **options,
        )
        losses.append(loss)
        grads.append(torch.autograd.grad(loss.sum(), z)[0])
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize(
    "method", ["soft_topk_ot", "sorted_soft_topk_ot", "odd_even_network", "bitonic_network"]
)
def test_top_m_is_a_relaxation_of_the_same_hard_loss(method):
    """SOFT (cost normalised by the subset's maximum) and the networks (a network on m wires)
    relax a subset differently; both tend to the same hard loss as the temperature falls."""
    top = spaced(4, 6, seed=28)  # one unit apart
    rest = spaced(4, 6, seed=29) - 16
    logits = torch.cat((rest[:, :3], top, rest[:, 3:]), dim=-1)
    labels = logits.topk(2, dim=-1).indices[:, 1]  # second largest: hard loss -log(0.8)
    tau, options = {
        "soft_topk_ot": (2e-4, {"tol": 1e-6}),
        "sorted_soft_topk_ot": (1e-4, {"tol": 1e-6}),  # its cost's largest entry is about 256
    }.get(method, (0.01, {}))
    full, sub = (
        bl.topk_cross_entropy(
            logits,
            labels,
            [0.2, 0.3, 0.5],
            method=method,
            temperature=tau,
            reduction="none",
            top_m=top_m,
            **options,
        )
        for top_m in (None, 6)
    )
    hard = torch.full((4,), -math.log(0.8), dtype=F64)
    torch.testing.assert_close(full, hard, rtol=0, atol=1e-3)
    torch.testing.assert_close(sub, hard, rtol=0, atol=1e-3)


@pytest.mark.parametrize("method", bl.METHODS)
def test_top_m_keeps_the_true_class(method):
    """A true class below the m largest replaces the m-th: the loss of that subset."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, -1.0, -2.0]], dtype=F64)
    labels = torch.tensor([6])
    got = bl.topk_cross_entropy(logits, labels, [0.5, 0.5], method=method, temperature=0.5, top_m=4)
    subset = logits[:, [0, 1, 2, 6]]
    expected = bl.topk_cross_entropy(
        subset, torch.tensor([3]), [0.5, 0.5], method=method, temperature=0.5
    )
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="top_m"):
        bl.topk_cross_entropy(logits, labels, [0.5, 0.5], method=method, top_m=2)
    with pytest.raises(ValueError, match="top_m"):
        bl.topk_cross_entropy(logits, labels, [0.5, 0.5], method=method, top_m=8)


@pytest.mark.parametrize("method", ["lapsum", "softsort"])
def test_top_m_through_the_torch_loss_module(method):
    sot = pytest.importorskip("softorder.bridges.torch")
    logits, labels = far_below(30)
    loss_fn = sot.TopKCrossEntropyLoss([0.5, 0.5], 0.7, method=method, temperature=0.7, top_m=6)
    expected = bl.topk_cross_entropy(
        logits, labels, [0.5, 0.5], method=method, temperature=0.7, top_m=6
    )
    torch.testing.assert_close(loss_fn(logits, labels), expected)
    full = sot.TopKCrossEntropyLoss([0.5, 0.5], 0.7, method=method, temperature=0.7)
    torch.testing.assert_close(loss_fn(logits, labels), full(logits, labels))


def test_sorted_soft_topk_through_the_torch_loss_module():
    sot = pytest.importorskip("softorder.bridges.torch")
    logits, labels = far_below(33)
    loss_fn = sot.TopKCrossEntropyLoss(
        [0.5, 0.5], 0.7, method="sorted_soft_topk_ot", temperature=0.7
    )
    expected = bl.topk_cross_entropy(
        logits, labels, [0.5, 0.5], method="sorted_soft_topk_ot", temperature=0.7
    )
    torch.testing.assert_close(loss_fn(logits, labels), expected)


def test_float32_soft_topk_converges_like_float64():
    """float32 masses (n - k) / n and k / n do not sum to 1: the problem is posed in float64."""
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(31))
    m32 = bl.topk_memberships(logits, 5, "soft_topk_ot", 0.03)  # warns if it stalls
    m64 = bl.topk_memberships(logits.to(F64), 5, "soft_topk_ot", 0.03)
    assert m32.dtype == torch.float32
    torch.testing.assert_close(m32.to(F64), m64, rtol=0, atol=1e-6)


def test_a_per_row_temperature_with_top_m_is_refused_by_its_shape():
    sot = pytest.importorskip("softorder.bridges.torch")
    loss = sot.TopKCrossEntropyLoss([0.5, 0.5], alpha=torch.full((6,), 0.5), top_m=5)
    with pytest.raises(ValueError, match=r"0-d tensor, got shape \(6,\)"):
        loss(torch.randn(6, 10), torch.randint(0, 10, (6,)))
