"""Entropic optimal-transport relaxations: Sinkhorn sort and SOFT top-k.

* Sinkhorn sort (Cuturi, Teboul & Vert, NeurIPS 2019): transport the n scores (mass 1/n each)
  onto n sorted anchors (mass 1/n each) with squared-distance cost and entropy ``epsilon``;
  ``P = n Gamma^T`` is a relaxed permutation matrix (doubly stochastic at convergence).
* SOFT top-k (Xie et al., NeurIPS 2020, sec. 2): transport the n scores onto the two anchors
  {0, 1} with masses ``(n - k) / n`` and ``k / n``, cost ``(x_i - y_j)^2`` divided by its
  largest entry in the row (as the authors' code does, ``C / C.max()``, so ``epsilon`` is on the
  paper's scale); the memberships are ``A = n Gamma[:, 1]`` (the paper's smallest-k form applied
  to the largest, by symmetry).

**Convergence.** Both run log-domain Sinkhorn iterations (Cuturi 2013; Benamou et al. 2015, no
underflow at small ``epsilon``) until the marginal error, ``max_i |n sum_j Gamma_ij - 1|`` (how
far each element's total mass is from 1), is at most ``tol``, with ``n_iter`` as a cap; a call
that reaches the cap warns (``RuntimeWarning``) with the error reached. The last iteration
projects on the anchors' marginal, so every rank row of ``P`` sums to 1 exactly and the SOFT
memberships sum to ``k`` exactly. On the default (implicit) path, problems not converged after
:data:`NEWTON_AFTER` Sinkhorn iterations take damped Newton steps on the dual, and Sinkhorn sort
first solves the same problem at larger temperatures, each warm-starting the next (epsilon
scaling, :func:`annealed_potentials`): near-hard sort plans then converge in tens to about a
hundred iterations instead of thousands. Neither changes the fixed point, only how fast it is
reached.

**Gradients.** By default (``grad="implicit"``) the backward pass differentiates the converged
plan by the implicit function theorem (SOFT paper, appendix H): with ``W`` the cotangent of
``log Gamma``, ``dL/dlog K = W - Gamma (a 1^T + 1 b^T)`` where ``a, b`` make that matrix's row and
column sums zero, which takes one ``m x m`` solve (``m`` anchors: 2 for SOFT, so O(n); ``n``
for Sinkhorn sort, O(n^3)) and no stored iterations. ``grad="unrolled"`` differentiates through
the iterations instead (as Cuturi et al. and the DiffTopK paper do; memory grows with the
iteration count, and the result is the derivative of the truncated iteration).

Sinkhorn sort's anchors are one unit apart (ranks ``0..n-1``) and the scores are used unscaled
(Cuturi et al. squash them into [0, 1] first; we do not, so ``epsilon`` is in the units of ``x``
squared, and on two elements its slope matches the other methods', see the examples). With a
squared cost the squares are absorbed by the dual potentials, so the plan depends on ``x`` only
through ``2 (x_i - mean(x)) y_j / epsilon``: the iterations use that reduced cost. SOFT top-k
uses the full normalised cost, whose plan is a logistic in ``x``:
``A_i = sigmoid((2 x_i - t) / (M epsilon))`` with ``M`` the largest cost entry of the row and
``t`` such that the memberships sum to ``k``.
"""

from __future__ import annotations

import math
import warnings

import torch

from softorder.baselines._common import (
    Temperature,
    check_iterations,
    check_scores,
    check_temperature,
)

#: Default cap on the Sinkhorn iterations.
DEFAULT_N_ITER = 1000
#: Default tolerance on the marginal error ``max_i |n sum_j Gamma_ij - 1|``.
DEFAULT_TOL = 1e-5
GRADIENTS = ("implicit", "unrolled")


def _check_convergence_options(n_iter: int, tol: float, grad: str) -> None:
    check_iterations(n_iter)
    if isinstance(tol, bool) or not isinstance(tol, int | float) or not tol >= 0:
        raise ValueError(f"tol must be a non-negative number, got {tol!r}")
    if grad not in GRADIENTS:
        raise ValueError(f"grad must be one of {GRADIENTS}, got {grad!r}")


#: Sinkhorn iterations before the Newton steps take over (when ``newton`` is on).
NEWTON_AFTER = 20
#: Most Newton steps in a row before Sinkhorn iterations resume.
NEWTON_STEPS = 50
_STEPS = 24  # backtracking step sizes 1, 1/2, ..., 2^-23, all tried at once ...
_TRY_ELEMENTS = 1 << 25  # ... in groups whose plans hold at most this many entries (256 MB)


def _row_projected(log_kernel: torch.Tensor, log_mu: torch.Tensor, v: torch.Tensor):
    """Log plan with exact row sums ``mu`` for column scalings ``v``, and its log column sums."""
    log_plan = log_mu.unsqueeze(-1) + torch.log_softmax(log_kernel + v.unsqueeze(-2), dim=-1)
    return log_plan, torch.logsumexp(log_plan, dim=-2)


def _newton_columns(
    log_kernel: torch.Tensor,
    log_mu: torch.Tensor,
    log_nu: torch.Tensor,
    v: torch.Tensor,
    active: torch.Tensor,
    tol: float,
    steps: int,
) -> tuple[torch.Tensor, int]:
    """Damped Newton steps on the column scalings ``v`` of the rows still ``active``.

    With the rows projected exactly, the column sums ``c(v)`` have Jacobian
    ``diag(c) - Gamma^T diag(1/mu) Gamma`` in ``v`` (the matrix of the implicit backward,
    singular along the gauge ``v + const``, hence the pseudo-inverse). Each step tries the
    sizes 1, 1/2, 1/4, ... at once and keeps, per problem, the one with the smallest column
    error. Sinkhorn's fixed point, reached in a few steps where Sinkhorn needs thousands (near
    hard plans contract by a factor close to 1 per iteration).
    """
    dtype = v.dtype
    lk, lm, ln = log_kernel.double(), log_mu.double(), log_nu.double()
    v = v.double()
    nu = ln.exp()
    sizes = 2.0 ** -torch.arange(_STEPS, dtype=torch.float64, device=v.device)
    sizes = sizes.reshape(_STEPS, *([1] * v.ndim))
    done = 0
    for done in range(1, steps + 1):  # noqa: B007 (the count is reported)
        log_plan, log_c = _row_projected(lk, lm, v)
        error = torch.expm1(log_c - ln).abs().amax(-1)
        active = active & (error > tol)
        if not bool(active.any()):
            done -= 1
            break
        plan = log_plan.exp()
        c = plan.sum(-2)
        jacobian = torch.diag_embed(c) - plan.transpose(-1, -2) @ (plan / plan.sum(-1, True))
        direction = (torch.linalg.pinv(jacobian, hermitian=True) @ (nu - c).unsqueeze(-1))[..., 0]
        # Near-hard plans make the Jacobian nearly singular and the full step huge: no useful
        # step is longer than the kernel's range, so the tries start there.
        reach = (lk.amax((-2, -1)) - lk.amin((-2, -1)) + 1).unsqueeze(-1)
        longest = direction.abs().amax(-1, keepdim=True)
        direction = direction * torch.clamp(reach / longest, max=1.0).nan_to_num(0.0)
        tries = v + sizes * direction  # (steps, ..., m)
        # Each try is a whole plan: large problems try a few sizes at a time, so the memory
        # stays that of a few plans (the same merits, whatever the grouping).
        group = max(1, _TRY_ELEMENTS // max(1, lk.numel()))
        merit = torch.cat(
            [
                torch.expm1(_row_projected(lk, lm, some)[1] - ln).abs().amax(-1)
                for some in tries.split(group)
            ]
        )  # (steps, ...)
        merit = torch.nan_to_num(merit, nan=math.inf)
        best_merit, best = merit.min(0)
        chosen = tries.gather(0, best[None, ..., None].expand(1, *v.shape))[0]
        improved = active & (best_merit < error)
        v = torch.where(improved.unsqueeze(-1), chosen, v)
        # A problem Newton cannot improve by a tenth goes back to Sinkhorn, whose iterations
        # are far cheaper (near-hard sort plans make the Jacobian too singular to help).
        active = active & (best_merit < 0.9 * error)
    return v.to(dtype), done


def sinkhorn_potentials(
    log_kernel: torch.Tensor,
    log_mu: torch.Tensor,
    log_nu: torch.Tensor,
    n_iter: int,
    tol: float,
    newton: bool = False,
    v: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """Log-domain Sinkhorn scalings ``(u, v, iterations, marginal error)``.

    ``log_kernel`` has shape ``(..., n, m)``, ``log_mu`` ``(..., n)``, ``log_nu`` ``(..., m)``;
    ``u + log_kernel + v`` is the log plan, whose column sums are ``nu`` exactly and whose row
    sums are ``mu`` to within a relative ``tol`` (unless ``n_iter`` ran out first). Each
    problem of the batch stops on its own (its scalings are frozen once it meets ``tol``), so
    a row's result does not depend on the rows it is batched with. With ``newton``, problems
    not converged after :data:`NEWTON_AFTER` Sinkhorn iterations take damped Newton steps on
    the column scalings (each counted as an iteration; not differentiable, for the implicit
    backward). ``v`` starts the column scalings (zero by default; a warm start), and only the
    problems where ``active`` is true (all by default) are iterated: the others keep ``v`` and
    do not count in the returned error. Runs under the caller's autograd mode
    (``grad="unrolled"`` records the iterations).
    """
    if v is None:
        v = torch.zeros_like(log_kernel[..., 0, :])
    rows = torch.logsumexp(log_kernel + v.unsqueeze(-2), dim=-1)  # log row sums, scaled by v
    u = log_mu - rows
    if log_kernel.numel() == 0:
        return u, v, 0, 0.0
    if active is None:
        active = torch.ones(log_kernel.shape[:-2], dtype=torch.bool, device=log_kernel.device)
    error = torch.where(active, math.inf, 0.0).to(log_kernel.dtype)
    done = 0
    while done < n_iter:
        done += 1
        u_new = log_mu - rows
        v_new = log_nu - torch.logsumexp(log_kernel + u_new.unsqueeze(-1), dim=-2)
        rows_new = torch.logsumexp(log_kernel + v_new.unsqueeze(-2), dim=-1)
        keep = active.unsqueeze(-1)
        u = torch.where(keep, u_new, u)
        v = torch.where(keep, v_new, v)
        rows = torch.where(keep, rows_new, rows)
        # the row marginal of the current plan over the target one is exp(u + rows - log_mu)
        with torch.no_grad():
            error = torch.where(active, torch.expm1(u + rows - log_mu).abs().amax(-1), error)
            active = active & (error > tol)  # NaN rows stop too (their result is NaN)
        if not bool(active.any()):
            break
        if newton and done % NEWTON_AFTER == 0 and done < n_iter:
            v, steps = _newton_columns(
                log_kernel, log_mu, log_nu, v, active, tol / 4, min(NEWTON_STEPS, n_iter - done - 1)
            )
            done += steps
            rows = torch.logsumexp(log_kernel + v.unsqueeze(-2), dim=-1)
    return u, v, done, float(error.amax())


#: Epsilon scaling: the first rung's kernel range (largest minus smallest ``log K``) ...
ANNEAL_START = 10.0
#: ... the factor between the temperatures of consecutive rungs ...
ANNEAL_FACTOR = 4.0
#: ... and the marginal error at which a rung hands over to the next.
ANNEAL_TOL = 1e-2


def annealed_potentials(
    log_kernel: torch.Tensor,
    log_mu: torch.Tensor,
    log_nu: torch.Tensor,
    n_iter: int,
    tol: float,
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """:func:`sinkhorn_potentials` (with Newton steps) after epsilon scaling.

    At a small temperature the plan is nearly hard and Sinkhorn's iterations contract by a
    factor close to 1, while Newton's steps need a start near the solution. So each problem is
    first solved, to :data:`ANNEAL_TOL`, at the temperatures ``epsilon * ANNEAL_FACTOR ** j``
    for ``j = J, ..., 1`` (``J`` the fewest rungs that bring its kernel's range down to
    :data:`ANNEAL_START`), each rung warm-started from the previous one's column potentials
    (``v`` scales as ``1 / epsilon``), then at ``epsilon`` itself to ``tol`` (Kosowsky & Yuille
    1994; Schmitzer 2019, sec. 3.2; Peyre & Cuturi 2019, remark 4.20). The result is the same
    fixed point as a cold start (only the path to it differs), reached in tens of iterations
    where a cold start takes hundreds or thousands. Every iteration of every rung counts
    against ``n_iter``. ``log_kernel`` must be ``-C / epsilon`` (or reduced so, as Sinkhorn
    sort's), so that ``r log_kernel`` is the kernel at temperature ``epsilon / r``. Each
    problem's rungs depend only on that problem, so batching does not change its path.
    """
    with torch.no_grad():
        span = (log_kernel.amax((-2, -1)) - log_kernel.amin((-2, -1))).nan_to_num(0.0)
        rungs = torch.ceil(torch.log(span / ANNEAL_START) / math.log(ANNEAL_FACTOR))
        rungs = rungs.nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(min=0).to(torch.int64)
    top = int(rungs.max()) if rungs.numel() else 0
    v = torch.zeros_like(log_kernel[..., 0, :])
    total = 0
    for rung in range(top, 0, -1):
        on = rungs >= rung
        budget = n_iter - total - 1  # the target temperature keeps at least one iteration
        if budget < 1:
            break
        scale = ANNEAL_FACTOR**-rung
        _, v, done, _ = sinkhorn_potentials(
            scale * log_kernel, log_mu, log_nu, budget, ANNEAL_TOL, True, v, on
        )
        total += done
        v = v * ANNEAL_FACTOR  # the potentials at the next rung's (4x smaller) temperature
    u, v, done, error = sinkhorn_potentials(
        log_kernel, log_mu, log_nu, max(1, n_iter - total), tol, True, v
    )
    return u, v, total + done, error


def _warn_unconverged(who: str, n_iter: int, error: float, tol: float) -> None:
    warnings.warn(
        f"softorder.baselines.{who}: Sinkhorn not converged after n_iter={n_iter} iterations "
        f"(marginal error {error:.2g} > tol={tol:g}); raise n_iter or the temperature",
        RuntimeWarning,
        stacklevel=4,
    )


class _ImplicitLogPlan(torch.autograd.Function):
    """Log transport plan with the implicit-function-theorem backward (SOFT, appendix H)."""

    @staticmethod
    def forward(ctx, log_kernel, log_mu, log_nu, n_iter, tol, who, anneal):  # noqa: D102
        if anneal:
            u, v, _, error = annealed_potentials(log_kernel, log_mu, log_nu, n_iter, tol)
        else:
            u, v, _, error = sinkhorn_potentials(log_kernel, log_mu, log_nu, n_iter, tol, True)
        if error > tol:
            _warn_unconverged(who, n_iter, error, tol)
        log_plan = u.unsqueeze(-1) + log_kernel + v.unsqueeze(-2)
        ctx.save_for_backward(log_plan)
        return log_plan

    @staticmethod
    def backward(ctx, w):  # noqa: D102
        (log_plan,) = ctx.saved_tensors
        plan = log_plan.exp()
        # The plan's own marginals (not the targets), so the linear system below is consistent
        # even where the iterations stopped at the tolerance.
        mu = plan.sum(-1)
        nu = plan.sum(-2)
        s = w.sum(-1)
        plan_over_mu = plan / mu.unsqueeze(-1)
        # Row sums of W - Gamma (a + b) vanish: a = (s - Gamma b) / mu; column sums then give
        # (diag(nu) - Gamma^T diag(1/mu) Gamma) b = r, singular along b = 1 (the potentials'
        # gauge), hence the pseudo-inverse.
        system = torch.diag_embed(nu) - plan.transpose(-1, -2) @ plan_over_mu
        r = w.sum(-2) - (plan_over_mu * s.unsqueeze(-1)).sum(-2)
        b = (torch.linalg.pinv(system, hermitian=True) @ r.unsqueeze(-1)).squeeze(-1)
        a = (s - (plan @ b.unsqueeze(-1)).squeeze(-1)) / mu
        grad_kernel = w - plan * (a.unsqueeze(-1) + b.unsqueeze(-2))
        grad_log_mu = a * mu if ctx.needs_input_grad[1] else None
        grad_log_nu = b * nu if ctx.needs_input_grad[2] else None
        return grad_kernel, grad_log_mu, grad_log_nu, None, None, None, None


def _log_plan(
    log_kernel: torch.Tensor,
    log_mu: torch.Tensor,
    log_nu: torch.Tensor,
    n_iter: int,
    tol: float,
    grad: str,
    who: str,
    anneal: bool,
) -> torch.Tensor:
    """Log transport plan for ``exp(log_kernel)`` with marginals ``mu`` (rows), ``nu`` (columns).

    ``anneal``: the implicit path starts with epsilon scaling (:func:`annealed_potentials`);
    the unrolled path never does (it is the papers' plain iteration).

    Computed in float64 whatever the input's dtype: the marginal error is measured on
    ``u + logsumexp(...)``, whose rounding error grows with the kernel's magnitude (hundreds
    at small temperatures), so float32 would stall above a tolerance of 1e-5.
    """
    dtype = log_kernel.dtype
    log_kernel, log_mu, log_nu = (t.to(torch.float64) for t in (log_kernel, log_mu, log_nu))
    if grad == "implicit":
        log_plan = _ImplicitLogPlan.apply(log_kernel, log_mu, log_nu, n_iter, tol, who, anneal)
        return log_plan.to(dtype)
    u, v, _, error = sinkhorn_potentials(log_kernel, log_mu, log_nu, n_iter, tol)
    if error > tol:
        _warn_unconverged(who, n_iter, error, tol)
    return (u.unsqueeze(-1) + log_kernel + v.unsqueeze(-2)).to(dtype)


def log_sinkhorn_sort(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    descending: bool = False,
    n_iter: int = DEFAULT_N_ITER,
    tol: float = DEFAULT_TOL,
    grad: str = "implicit",
) -> torch.Tensor:
    """Logarithm of :func:`sinkhorn_sort`, from the log-domain iterations (no underflow).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order).
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0``.
    descending : bool
        Row 0 is the largest score (else the smallest).
    n_iter : int
        Cap on the Sinkhorn iterations.
    tol : float
        Stop when the marginal error (module docstring) is at most ``tol``.
    grad : {"implicit", "unrolled"}
        Backward pass (module docstring).

    Returns
    -------
    torch.Tensor
        ``log P`` of shape ``(..., n, n)``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import log_sinkhorn_sort
    >>> log_sinkhorn_sort(torch.tensor([0.0, 3.0, 1.0]), 0.5).exp().round(decimals=3)
    tensor([[0.8820, 0.0000, 0.1180],
            [0.1180, 0.0170, 0.8650],
            [0.0000, 0.9830, 0.0170]])
    """
    n = check_scores(x)
    check_temperature(temperature)
    _check_convergence_options(n_iter, tol, grad)
    problem = _sort_problem(-x if descending else x, temperature)
    log_plan = _log_plan(*problem, n_iter, tol, grad, "sinkhorn_sort", anneal=True)
    return (log_plan + math.log(n)).transpose(-1, -2)


def _sort_problem(x: torch.Tensor, temperature: Temperature) -> tuple[torch.Tensor, ...]:
    """Sinkhorn sort's ``(log kernel, log mu, log nu)``, with the reduced cost."""
    n = x.shape[-1]
    scores = x - x.mean(-1, keepdim=True)
    anchors = torch.arange(n, dtype=x.dtype, device=x.device) - (n - 1) / 2
    log_kernel = 2 * scores.unsqueeze(-1) * anchors / temperature  # (..., element, rank)
    log_mass = torch.full_like(scores, -math.log(n))
    return log_kernel, log_mass, log_mass


def _soft_problem(
    x: torch.Tensor, k: torch.Tensor, temperature: Temperature
) -> tuple[torch.Tensor, ...]:
    """SOFT top-k's ``(log kernel, log mu, log nu)`` (largest), normalised cost."""
    n = x.shape[-1]
    log_mu = torch.full_like(x, -math.log(n))
    log_nu = torch.stack((torch.log((n - k) / n), torch.log(k / n)), dim=-1)
    return soft_topk_log_kernel(x, temperature), log_mu, log_nu


def iterations_to_converge(
    x: torch.Tensor,
    temperature: float,
    *,
    k: float | None = None,
    tol: float = DEFAULT_TOL,
    n_iter: int = 100_000,
    newton: bool = True,
    anneal: bool = True,
    ranked: bool = False,
) -> tuple[int, float]:
    """Iterations Sinkhorn sort (``k=None``) or SOFT top-k (``k``) takes on ``x`` to reach ``tol``.

    With ``k`` and ``ranked``, sorted SOFT top-k's problem instead (``k`` an int).

    Returns ``(iterations, marginal error reached)``: with ``newton`` and ``anneal`` as the
    default (implicit) path runs (epsilon scaling, Sinkhorn and Newton steps,
    :func:`annealed_potentials`); with ``newton`` alone, Sinkhorn and Newton steps from a cold
    start; without ``newton``, plain Sinkhorn as in the papers (``anneal`` is then ignored).
    For the convergence costs in the docs.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines.sinkhorn import iterations_to_converge
    >>> x = torch.tensor([[0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
    >>> plain, _ = iterations_to_converge(x, 0.05, k=2, newton=False)
    >>> with_newton, _ = iterations_to_converge(x, 0.05, k=2)
    >>> plain > with_newton
    True
    """
    check_scores(x)
    check_temperature(temperature)
    _check_convergence_options(n_iter, tol, "implicit")
    with torch.no_grad():
        if k is None:
            problem = _sort_problem(x, temperature)
        elif ranked:
            _check_sorted_k(k, x.shape[-1])
            problem = _sorted_soft_problem(-x, k, temperature)
        else:
            problem = _soft_problem(x, _k_tensor(k, x), temperature)
        problem = tuple(t.to(torch.float64) for t in problem)
        if newton and anneal:
            _, _, done, error = annealed_potentials(*problem, n_iter, tol)
        else:
            _, _, done, error = sinkhorn_potentials(*problem, n_iter, tol, newton=newton)
    return done, error


def sinkhorn_sort(
    x: torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    descending: bool = False,
    n_iter: int = DEFAULT_N_ITER,
    tol: float = DEFAULT_TOL,
    grad: str = "implicit",
) -> torch.Tensor:
    """Sinkhorn (optimal-transport) sort: relaxed permutation matrix (Cuturi et al., 2019).

    Entropic optimal transport ``min <C, Gamma> + epsilon sum Gamma log Gamma`` between the
    scores (mass 1/n each) and the sorted anchors ``0, 1, ..., n-1`` (mass 1/n each), cost
    ``C_ij = (x_i - y_j)^2``, solved by log-domain Sinkhorn iterations until the marginal error
    is at most ``tol`` (at most ``n_iter`` of them); ``P = n Gamma^T`` (rows: ranks, columns:
    elements). Rows sum to 1 exactly; columns to within ``tol``. As ``epsilon -> 0`` it tends
    to the permutation matrix of the sort. Time ``O(n^2)`` per iteration; the default implicit
    backward costs ``O(n^3)`` and stores only the plan. See the module docstring for the
    scaling and the gradients.

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, to be ordered along the last axis (any order); leading
        axes are batch axes.
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0``; the matrix is as sharp as a logistic of
        scale ``epsilon / 2`` in the units of ``x``. A tensor may require grad.
    descending : bool
        Row 0 is the largest score (else the smallest).
    n_iter : int
        Cap on the Sinkhorn iterations (each a row and a column projection); reaching it
        warns. Small temperatures need more.
    tol : float
        Stop when ``max_j |sum_i P_ij - 1| <= tol`` (relative marginal error).
    grad : {"implicit", "unrolled"}
        Implicit differentiation of the converged plan, or autograd through the iterations.

    Returns
    -------
    torch.Tensor
        ``P`` of shape ``(..., n, n)``.

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        Fewer than 2 elements, a temperature that is not positive, ``n_iter < 1``, a negative
        ``tol`` or an unknown ``grad``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import sinkhorn_sort
    >>> x = torch.tensor([0.0, 3.0, 1.0], dtype=torch.float64)
    >>> (sinkhorn_sort(x, 0.5) @ x).round(decimals=2)
    tensor([0.1200, 0.9200, 2.9700], dtype=torch.float64)
    >>> p = sinkhorn_sort(x, 2.0, tol=1e-9)
    >>> p.sum(-1).round(decimals=6), p.sum(-2).round(decimals=6)  # doubly stochastic
    (tensor([1., 1., 1.], dtype=torch.float64), tensor([1., 1., 1.], dtype=torch.float64))
    """
    return log_sinkhorn_sort(
        x, temperature, descending=descending, n_iter=n_iter, tol=tol, grad=grad
    ).exp()


def soft_topk_log_kernel(x: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """SOFT's ``-C / (max C) / epsilon`` for the anchors {0, 1}: shape ``(..., n, 2)``.

    The cost is normalised per row (the authors' code divides by the batch's largest entry,
    which would make a row's result depend on the other rows) and the normaliser is
    differentiated with the rest (their code detaches it, which is not the derivative of the
    function computed). Sorted SOFT's kernel with one ranked anchor.
    """
    return sorted_soft_topk_log_kernel(x, 1, temperature)


def _log_soft_topk_ot(
    x: torch.Tensor,
    k: torch.Tensor,
    temperature: Temperature,
    n_iter: int,
    tol: float,
    grad: str,
) -> torch.Tensor:
    """Log SOFT memberships (largest) of ``x`` ``(..., n)`` for ``k`` of shape ``(...)``."""
    # In float64 from the start: the masses (n - k) / n and k / n rounded to float32 no longer
    # sum to 1 like the elements' 1 / n, and an unbalanced problem has no converged plan.
    wide = torch.float64
    problem = _soft_problem(x.to(wide), k.to(wide), _widen(temperature, wide))
    # No epsilon scaling: SOFT's two anchors converge in tens of iterations from a cold start
    # at every epsilon of the examples, and the rungs would about double that count.
    log_plan = _log_plan(*problem, n_iter, tol, grad, "soft_topk_ot", anneal=False)
    return (log_plan[..., 1] + math.log(x.shape[-1])).to(x.dtype)


def _widen(temperature: Temperature, dtype: torch.dtype) -> Temperature:
    return temperature.to(dtype) if isinstance(temperature, torch.Tensor) else temperature


def _k_tensor(k: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    k = torch.as_tensor(k, dtype=x.dtype, device=x.device)
    if k.numel() and not bool(((k > 0) & (k < n)).all()):
        raise ValueError(f"k must lie in (0, n) = (0, {n}), got {k}")
    try:
        return torch.broadcast_to(k, x.shape[:-1])
    except RuntimeError:
        raise ValueError(
            f"k of shape {tuple(k.shape)} does not broadcast to the batch shape "
            f"{tuple(x.shape[:-1])}"
        ) from None


def log_soft_topk_ot(
    x: torch.Tensor,
    k: float | torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    largest: bool = True,
    n_iter: int = DEFAULT_N_ITER,
    tol: float = DEFAULT_TOL,
    grad: str = "implicit",
) -> torch.Tensor:
    """Logarithm of :func:`soft_topk_ot`, from the log-domain iterations (no underflow).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, selected along the last axis.
    k : float or torch.Tensor
        Number of elements to select, in ``(0, n)``; a tensor broadcastable to ``x.shape[:-1]``.
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0`` (on the normalised cost).
    largest : bool
        Select the largest (else the smallest) elements.
    n_iter : int
        Cap on the Sinkhorn iterations.
    tol : float
        Stop when the marginal error (module docstring) is at most ``tol``.
    grad : {"implicit", "unrolled"}
        Backward pass (module docstring).

    Returns
    -------
    torch.Tensor
        Log memberships, shape of ``x``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import log_soft_topk_ot
    >>> log_soft_topk_ot(torch.tensor([0.0, 3.0, 1.0]), 1, 0.05).exp().round(decimals=3)
    tensor([0.0000, 0.9880, 0.0120])
    """
    check_scores(x)
    check_temperature(temperature)
    _check_convergence_options(n_iter, tol, grad)
    return _log_soft_topk_ot(x if largest else -x, _k_tensor(k, x), temperature, n_iter, tol, grad)


def soft_topk_ot(
    x: torch.Tensor,
    k: float | torch.Tensor,
    temperature: Temperature = 1.0,
    *,
    largest: bool = True,
    n_iter: int = DEFAULT_N_ITER,
    tol: float = DEFAULT_TOL,
    grad: str = "implicit",
) -> torch.Tensor:
    """SOFT top-k memberships: entropic OT onto two anchors (Xie et al., NeurIPS 2020, sec. 2).

    Transports the scores (mass 1/n each) onto the anchors ``{0, 1}`` with masses
    ``(n - k) / n`` and ``k / n`` and cost ``C_ij = (x_i - y_j)^2 / max C`` (normalised as in the
    authors' code, per row), entropy ``epsilon``; returns ``A = n Gamma[:, 1]``, which sums to
    ``k`` exactly and lies in ``[0, 1]`` to within ``tol``. The paper's form selects the smallest
    k (anchor 0 gets mass ``k / n``); this is the same operator on ``-x``. As ``epsilon -> 0`` it
    tends to the 0/1 indicator of the top k. The iterations cost ``O(n)`` each and the default
    implicit backward (appendix H of the paper) ``O(n)`` once.

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, selected along the last axis; leading axes are batch axes.
    k : float or torch.Tensor
        Number of elements to select, in ``(0, n)`` (need not be an integer); a tensor
        broadcastable to ``x.shape[:-1]`` gives one per row.
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0`` on the normalised cost (the paper's scale):
        memberships are logistic of scale ``M epsilon / 2`` in the units of ``x``, ``M`` the
        row's largest squared distance to an anchor (module docstring). A tensor may require
        grad.
    largest : bool
        Select the largest (else the smallest) elements.
    n_iter : int
        Cap on the Sinkhorn iterations; reaching it warns. Small temperatures need more.
    tol : float
        Stop when ``max_i |A_i + (mass on anchor 0)_i - 1| <= tol`` (marginal error).
    grad : {"implicit", "unrolled"}
        Implicit differentiation of the converged plan, or autograd through the iterations.

    Returns
    -------
    torch.Tensor
        Memberships, shape of ``x``.

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        Fewer than 2 elements, ``k`` outside ``(0, n)`` or not broadcastable, a temperature
        that is not positive, ``n_iter < 1``, a negative ``tol`` or an unknown ``grad``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import soft_topk_ot
    >>> x = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    >>> soft_topk_ot(x, 2, 0.05).round(decimals=3)
    tensor([0.9660, 0.0000, 0.0350, 1.0000], dtype=torch.float64)
    >>> a = soft_topk_ot(x, 2, 0.2)
    >>> a.round(decimals=3), round(float(a.sum()), 12)
    (tensor([0.7140, 0.0820, 0.3210, 0.8840], dtype=torch.float64), 2.0)
    """
    return log_soft_topk_ot(
        x, k, temperature, largest=largest, n_iter=n_iter, tol=tol, grad=grad
    ).exp()


def sorted_soft_topk_log_kernel(x: torch.Tensor, k: int, temperature: Temperature) -> torch.Tensor:
    """Sorted SOFT's ``-C / (max C) / epsilon`` for the anchors ``0, ..., k``: ``(..., n, k + 1)``.

    Normalised per row, with the normaliser differentiated (:func:`soft_topk_log_kernel`
    says why).
    """
    anchors = torch.arange(k + 1, dtype=x.dtype, device=x.device)
    cost = (x.unsqueeze(-1) - anchors) ** 2
    cost = cost / cost.amax(dim=(-2, -1), keepdim=True)
    return -cost / temperature


def _sorted_soft_problem(x: torch.Tensor, k: int, temperature: Temperature) -> tuple:
    """Sorted SOFT top-k's ``(log kernel, log mu, log nu)`` (smallest first)."""
    n = x.shape[-1]
    log_mu = torch.full_like(x, -math.log(n))
    log_nu = torch.full((*x.shape[:-1], k + 1), -math.log(n), dtype=x.dtype, device=x.device)
    log_nu[..., k] = math.log((n - k) / n)
    return sorted_soft_topk_log_kernel(x, k, temperature), log_mu, log_nu


def _check_sorted_k(k: int, n: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < n:
        raise ValueError(f"k must be an int in [1, n) = [1, {n}), got {k!r}")


def log_sorted_soft_topk_ot(
    x: torch.Tensor,
    k: int,
    temperature: Temperature = 1.0,
    *,
    largest: bool = True,
    n_iter: int = DEFAULT_N_ITER,
    tol: float = DEFAULT_TOL,
    grad: str = "implicit",
) -> torch.Tensor:
    """Logarithm of :func:`sorted_soft_topk_ot`, from the log-domain iterations (no underflow).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, selected along the last axis.
    k : int
        Number of ranks, ``1 <= k < n``.
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0`` (on the normalised cost).
    largest : bool
        Rank 0 is the largest score (else the smallest).
    n_iter : int
        Cap on the iterations (epsilon scaling's included).
    tol : float
        Stop when the marginal error (module docstring) is at most ``tol``.
    grad : {"implicit", "unrolled"}
        Backward pass (module docstring).

    Returns
    -------
    torch.Tensor
        Log memberships of shape ``(..., k, n)``: row ``r`` is each element's log share of
        rank ``r``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import log_sorted_soft_topk_ot
    >>> x = torch.tensor([0.0, 3.0, 1.0], dtype=torch.float64)
    >>> log_sorted_soft_topk_ot(x, 1, 0.05).exp().round(decimals=3)
    tensor([[0.0060, 0.9210, 0.0730]], dtype=torch.float64)
    """
    return sorted_soft_topk_all_anchors(
        x, k, temperature, largest=largest, n_iter=n_iter, tol=tol, grad=grad
    )[..., :k, :]


def sorted_soft_topk_all_anchors(
    x: torch.Tensor,
    k: int,
    temperature: Temperature = 1.0,
    *,
    largest: bool = True,
    n_iter: int = DEFAULT_N_ITER,
    tol: float = DEFAULT_TOL,
    grad: str = "implicit",
) -> torch.Tensor:
    """:func:`log_sorted_soft_topk_ot` with the last anchor's row too: ``(..., k + 1, n)``.

    Row ``k`` is ``log(n Gamma[:, k])``, the log share of the ``n - k`` elements after the
    top k (for ``k = n - 1``, the last rank: the rows are then a full relaxed permutation).
    Every element's shares over the ``k + 1`` rows sum to 1 (within ``tol``).

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines.sinkhorn import sorted_soft_topk_all_anchors
    >>> x = torch.tensor([0.0, 3.0, 1.0], dtype=torch.float64)
    >>> shares = sorted_soft_topk_all_anchors(x, 1, 0.05).exp()
    >>> shares.round(decimals=3)  # row 0: the largest; row 1: the other two
    tensor([[0.0060, 0.9210, 0.0730],
            [0.9940, 0.0790, 0.9270]], dtype=torch.float64)
    >>> shares.sum(-2).round(decimals=6)
    tensor([1., 1., 1.], dtype=torch.float64)
    """
    n = check_scores(x)
    _check_sorted_k(k, n)
    check_temperature(temperature)
    _check_convergence_options(n_iter, tol, grad)
    wide = torch.float64  # as for SOFT top-k: masses that sum to 1 exactly
    problem = _sorted_soft_problem((-x if largest else x).to(wide), k, _widen(temperature, wide))
    log_plan = _log_plan(*problem, n_iter, tol, grad, "sorted_soft_topk_ot", anneal=True)
    return (log_plan + math.log(n)).transpose(-1, -2).to(x.dtype)


def sorted_soft_topk_ot(
    x: torch.Tensor,
    k: int,
    temperature: Temperature = 1.0,
    *,
    largest: bool = True,
    n_iter: int = DEFAULT_N_ITER,
    tol: float = DEFAULT_TOL,
    grad: str = "implicit",
) -> torch.Tensor:
    """Sorted SOFT top-k: the top k, each at its rank, by entropic OT (Xie et al. 2020, app. B).

    Transports the scores (mass 1/n each) onto the anchors ``0, 1, ..., k`` with masses
    ``1/n`` for the first k and ``(n - k) / n`` for the last, cost ``C_ij = (x_i - j)^2 / max C``
    (normalised per row as :func:`soft_topk_ot`'s), entropy ``epsilon``. The optimal plan
    sends the smallest score to anchor 0, the next to 1, ..., and the other ``n - k`` to ``k``;
    ``A[r, i] = n Gamma[i, r]`` for ``r < k`` is the soft membership of element ``i`` in rank
    ``r``, so ``A`` is a relaxed version of the first k rows of the permutation matrix (each row
    sums to 1 exactly, each column to at most 1 within ``tol``), and ``A.cumsum(-2)[k - 1]``
    relaxes top-k membership. The paper's form ranks the smallest first; ``largest=True``
    applies it to ``-x``. With ``k = n - 1`` the last anchor takes one element too: ``A`` and
    that last row are a full relaxed permutation (Sinkhorn sort with the normalised cost).
    Solved like Sinkhorn sort (epsilon scaling, then Sinkhorn and Newton steps to ``tol``); the
    default implicit backward solves one ``(k + 1) x (k + 1)`` system (the paper's appendix H,
    time O(n k^2 + k^3)).

    Parameters
    ----------
    x : torch.Tensor
        Scores of shape ``(..., n)``, selected along the last axis; leading axes are batch axes.
    k : int
        Number of ranks, ``1 <= k < n``.
    temperature : float or 0-d torch.Tensor
        The entropic regularisation ``epsilon > 0`` on the normalised cost (the paper's scale).
        A tensor may require grad.
    largest : bool
        Rank 0 is the largest score (else the smallest).
    n_iter : int
        Cap on the iterations (epsilon scaling's included); reaching it warns.
    tol : float
        Stop when the marginal error (module docstring) is at most ``tol``.
    grad : {"implicit", "unrolled"}
        Implicit differentiation of the converged plan, or autograd through the iterations.

    Returns
    -------
    torch.Tensor
        Memberships of shape ``(..., k, n)``: row ``r`` holds each element's share of rank
        ``r`` (0 = the largest when ``largest``).

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        Fewer than 2 elements, ``k`` not an int in ``[1, n)``, a temperature that is not
        positive, ``n_iter < 1``, a negative ``tol`` or an unknown ``grad``.

    Examples
    --------
    >>> import torch
    >>> from softorder.baselines import sorted_soft_topk_ot
    >>> x = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    >>> sorted_soft_topk_ot(x, 2, 0.01).round(decimals=3)  # rank 0: 3.0, rank 1: 2.0
    tensor([[0.0180, 0.0000, 0.0000, 0.9820],
            [0.9800, 0.0000, 0.0020, 0.0180]], dtype=torch.float64)
    >>> a = sorted_soft_topk_ot(x, 2, 0.1)
    >>> a.sum(-1).round(decimals=12), a.sum(-2).max() <= 1 + 1e-5
    (tensor([1., 1.], dtype=torch.float64), tensor(True))
    """
    return log_sorted_soft_topk_ot(
        x, k, temperature, largest=largest, n_iter=n_iter, tol=tol, grad=grad
    ).exp()
