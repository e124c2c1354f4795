"""What the optimal-transport baselines cost to converge: the table in ``examples/README.md``.

For SOFT top-k, sorted SOFT top-k and Sinkhorn sort (:mod:`softorder.baselines.sinkhorn`),
at each temperature, one table cell reads ``plain / ours; time``:

* ``plain``: iterations plain Sinkhorn, as in the papers, takes to a marginal error of 1e-5
  (capped at 20000; ``> 20000`` where it does not get there);
* ``ours``: iterations the path ``softorder.baselines`` takes (epsilon scaling for the sorts,
  Sinkhorn, Newton steps; capped at 1000);
* ``time``: the best of 3 converged forward + backward passes of float32 memberships in the
  top k (milliseconds, one torch thread). ``(warned)`` marks a call that hit the cap.

The scores are 4 rows of N(0, 1) numbers, seed 0. Run from the repository root::

    python benchmarks/bench_convergence.py            # about a minute
    python benchmarks/bench_convergence.py --quick    # two temperatures, small rows (seconds)
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from softorder import baselines
from softorder.baselines.sinkhorn import iterations_to_converge

TOLERANCE = 1e-5


def cell(method: str, x: torch.Tensor, k: int, temperature: float, repeats: int) -> str:
    """One table cell: plain / ours iterations, and the best time of a forward + backward."""
    targets = None if method == "sinkhorn" else k
    ranked = method == "sorted_soft_topk_ot"
    plain, plain_error = iterations_to_converge(
        x.double(), temperature, k=targets, n_iter=20_000, newton=False, ranked=ranked
    )
    ours, our_error = iterations_to_converge(
        x.double(), temperature, k=targets, n_iter=1000, ranked=ranked
    )
    best = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(repeats):
            z = x.clone().requires_grad_(True)
            start = time.perf_counter()
            if method == "soft_topk_ot":
                memberships = baselines.soft_topk_ot(z, k, temperature)
            else:
                memberships = baselines.topk_memberships(z, k, method, temperature)[..., k - 1, :]
            memberships.pow(2).sum().backward()
            best = min(best, time.perf_counter() - start)
    plain_text = "> 20000" if plain_error > TOLERANCE else str(plain)
    our_text = "> 1000, not converged" if our_error > TOLERANCE else str(ours)
    warned = " (warned)" if caught else ""
    return f"{plain_text} / {our_text}; {1000 * best:.1f} ms{warned}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two temperatures, small rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    temperatures = [0.1, 1.0] if args.quick else [0.01, 0.03, 0.1, 0.3, 1.0]
    cases = [("soft_topk_ot", 100, 10), ("sorted_soft_topk_ot", 100, 10), ("sinkhorn", 32, 3)]
    if args.quick:
        cases = [(method, 12, 3) for method, _, _ in cases]
    repeats = 1 if args.quick else 3
    print("| method | " + " | ".join(f"tau = {t:g}" for t in temperatures) + " |")
    print("|---|" + "---:|" * len(temperatures))
    for method, n, k in cases:
        x = torch.randn(4, n, generator=torch.Generator().manual_seed(0))
        cells = [cell(method, x, k, t, repeats) for t in temperatures]
        print(f"| {method} (n = {n}, k = {k}) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
