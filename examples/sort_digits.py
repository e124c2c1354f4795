"""Sorting handwritten numbers, learnt from the permutation only (the shape of LapSum's Table 4).

The large-MNIST task of Grover et al. (2019), made small with scikit-learn's digits: a "number"
is two 8x8 digit images side by side (00 to 99); a sequence holds n numbers with distinct
values. A network scores each image on its own and never sees the values: the only supervision
is the permutation that sorts the sequence, through the permutation cross-entropy
``-sum_i log P[t_i, i]`` of each method's relaxed permutation matrix (LapSum computes it without
forming ``P``). Test images are never seen in training. Reported as in the papers: the
percentage of test sequences sorted entirely correctly, and (in brackets) of elements placed at
their correct rank.

Protocol (the same for every method): the digit images are split once into test (30 %) and
training images, the latter into fitting (80 %) and validation images. Each method's
temperature is chosen from one grid at n = 5 (the selection size) by the share of validation
sequences sorted exactly, after the same training budget (seed 0), and used at every n; then
scorers trained from several seeds are evaluated once on test sequences. One thread,
deterministic kernels: the accuracies depend only on the seeds.

Run ``python examples/sort_digits.py`` (a few minutes on a CPU) or with ``--quick`` (seconds).
Writes ``sort_digits.png`` and ``sort_digits.md`` to ``--out``.
"""

from __future__ import annotations

import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _common import (  # noqa: E402
    GRID,
    QUICK_GRID,
    argument_parser,
    choose,
    deterministic,
    digits_data,
    protocol_line,
    save_figure,
    with_lapsum,
    write_table,
)
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

from softorder import baselines  # noqa: E402


class Numbers:
    """Two-digit numbers drawn from a pool of digit images."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.counts = torch.bincount(labels, minlength=10)
        self.pool = torch.zeros(10, int(self.counts.max()), 64)
        for d in range(10):
            self.pool[d, : self.counts[d]] = images[labels == d]

    def sequences(self, batch: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        """``batch`` sequences of ``n`` distinct numbers: images (batch, n, 128), values."""
        values = torch.rand(batch, 100, generator=gen).argsort(-1)[:, :n]
        halves = []
        for digits in (values // 10, values % 10):
            pick = (torch.rand(batch, n, generator=gen) * self.counts[digits]).long()
            halves.append(self.pool[digits, pick].reshape(batch, n, 8, 8))
        images = torch.cat(halves, dim=-1).reshape(batch, n, 128)  # digits side by side
        return images, values


def scorer(seed: int) -> torch.nn.Module:
    """MLP 128-128-64-1 scoring one number image."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )


def train(
    method: str,
    n: int,
    train_set: Numbers,
    *,
    steps: int,
    batch: int,
    temperature: float,
    seed: int,
) -> tuple[torch.nn.Module, float]:
    """Train one scorer; returns it and the ms per step."""
    net = scorer(seed)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(steps):
        images, values = train_set.sequences(batch, n, gen)
        scores = net(images).squeeze(-1)
        ranks = torch.argsort(torch.argsort(values, dim=-1), dim=-1) + 1  # 1 = smallest
        loss = baselines.permutation_cross_entropy(
            scores, ranks, method=method, temperature=temperature
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, 1000 * (time.perf_counter() - start) / steps


def evaluate(net: torch.nn.Module, n: int, data: Numbers, sequences: int) -> tuple[float, float]:
    """(% sequences exactly sorted, % elements at the right rank) on fixed sequences."""
    images, values = data.sequences(sequences, n, torch.Generator().manual_seed(99))
    with torch.no_grad():
        predicted = torch.argsort(net(images).squeeze(-1), dim=-1)
    correct = predicted == torch.argsort(values, dim=-1)
    return 100 * float(correct.all(-1).float().mean()), 100 * float(correct.float().mean())


def main(argv: list[str] | None = None) -> int:
    """Run the experiment and write the table and the figure."""
    parser = argument_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 5, 7, 9])
    parser.add_argument("--select-at", type=int, default=5, help="n at which to choose")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--test-sequences", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.test_sequences, args.seeds = [3, 5], 10, 100, 1
    grid = tuple(args.grid or (QUICK_GRID if args.quick else GRID))
    args.out.mkdir(parents=True, exist_ok=True)
    deterministic()
    methods = with_lapsum(baselines.PERMUTATION_METHODS)
    x, y = digits_data()
    idx = torch.arange(len(y))
    rest, te = train_test_split(idx, test_size=0.3, random_state=0, stratify=y)
    fit, val = train_test_split(rest, test_size=0.2, random_state=0, stratify=y[rest])
    fit_set, val_set, test_set = (
        Numbers(x[fit], y[fit]),
        Numbers(x[val], y[val]),
        Numbers(x[te], y[te]),
    )
    options = {"steps": args.steps, "batch": args.batch}
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    chosen = {}
    total = len(methods) * (len(grid) + len(args.sizes) * args.seeds)
    with tqdm(total=total, desc="training", file=sys.stdout) as bar:
        for method in methods:

            def validation_score(t, method=method):
                net, _ = train(method, args.select_at, fit_set, temperature=t, seed=0, **options)
                bar.update(1)
                exact, element = evaluate(net, args.select_at, val_set, args.test_sequences)
                return exact + element / 1000  # ties on exact broken by the elements

            chosen[method], _ = choose(grid, validation_score)
            for n in args.sizes:
                for seed in range(args.seeds):
                    net, ms = train(
                        method, n, fit_set, temperature=chosen[method], seed=seed, **options
                    )
                    results.setdefault((method, n), []).append(
                        (*evaluate(net, n, test_set, args.test_sequences), ms)
                    )
                    bar.update(1)

    def cell(method: str, n: int) -> str:
        runs = results[(method, n)]
        exact = [r[0] for r in runs]
        element = statistics.mean(r[1] for r in runs)
        return f"{statistics.mean(exact):.1f} +- {statistics.pstdev(exact):.1f} ({element:.1f})"

    lines = [
        protocol_line(grid, args.seeds, f"exact-sort accuracy at n = {args.select_at}"),
        "",
        f"Sorting n two-digit numbers (digits images), {args.steps} Adam steps of {args.batch} "
        f"sequences, {args.test_sequences} test sequences: % sequences exactly sorted (mean +- "
        "sd; % elements at the right rank, mean); last column: ms per step at the largest n, "
        "one thread.",
        "",
        "| method | temperature | " + " | ".join(f"n = {n}" for n in args.sizes) + " | ms / step |",
        "|---|---:|" + "---:|" * (len(args.sizes) + 1),
    ]
    for method in methods:
        ms = statistics.mean(r[2] for r in results[(method, args.sizes[-1])])
        lines.append(
            f"| {method} | {chosen[method]:g} | "
            + " | ".join(cell(method, n) for n in args.sizes)
            + f" | {ms:.1f} |"
        )
    table = "\n".join(lines)
    write_table(table, args.out, "sort_digits")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in methods:
        for ax, i in zip(axes, (0, 1), strict=True):
            ax.plot(
                args.sizes,
                [statistics.mean(r[i] for r in results[(method, n)]) for n in args.sizes],
                marker="o",
                label=method,
                lw=2.5 if method == "lapsum" else 1.2,
            )
    axes[0].set_ylabel("sequences exactly sorted (%)")
    axes[1].set_ylabel("elements at the correct rank (%)")
    for ax in axes:
        ax.set_xlabel("sequence length n")
        ax.set_xticks(args.sizes)
    axes[0].legend(fontsize=8)
    fig.suptitle("Learning to sort handwritten numbers from the permutation only")
    save_figure(fig, args.out, "sort_digits", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
