"""Differentiable k-nearest neighbours on scikit-learn's digits (the shape of the kNN tables).

Following Grover et al. (2019) and Xie et al. (2020): an embedding network maps images to unit
vectors; for each query in a batch, the soft top-k of the negative squared distances to a batch
of labelled templates selects its k nearest neighbours, and the loss is minus the (soft)
fraction of those neighbours that share the query's label. At test time, plain hard kNN runs in
the learnt embedding against the whole training set. Baselines: kNN on raw pixels, and the
same network trained with softmax cross-entropy (a linear head on the embedding) then used for
kNN.

Protocol (the same for every method): the digits are split once into a test set (25 %) and a
training set, itself split into a fitting part (80 %) and a validation part. Each method's
temperature is chosen from one grid by the validation kNN accuracy after the same training
budget (seed 0); then embeddings trained from several seeds with it are evaluated once on the
test set (kNN against the fitting part). One thread, deterministic kernels: the accuracies
depend only on the seeds.

Run ``python examples/knn_digits.py`` (a few minutes on a CPU) or with ``--quick`` (seconds).
Writes ``knn_digits.png`` and ``knn_digits.md`` to ``--out``.
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
    deterministic,
    digits_data,
    mean_sd,
    protocol_line,
    save_figure,
    tuned_runs,
    with_lapsum,
    write_table,
)
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

from softorder import baselines  # noqa: E402


def soft_knn_memberships(
    scores: torch.Tensor, k: int, method: str, temperature: float
) -> torch.Tensor:
    """Soft membership of each template in the top k (largest scores) of its row."""
    if method == "lapsum":
        import softorder.bridges.torch as sot

        return sot.soft_topk(scores, float(k), temperature)
    if method == "soft_topk_ot":
        return baselines.soft_topk_ot(scores, k, temperature)
    return baselines.topk_memberships(scores, k, method, temperature)[..., k - 1, :]


def embedder(seed: int) -> torch.nn.Module:
    """The embedding network: MLP 64-128-32."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))


def embed(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Unit-norm embeddings."""
    return torch.nn.functional.normalize(net(x), dim=-1)


def knn_accuracy(
    train_z: torch.Tensor, train_y: torch.Tensor, z: torch.Tensor, y: torch.Tensor, k: int
) -> float:
    """Hard kNN test accuracy (%) with majority vote (ties: the nearest neighbour's class)."""
    d = torch.cdist(z, train_z)
    idx = d.topk(k, largest=False).indices
    votes = torch.nn.functional.one_hot(train_y[idx], 10).sum(1).float()
    votes[torch.arange(len(y)), train_y[idx[:, 0]]] += 0.5
    return 100 * float((votes.argmax(-1) == y).float().mean())


def train(
    method: str,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    *,
    k: int,
    steps: int,
    temperature: float | None,
    templates: int,
    queries: int,
    seed: int,
) -> tuple[torch.nn.Module, float]:
    """Train one embedding; returns it and the ms per step."""
    net = embedder(seed)
    head = torch.nn.Linear(32, 10)
    params = list(net.parameters()) + (list(head.parameters()) if method == "softmax" else [])
    opt = torch.optim.Adam(params, lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(steps):
        if method == "softmax":
            b = torch.randint(len(y_train), (queries,), generator=gen)
            loss = torch.nn.functional.cross_entropy(head(net(x_train[b])), y_train[b])
        else:
            perm = torch.randperm(len(y_train), generator=gen)
            q, t = perm[:queries], perm[queries : queries + templates]
            zq, zt = embed(net, x_train[q]), embed(net, x_train[t])
            scores = -(torch.cdist(zq, zt) ** 2)  # (queries, templates)
            m = soft_knn_memberships(scores, k, method, temperature)
            same = (y_train[q][:, None] == y_train[t][None, :]).float()
            loss = -(m * same).sum(-1).mean() / k
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, 1000 * (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    """Run the experiment and write the table and the figure."""
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--templates", type=int, default=32)
    parser.add_argument("--queries", type=int, default=16)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.templates, args.queries = 4, 1, 16, 8
    grid = tuple(args.grid or (QUICK_GRID if args.quick else GRID))
    args.out.mkdir(parents=True, exist_ok=True)
    deterministic()
    methods = with_lapsum(baselines.METHODS)
    x, y = digits_data()
    idx = torch.arange(len(y))
    rest, test = train_test_split(idx, test_size=0.25, random_state=0, stratify=y)
    fit, val = train_test_split(rest, test_size=0.2, random_state=0, stratify=y[rest])
    x_fit, y_fit, x_val, y_val, x_test, y_test = x[fit], y[fit], x[val], y[val], x[test], y[test]
    options = {"k": args.k, "steps": args.steps, "templates": args.templates}
    options["queries"] = args.queries

    def accuracy(net: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> float:
        with torch.no_grad():
            return knn_accuracy(embed(net, x_fit), y_fit, embed(net, xs), ys, args.k)

    rows = [
        {
            "method": "kNN on pixels",
            "acc": [knn_accuracy(x_fit, y_fit, x_test, y_test, args.k)],
            "ms": None,
            "temperature": None,
        }
    ]
    runs = args.seeds + len(methods) * (len(grid) + args.seeds - 1)
    with tqdm(total=runs, desc="training", file=sys.stdout) as bar:
        for method in ["softmax", *methods]:
            best, trained = tuned_runs(
                None if method == "softmax" else grid,
                args.seeds,
                lambda t, seed, method=method: train(
                    method, x_fit, y_fit, temperature=t, seed=seed, **options
                ),
                lambda run: accuracy(run[0], x_val, y_val),
                lambda: bar.update(1),
            )
            name = "softmax CE, then kNN" if method == "softmax" else f"kNN + {method}"
            rows.append(
                {
                    "method": name,
                    "acc": [accuracy(net, x_test, y_test) for net, _ in trained],
                    "ms": statistics.median(ms for _, ms in trained),
                    "temperature": best,
                }
            )
    lines = [
        protocol_line(grid, args.seeds, "kNN accuracy"),
        "",
        f"Digits (75/25 train/test; train split 80/20 into fitting/validation), k = {args.k}, "
        f"embedding MLP 64-128-32 (unit norm), {args.steps} Adam steps of {args.queries} queries "
        f"x {args.templates} templates; hard kNN test accuracy (%) against the fitting part, "
        "time per step on one thread.",
        "",
        "| method | temperature | accuracy | ms / step |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.1f}"
        temp = "-" if r["temperature"] is None else f"{r['temperature']:g}"
        lines.append(f"| {r['method']} | {temp} | {mean_sd(r['acc'])} | {ms} |")
    table = "\n".join(lines)
    write_table(table, args.out, "knn_digits")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    means = [statistics.mean(r["acc"]) for r in rows]
    ax.barh([r["method"] for r in rows], means, color="tab:blue")
    for i, m in enumerate(means):
        ax.text(m, i, f" {m:.1f}", va="center")
    ax.set_xlim(min(means) - 5, 100)
    ax.invert_yaxis()
    ax.set_xlabel(f"hard {args.k}-NN test accuracy (%)")
    ax.set_title("Differentiable kNN on digits")
    save_figure(fig, args.out, "knn_digits", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
