"""Differentiable k-nearest neighbours on scikit-learn's digits (the shape of the kNN tables).

Following Grover et al. (2019) and Xie et al. (2020): an embedding network maps images to unit
vectors; for each query in a batch, the soft top-k of the negative squared distances to a batch
of labelled templates selects its k nearest neighbours, and the loss is minus the (soft)
fraction of those neighbours that share the query's label. At test time, plain hard kNN runs in
the learnt embedding against the whole training set. Baselines: kNN on raw pixels, and the
same network trained with softmax cross-entropy (a linear head on the embedding) then used for
kNN. Every soft top-k method runs at the same temperature, which matches their sharpness on two
elements (see ``relaxation_cost.py``).

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
from _common import argument_parser, digits_data, save_figure, with_lapsum, write_table  # noqa: E402
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
    split: tuple[torch.Tensor, ...],
    *,
    k: int,
    steps: int,
    temperature: float,
    templates: int,
    queries: int,
    seed: int,
) -> tuple[float, float]:
    """Train one embedding; returns (test kNN accuracy %, ms per step)."""
    x_train, y_train, x_test, y_test = split
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
    ms = 1000 * (time.perf_counter() - start) / steps
    with torch.no_grad():
        acc = knn_accuracy(embed(net, x_train), y_train, embed(net, x_test), y_test, k)
    return acc, ms


def main(argv: list[str] | None = None) -> int:
    """Run the experiment and write the table and the figure."""
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--templates", type=int, default=32)
    parser.add_argument("--queries", type=int, default=16)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.templates, args.queries = 4, 1, 16, 8
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    methods = with_lapsum(baselines.METHODS)
    x, y = digits_data()
    rows = []
    with tqdm(total=(len(methods) + 1) * args.seeds, desc="training", file=sys.stdout) as bar:
        splits = []
        for seed in range(args.seeds):
            tr, te = train_test_split(
                torch.arange(len(y)), test_size=0.25, random_state=seed, stratify=y
            )
            splits.append((x[tr], y[tr], x[te], y[te]))
        raw = [knn_accuracy(s[0], s[1], s[2], s[3], args.k) for s in splits]
        rows.append({"method": "kNN on pixels", "acc": raw, "ms": None})
        for method in ["softmax", *methods]:
            accs, times = [], []
            for seed, split in enumerate(splits):
                acc, ms = train(
                    method,
                    split,
                    k=args.k,
                    steps=args.steps,
                    temperature=args.temperature,
                    templates=args.templates,
                    queries=args.queries,
                    seed=seed,
                )
                accs.append(acc)
                times.append(ms)
                bar.update(1)
            name = "softmax CE, then kNN" if method == "softmax" else f"kNN + {method}"
            rows.append({"method": name, "acc": accs, "ms": statistics.median(times)})
    lines = [
        f"Digits (75/25 split), k = {args.k}, embedding MLP 64-128-32 (unit norm), "
        f"{args.steps} Adam steps of {args.queries} queries x {args.templates} templates, "
        f"temperature {args.temperature:g}; hard kNN test accuracy (%), mean +- sd over "
        f"{args.seeds} seed(s).",
        "",
        "| method | accuracy | ms / step |",
        "|---|---:|---:|",
    ]
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.1f}"
        lines.append(
            f"| {r['method']} | {statistics.mean(r['acc']):.2f} +- "
            f"{statistics.pstdev(r['acc']):.2f} | {ms} |"
        )
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
