"""Figures of the documentation that are drawn from softorder itself, at build time.

``docs/conf.py`` calls :func:`alpha_figure` when Sphinx starts; it can also be run by hand::

    python docs/figures.py docs/_generated/alpha.png
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

import softorder

#: Ten scores, two of them tied, one far below the rest.
SCORES = np.array([2.9, 2.4, 2.3, 2.3, 1.6, 1.0, 0.4, -0.3, -1.1, -4.0])
ALPHAS = (0.01, 0.1, 0.3, 1.0, 3.0)
K = 3


def alpha_figure(path) -> None:
    """Soft top-3 memberships, soft ranks and soft-sorted values of :data:`SCORES` for
    several alpha: memberships and ranks average out as alpha grows, sorted values spread
    beyond the data's range (by up to ``alpha * log(n)`` at each end).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, sort) = plt.subplots(1, 3, figsize=(15, 3.8), constrained_layout=True)
    idx = np.arange(SCORES.size)
    for alpha in ALPHAS:
        p = softorder.soft_topk(SCORES, K, alpha=alpha)
        r = softorder.soft_rank(SCORES, alpha=alpha, descending=True)
        s = softorder.soft_sort(SCORES, alpha=alpha, descending=True)
        left.plot(idx, p, marker="o", label=f"alpha = {alpha:g}")
        right.plot(idx, r, marker="o", label=f"alpha = {alpha:g}")
        sort.plot(idx + 1, s, marker="o", label=f"alpha = {alpha:g}")
    ticks = [f"{s:g}" for s in SCORES]
    for ax in (left, right):
        ax.set_xticks(idx, ticks)
        ax.set_xlabel("score x_i")
    for ax in (left, right, sort):
        ax.grid(alpha=0.3)
    for bound in (SCORES.min(), SCORES.max()):
        sort.axhline(bound, color="black", linestyle="--", linewidth=1)
    sort.text(SCORES.size, SCORES.max(), "max(x)", va="bottom", ha="right", fontsize=8)
    sort.text(1, SCORES.min(), "min(x)", va="top", ha="left", fontsize=8)
    sort.set_xticks(idx + 1)
    sort.set_xlabel("position k (1 = largest)")
    sort.set_ylabel("soft-sorted value")
    sort.set_title("soft_sort(x, alpha, descending=True)")
    left.set_ylabel(f"soft top-{K} membership (sums to {K})")
    left.set_title(f"soft_topk(x, k={K}, alpha)")
    right.set_ylabel("soft rank, descending (1 = largest)")
    right.set_title("soft_rank(x, alpha, descending=True)")
    left.legend(fontsize=8)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    alpha_figure(sys.argv[1] if len(sys.argv) > 1 else "alpha.png")
