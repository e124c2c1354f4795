"""Accuracy and cost of the soft top-k relaxations (the shape of LapSum's Figs. 5 and 7).

1. **Accuracy at matched sharpness.** Every method's temperature is put on one scale: on two
   elements, each method's top-1 membership has slope ``1 / (4 tau)`` at a tie (checked below
   numerically), so equal temperatures mean equally sharp relaxations. For random normal
   scores, the error of each method's soft top-k against the hard top-k is the share of the
   top-k mass it misplaces, ``sum_i |m_i - h_i| / (2k)``, as a function of the temperature and
   of n.
2. **Convergence.** Iterations the Sinkhorn methods need to reach their marginal tolerance,
   as in the papers (plain Sinkhorn) and as ``softorder.baselines`` runs them (epsilon scaling
   for the sorts, then Sinkhorn and Newton steps), with the time of a converged forward +
   backward.
3. **Cost.** Forward + backward time and peak memory of the memberships in the top k for
   k = 1..5 (what the top-k loss needs), as n grows; each method runs in its own process so
   its peak resident memory can be measured. Sizes whose estimated memory exceeds a budget are
   skipped (marked in the table).

Run ``python examples/relaxation_cost.py`` (a few minutes on a CPU) or with ``--quick``
(seconds). Writes ``relaxation_cost.png`` and ``relaxation_cost.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import resource
import subprocess
import sys
import time
from collections.abc import Iterator

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _common import (  # noqa: E402
    argument_parser,
    deterministic,
    save_figure,
    with_lapsum,
    write_table,
)
from tqdm import tqdm  # noqa: E402

from softorder import baselines  # noqa: E402
from softorder.baselines.sinkhorn import DEFAULT_TOL, iterations_to_converge  # noqa: E402

K = 5  # memberships for k = 1..K in the cost part
#: The methods iterated to a marginal tolerance (with a convergence table).
SINKHORNS = ("sinkhorn", "soft_topk_ot", "sorted_soft_topk_ot")
BATCH = 4  # rows per call in the cost part
BUDGET = 1.5e9  # bytes: skip a size whose estimated memory is larger


def memberships(
    x: torch.Tensor, k: int, method: str, temperature: float, tol: float = DEFAULT_TOL
) -> torch.Tensor:
    """Memberships in the top ``k`` only, the cheapest way each method offers (``tol``: the
    Sinkhorn methods' marginal tolerance).
    """
    options = {"tol": tol} if method in SINKHORNS else {}
    if method == "lapsum":
        import softorder.bridges.torch as sot

        return sot.soft_topk(x, float(k), temperature)
    if method == "soft_topk_ot":
        return baselines.soft_topk_ot(x, k, temperature, **options)
    return baselines.topk_memberships(x, k, method, temperature, **options)[..., k - 1, :]


def convergence(x: torch.Tensor, k: int, method: str, temperature: float, cap: int) -> dict:
    """Plain Sinkhorn's and the default path's iterations to the tolerance, and the time (ms)
    of a converged forward + backward of the top-k memberships.
    """
    kk = None if method == "sinkhorn" else k
    ranked = method == "sorted_soft_topk_ot"
    plain, plain_error = iterations_to_converge(
        x, temperature, k=kk, n_iter=cap, newton=False, ranked=ranked
    )
    ours, _ = iterations_to_converge(x, temperature, k=kk, ranked=ranked)
    z = x.clone().requires_grad_(True)
    start = time.perf_counter()
    memberships(z, k, method, temperature).pow(2).sum().backward()
    ms = 1000 * (time.perf_counter() - start)
    return {"plain": plain if plain_error <= DEFAULT_TOL else None, "ours": ours, "ms": ms}


def two_element_slope(method: str, temperature: float) -> float:
    """d(top-1 membership of x_0) / d x_0 at a tie, by a central difference (SoftSort's |.|
    has a kink exactly at the tie, so autograd would report one side).
    """
    h = 1e-5 * temperature
    x = torch.tensor([[h, 0.0], [-h, 0.0]], dtype=torch.float64)
    with torch.no_grad():  # converged far below the difference taken
        m = memberships(x, 1, method, temperature, tol=1e-13)[:, 0]
    return float(m[0] - m[1]) / (2 * h)


def topk_error(x: torch.Tensor, k: int, method: str, temperature: float) -> float:
    """Mean over rows of ``sum_i |m_i - h_i| / (2k)``."""
    with torch.no_grad():
        m = memberships(x, k, method, temperature)
    hard = torch.zeros_like(x).scatter(-1, x.topk(k, dim=-1).indices, 1.0)
    return float(((m - hard).abs().sum(-1) / (2 * k)).mean())


def estimated_bytes(method: str, n: int) -> float:
    """Rough autograd memory of one forward + backward (float32, BATCH rows)."""
    rows = BATCH * 4.0
    wires = 1 << (n - 1).bit_length()
    return {
        "lapsum": 40 * rows * n,
        "neuralsort": 3 * rows * n * n,
        "softsort": 12 * rows * K * n,
        "sinkhorn": 16 * rows * n * n,  # the plan and the backward's n x n solve
        "soft_topk_ot": 40 * rows * K * n,
        "sorted_soft_topk_ot": 40 * rows * (K + 1) * n,  # one problem, K + 1 anchors
        "odd_even_network": n * 6 * rows * K * n,
        "bitonic_network": 12 * rows * K * wires * (wires.bit_length() ** 2) / 2,
    }[method]


def _status(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Reset the peak resident memory to the current one (Linux); return the current one."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap memory back first
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS")
    except OSError:  # not Linux: fall back on the lifetime peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss() -> int:
    """Peak resident memory since the last reset (Linux) or since the start."""
    try:
        return _status("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(spec: dict[str, list[int]]) -> None:
    """Peak memory of each method at its sizes; print one JSON line per size."""
    torch.set_num_threads(1)
    for method, sizes in spec.items():
        for result in measure(method, sizes, repeats=1, memory=True):
            print(json.dumps(result), flush=True)


def measure(method: str, sizes: list[int], repeats: int, memory: bool) -> Iterator[dict]:
    """Time (best of ``repeats``) or peak memory of one method at increasing sizes."""

    def run(n: int) -> float:
        x = torch.randn(BATCH, n, generator=torch.Generator().manual_seed(n)).requires_grad_()
        start = time.perf_counter()
        m = baselines.topk_memberships(x, K, method, 0.1)
        m.sum(-2).pow(2).sum().backward()
        return time.perf_counter() - start

    run(16)  # warm-up (and compiles LapSum's kernels)
    for n in sizes:
        if estimated_bytes(method, n) > BUDGET:
            yield {"method": method, "n": n, "skipped": True}
            continue
        times, peaks = [], []
        for _ in range(repeats):
            before = reset_peak_rss() if memory else 0
            times.append(run(n))
            peaks.append(peak_rss() - before if memory else 0)
        result = {"method": method, "n": n, "seconds": min(times)}
        yield result | ({"bytes": max(max(peaks), 0)} if memory else {})
        if min(times) > 5 and not memory:  # the next size would take too long
            return


def main(argv: list[str] | None = None) -> int:
    """Run both parts and write the tables and the figure."""
    parser = argument_parser(__doc__)
    parser.add_argument("--worker", type=json.loads, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384, 65536])
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    deterministic()
    methods = with_lapsum(baselines.METHODS)
    temps = [0.003, 0.01, 0.03, 0.1, 0.3, 1.0]
    n_acc, k_acc, rows_acc = 100, 10, 64
    n_grid, tau_n = [16, 64, 256, 1024], 0.03
    rows_conv, cap = 8, 20000
    if args.quick:
        temps, n_acc, rows_acc, n_grid, args.sizes = [0.03, 0.3], 40, 8, [16, 32], [32, 64]
        rows_conv, cap = 2, 2000
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows_acc, n_acc, dtype=torch.float64, generator=gen)
    sinkhorns = list(SINKHORNS)
    total = len(methods) * (2 + len(temps) + len(n_grid)) + len(sinkhorns) * len(temps) + 1
    slopes, err_tau, err_n, cost, conv = {}, {}, {}, {}, {}
    with tqdm(total=total, desc="measuring", file=sys.stdout) as bar:
        for method in methods:
            slopes[method] = two_element_slope(method, 0.5)
            bar.update(1)
            err_tau[method] = []
            for t in temps:
                err_tau[method].append(topk_error(x, k_acc, method, t))
                bar.update(1)
            cost[method] = {
                r["n"]: r
                for r in measure(method, args.sizes, repeats=1 if args.quick else 3, memory=False)
            }
            bar.update(1)
            err_n[method] = []
            for n in n_grid:
                rows = max(2, rows_acc * n_acc // (4 * n))
                # seeded by n alone: every method sees the same scores, whichever came before
                gen_n = torch.Generator().manual_seed(n)
                xn = torch.randn(rows, n, dtype=torch.float64, generator=gen_n)
                skip = method == "sinkhorn" and n > 512  # O(n^2) per iteration
                err_n[method].append(None if skip else topk_error(xn, n // 10, method, tau_n))
                bar.update(1)
        for method in sinkhorns:
            conv[method] = []
            for t in temps:
                conv[method].append(convergence(x[:rows_conv], k_acc, method, t, cap))
                bar.update(1)
        # Times above (normal allocator); memory in one other process: the peak resident
        # memory is reset before each call (Linux), and with this glibc setting every block of
        # 1 MB or more is its own mapping, returned to the system when freed (smaller ones are
        # trimmed before the reset), so a call's peak is the memory it needed. The setting
        # slows allocations, hence not used for the times.
        spec = {m: [n for n, r in cost[m].items() if not r.get("skipped")] for m in methods}
        command = [sys.executable, __file__, "--worker", json.dumps(spec)]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
        result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        for r in map(json.loads, result.stdout.split("\n")[:-1]):
            cost[r["method"]][r["n"]]["bytes"] = r["bytes"]
        bar.update(1)

    lines = [
        "Two-element slope at a tie, temperature 0.5 (1 / (4 tau) = 0.5 for every method): "
        + ", ".join(f"{m} {s:.3f}" for m, s in slopes.items()),
        "",
        f"**Soft top-k error** (share of top-k mass misplaced), n = {n_acc}, k = {k_acc}, "
        f"{rows_acc} rows of N(0, 1) scores; Sinkhorn methods converged to a marginal error of "
        f"{DEFAULT_TOL:g} (the SOFT methods' epsilon on their normalised cost, so not matched in "
        "sharpness):",
        "",
        "| method | " + " | ".join(f"tau = {t:g}" for t in temps) + " |",
        "|---|" + "---:|" * len(temps),
    ]
    for method in err_tau:
        lines.append(f"| {method} | " + " | ".join(f"{e:.4f}" for e in err_tau[method]) + " |")
    lines += [
        "",
        f"**Error against n** (k = n / 10, tau = {tau_n:g}, N(0, 1) scores):",
        "",
        "| method | " + " | ".join(f"n = {n}" for n in n_grid) + " |",
        "|---|" + "---:|" * len(n_grid),
    ]
    for method in methods:
        cells = ["-" if e is None else f"{e:.4f}" for e in err_n[method]]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"**Convergence** (same scores, first {rows_conv} rows, n = {n_acc}, k = {k_acc}): "
        f"iterations to a marginal error of {DEFAULT_TOL:g} with plain Sinkhorn (the papers; "
        f"'> {cap}' where it had not converged by then) / on softorder.baselines' default path "
        "(epsilon scaling for the sorts, then Sinkhorn with Newton steps after 20 iterations; "
        "every iteration counted); then ms of a converged forward + backward (implicit "
        "gradient):",
        "",
        "| method | " + " | ".join(f"tau = {t:g}" for t in temps) + " |",
        "|---|" + "---:|" * len(temps),
    ]
    for method in sinkhorns:
        cells = [
            f"{'> ' + str(cap) if c['plain'] is None else c['plain']} / {c['ours']}; "
            f"{c['ms']:.0f} ms"
            for c in conv[method]
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"**Cost**: forward + backward of the memberships for k = 1..{K}, {BATCH} rows, "
        f"float32, one thread; time in ms (best of {1 if args.quick else 3}) / peak extra "
        "resident memory in MB "
        "(skipped: estimated memory above 1.5 GB, or the previous size took over 5 s):",
        "",
        "| method | " + " | ".join(f"n = {n}" for n in args.sizes) + " |",
        "|---|" + "---:|" * len(args.sizes),
    ]

    def cost_cell(r: dict | None) -> str:
        if r is None or r.get("skipped"):
            return "skipped"
        memory = f"{r['bytes'] / 1e6:.0f}" if "bytes" in r else "?"
        return f"{1000 * r['seconds']:.1f} / {memory}"

    for method in methods:
        lines.append(
            f"| {method} | " + " | ".join(cost_cell(cost[method].get(n)) for n in args.sizes) + " |"
        )
    table = "\n".join(lines)
    write_table(table, args.out, "relaxation_cost")

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    for method in methods:
        style = {"lw": 2.5 if method == "lapsum" else 1.2, "marker": "o", "label": method}
        axes[0].loglog(temps, [max(e, 1e-16) for e in err_tau[method]], **style)
        pts = [(n, e) for n, e in zip(n_grid, err_n[method], strict=True) if e is not None]
        axes[1].loglog(*zip(*pts, strict=True), **style)
        done = [(n, r) for n, r in sorted(cost[method].items()) if not r.get("skipped")]
        if done:
            axes[2].loglog([n for n, _ in done], [r["seconds"] for _, r in done], **style)
            mem = [(n, max(r["bytes"], 1e5) / 1e6) for n, r in done if "bytes" in r]
            axes[3].loglog(*zip(*mem, strict=True), **style)
    axes[0].set(
        xlabel="temperature (matched sharpness)",
        ylabel="top-k error",
        title=f"error vs temperature (n={n_acc}, k={k_acc})",
    )
    axes[1].set(xlabel="n", ylabel="top-k error", title=f"error vs n (k=n/10, tau={tau_n:g})")
    axes[2].set(xlabel="n", ylabel="seconds", title=f"forward+backward time (k=1..{K})")
    axes[3].set(xlabel="n", ylabel="MB", title="peak extra memory")
    axes[0].legend(fontsize=8)
    save_figure(fig, args.out, "relaxation_cost", dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
