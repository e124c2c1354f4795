"""Demo of softorder on real data: ``python -m softorder [--quick]``.

Uses scikit-learn's bundled digits data set (1797 images of 8 x 8 pixels, shipped inside the
scikit-learn package, so nothing is downloaded) and shows, in under 60 lines:

1. soft top-k: the soft top-3 memberships of the 10 class scores of a nearest-class-mean
   classifier, at three alphas, next to the hard top-3 from ``np.argsort``;
2. soft rank and soft sort of one image's 64 pixel intensities against
   ``scipy.stats.rankdata`` and ``np.sort``;
3. a gradient through :func:`softorder.vjp`, checked against :func:`softorder.jvp` and a
   finite difference, with no autodiff framework;
4. timings of ``soft_rank`` (forward, forward + VJP) and ``soft_topk`` at n = 1e4, 1e5, 1e6 on
   digits pixels tiled to length n, each as a ratio to ``np.argsort`` of the same data
   measured in the same run (``--quick`` stops at n = 1e5).

The demo needs scikit-learn: ``pip install softorder[demo]``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import softorder
from softorder._engine.backends.numpy_host import PACKED
from softorder._timing import best_times

_N_TRAIN = 1200
_K = 3
_ALPHAS = (0.1, 1.0, 5.0)


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return None
    digits = load_digits()
    return digits.data.astype(np.float64), digits.target


def _nearest_mean_logits(images, labels):
    """Fit class means on the first images; logits = -Euclidean distance to each mean."""
    train, test = images[:_N_TRAIN], images[_N_TRAIN:]
    means = np.stack([train[labels[:_N_TRAIN] == c].mean(axis=0) for c in range(10)])
    logits = -np.sqrt(((test[:, None, :] - means[None]) ** 2).sum(axis=-1))
    return logits, labels[_N_TRAIN:]


def _row(name, values, fmt="{:5.2f}"):
    return f"  {name:<20}" + " ".join(fmt.format(v) for v in values)


def _show_topk(logits, labels):
    hard = np.argsort(-logits, axis=-1)[:, :_K]
    acc1 = np.mean(hard[:, 0] == labels)
    acc3 = np.mean((hard == labels[:, None]).any(axis=-1))
    print(
        f"Nearest-class-mean classifier fit on {_N_TRAIN} images, tested on {len(labels)}: "
        f"top-1 {acc1:.1%}, top-3 {acc3:.1%}"
    )
    print(f"\n1. soft_topk(logits, k={_K}, alpha): membership of each class in the top {_K}")
    # A confident hit, a miss whose label is still in the top 3, and a miss outside it.
    top1_hit = hard[:, 0] == labels
    in_top3 = (hard == labels[:, None]).any(axis=-1)
    picks = [
        np.flatnonzero(top1_hit)[0],
        np.flatnonzero(~top1_hit & in_top3)[0],
        np.flatnonzero(~in_top3)[0],
    ]
    tags = ("top-1 correct", "label 2nd or 3rd", "label not in top 3")
    for i, tag in zip(picks, tags, strict=True):
        indicator = np.zeros(10)
        indicator[hard[i]] = 1.0
        print(
            f"  test image {i}, label {labels[i]} ({tag}): hard top-3 = {sorted(hard[i].tolist())}"
        )
        print(_row("class", range(10), "{:5d}") + "    sum")
        print(_row("np.argsort top-3", indicator) + f"  {indicator.sum():5.2f}")
        for alpha in _ALPHAS:
            p = softorder.soft_topk(logits[i], _K, alpha=alpha)
            print(_row(f"alpha = {alpha:g}", p) + f"  {p.sum():5.2f}")


def _show_rank_sort(image, label):
    print(
        f"\n2. soft_rank / soft_sort of one image's 64 pixels (a '{label}', values 0..16, "
        "many ties)"
    )
    from scipy.stats import rankdata  # (scipy comes with scikit-learn, the demo's extra)

    exact_rank, exact_sort = rankdata(image), np.sort(image)
    print(_row("pixel[:12]", image[:12], "{:5.0f}"))
    print(_row("rankdata", exact_rank[:12], "{:5.1f}"))
    print(_row("soft_rank a=0.05", softorder.soft_rank(image, alpha=0.05)[:12], "{:5.1f}"))
    print(_row("soft_rank a=1", softorder.soft_rank(image, alpha=1.0)[:12], "{:5.1f}"))
    for alpha in (0.01, 0.05, 1.0):
        rank_err = np.abs(softorder.soft_rank(image, alpha=alpha) - exact_rank).max()
        sort_err = np.abs(softorder.soft_sort(image, alpha=alpha) - exact_sort).max()
        print(
            f"  alpha = {alpha:<5g} max |soft_rank - rankdata| = {rank_err:.2e}, "
            f"max |soft_sort - np.sort| = {sort_err:.2e}"
        )
    print("  (ties keep their average rank; soft_sort moves m tied values by up to alpha * log(m))")


def _show_gradient(logits, labels):
    i = int(np.flatnonzero(np.argsort(-logits, axis=-1)[:, 0] != labels)[0])
    x, alpha = logits[i], 1.0
    third = int(np.argsort(-x)[_K - 1])
    print(
        f"\n3. d p[{third}] / d logits for test image {i} (class {third} is 3rd), "
        f"alpha = {alpha:g}, via softorder.vjp"
    )
    p, pullback = softorder.vjp(softorder.soft_topk, x, _K, alpha=alpha)
    x_bar, k_bar, _ = pullback(np.eye(10)[third])
    print(_row("gradient", x_bar, "{:6.3f}"))
    print(f"  sum = {x_bar.sum():.1e} (shift invariance), d p[{third}] / d k = {float(k_bar):.3f}")
    direction = np.random.default_rng(0).standard_normal(10)
    _, p_dot = softorder.jvp(softorder.soft_topk, (x, _K, alpha), (direction, None, None))
    eps = 1e-6
    fd = (
        softorder.soft_topk(x + eps * direction, _K, alpha)[third]
        - softorder.soft_topk(x - eps * direction, _K, alpha)[third]
    ) / (2 * eps)
    print(
        f"  along a random direction: vjp {x_bar @ direction:.8f}, "
        f"jvp {p_dot[third]:.8f}, finite difference {fd:.8f}"
    )


def _show_timing(images, sizes):
    alpha = 0.5
    print(
        f"\n4. Timing (one row, float64, alpha = {alpha:g}): digits pixels tiled to length n"
        " + seeded noise;"
    )
    print("   best of 30 / 5 / 3 repeats at n = 1e4 / 1e5 / 1e6, each divided by the time of")
    print("   np.argsort of the same data measured in this run, in a steady state: softorder's")
    print("   own sort, which a process compiles once it pays (docs/gotchas.rst), compiled first")
    print(f"  {'n':>9} {'argsort ms':>11} {'soft_rank':>10} {'rank+VJP':>10} {'soft_topk':>10}")
    PACKED.compile()
    rng = np.random.default_rng(0)
    pixels = images.ravel()
    for n in sizes:
        x = np.resize(pixels, n) + rng.uniform(-0.25, 0.25, n)
        cotangent = rng.standard_normal(n)
        k = n // 10

        def rank_vjp(x=x, cotangent=cotangent):
            _, pullback = softorder.vjp(softorder.soft_rank, x, alpha=alpha)
            return pullback(cotangent)

        calls = [
            lambda x=x: np.argsort(x),
            lambda x=x: softorder.soft_rank(x, alpha=alpha),
            rank_vjp,
            lambda x=x, k=k: softorder.soft_topk(x, k, alpha=alpha),
        ]
        repeats = 30 if n <= 10**4 else (5 if n < 10**6 else 3)
        t_sort, t_rank, t_vjp, t_topk = best_times(calls, repeats)
        print(
            f"  {n:>9.0e} {t_sort * 1e3:>11.2f} {t_rank / t_sort:>9.1f}x "
            f"{t_vjp / t_sort:>9.1f}x {t_topk / t_sort:>9.1f}x"
        )


def main(argv=None) -> int:
    """Run the softorder demo on scikit-learn's bundled digits data.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (default: ``sys.argv[1:]``). ``--quick`` limits the timing to
        n = 1e4 and 1e5.

    Returns
    -------
    int
        Exit status: 0 on success, 1 if scikit-learn is not installed.
    """
    parser = argparse.ArgumentParser(
        prog="python -m softorder",
        description="Demo of softorder's differentiable order operations on the digits data.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="time only n = 1e4 and 1e5 (instead of up to 1e6)"
    )
    args = parser.parse_args(argv)

    data = _load_digits()
    if data is None:
        print(
            "The softorder demo needs scikit-learn for its bundled digits data set:\n"
            "    pip install softorder[demo]",
            file=sys.stderr,
        )
        return 1
    images, labels = data
    start = time.perf_counter()
    print(
        f"softorder {softorder.__version__} demo on scikit-learn's digits "
        f"({images.shape[0]} images of 8 x 8 pixels, 10 classes)"
    )
    logits, test_labels = _nearest_mean_logits(images, labels)
    _show_topk(logits, test_labels)
    _show_rank_sort(images[_N_TRAIN], labels[_N_TRAIN])
    _show_gradient(logits, test_labels)
    _show_timing(images, (10**4, 10**5) if args.quick else (10**4, 10**5, 10**6))
    print(
        f"\nDone in {time.perf_counter() - start:.1f} s "
        "(including numba JIT compilation or cache loading)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
