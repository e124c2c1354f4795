"""Core speed report of softorder, as ratios to ``np.argsort`` measured in the same run.

Run from the repository root::

    python benchmarks/bench_core.py

Options: ``--repeats R`` (default 5) and ``--max-n N`` (default 1e6; e.g. ``--max-n 1e5`` for
a quick run).

What it measures (``time.perf_counter``; every callable is called once first so that numba
compiles or loads its kernels; each time is the best (min) of R repeats, 10 R at n = 1e4 where
a call takes about a millisecond, min(R, 3) at n = 1e6; the calls of one size are interleaved
so that machine noise hits them alike):

* forward + VJP (``softorder.vjp(op, x, ...)`` then ``pullback(cotangent)``) of ``soft_rank``,
  ``soft_topk`` (k = n / 10) and ``soft_sort`` on one float64 row of seeded standard normal
  data, n = 1e4, 1e5, 1e6, alpha = 0.1, each divided by the time of ``np.argsort`` of the
  same data;
* the growth ratio time(10 n) / time(n) of ``soft_rank`` forward + VJP;
* a batch of 256 x 1000 float32 rows, ``soft_rank`` forward + VJP along the last axis, against
  ``np.argsort(x, axis=-1)``.

Acceptance targets: ``soft_rank`` forward + VJP at n = 1e6 at most 4 x ``np.argsort``; growth
per 10 x in n below 15. The script prints PASS / FAIL for each and always exits with 0: it is
a report, not a test. Ratios, not absolute times, are what compare across machines.
"""

from __future__ import annotations

import argparse
import platform
import sys

import numba
import numpy as np

import softorder
from softorder._timing import best_times

ALPHA = 0.1
SIZES = (10**4, 10**5, 10**6)
BATCH_SHAPE = (256, 1000)
TARGET_RATIO = 4.0  # soft_rank fwd+VJP at n = 1e6, in units of np.argsort
TARGET_GROWTH = 15.0  # time(10 n) / time(n)


def forward_vjp(op, x, cotangent, *args):
    """A callable running ``op`` forward and its pullback once."""

    def run():
        _, pullback = softorder.vjp(op, x, *args, alpha=ALPHA)
        return pullback(cotangent)

    return run


def repeats_for(n, repeats):
    if n <= 10**4:
        return 10 * repeats
    if n >= 10**6:
        return max(1, min(repeats, 3))
    return repeats


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="best of this many repeats (default 5; min(R, 3) at n = 1e6)",
    )
    parser.add_argument(
        "--max-n",
        type=lambda s: int(float(s)),
        default=10**6,
        help="largest row length, among 1e4, 1e5, 1e6 (default 1e6)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    sizes = [n for n in SIZES if n <= args.max_n]
    rng = np.random.default_rng(20250101)

    softorder.soft_rank(np.zeros(2))  # loads the kernels, so the threading layer is known
    print(
        f"softorder {softorder.__version__}, numpy {np.__version__}, numba {numba.__version__}"
        f" ({numba.threading_layer()}, {numba.get_num_threads()} threads), "
        f"Python {platform.python_version()}, {platform.machine()}"
    )
    print(
        f"alpha = {ALPHA}; best of {args.repeats} repeats (x10 at n = 1e4, at most 3 at "
        "n = 1e6); fwd+VJP = softorder.vjp + pullback\n"
    )

    rows = []  # (operation, size, time, argsort time)
    rank_time = {}
    for n in sizes:
        x = rng.standard_normal(n)
        v = rng.standard_normal(n)
        ops = [
            ("soft_rank fwd+VJP", forward_vjp(softorder.soft_rank, x, v)),
            ("soft_topk fwd+VJP (k = n/10)", forward_vjp(softorder.soft_topk, x, v, n // 10)),
            ("soft_sort fwd+VJP", forward_vjp(softorder.soft_sort, x, v)),
        ]
        times = best_times(
            [lambda x=x: np.argsort(x)] + [call for _, call in ops], repeats_for(n, args.repeats)
        )
        for (name, _), t in zip(ops, times[1:], strict=True):
            rows.append((name, f"{n:.0e}", t, times[0]))
        rank_time[n] = (times[1], times[0])

    xb = rng.standard_normal(BATCH_SHAPE).astype(np.float32)
    vb = rng.standard_normal(BATCH_SHAPE).astype(np.float32)
    t_sort, t_rank = best_times(
        [lambda: np.argsort(xb, axis=-1), forward_vjp(softorder.soft_rank, xb, vb)], args.repeats
    )
    rows.append(("soft_rank fwd+VJP, batched float32", "256 x 1000", t_rank, t_sort))

    print("| operation | n / shape | time ms | argsort ms | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, size, t, t_ref in rows:
        print(f"| {name} | {size} | {t * 1e3:.3f} | {t_ref * 1e3:.3f} | {t / t_ref:.2f} |")

    print("\nGrowth of soft_rank fwd+VJP per 10x in n (np.argsort's own growth in brackets):")
    growth_ok = []
    for n in sizes:
        if 10 * n in rank_time:
            g = rank_time[10 * n][0] / rank_time[n][0]
            g_ref = rank_time[10 * n][1] / rank_time[n][1]
            growth_ok.append(g < TARGET_GROWTH)
            print(f"  {n:.0e} -> {10 * n:.0e}: {g:.1f} ({g_ref:.1f})")

    print("\nAcceptance targets:")
    if 10**6 in rank_time:
        ratio = rank_time[10**6][0] / rank_time[10**6][1]
        verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
        print(
            f"  soft_rank fwd+VJP at n = 1e6 <= {TARGET_RATIO:g} x argsort: {ratio:.2f} x "
            f"-> {verdict}"
        )
    else:
        print(f"  soft_rank fwd+VJP at n = 1e6 <= {TARGET_RATIO:g} x argsort: not run (--max-n)")
    if growth_ok:
        verdict = "PASS" if all(growth_ok) else "FAIL"
        print(f"  growth per 10x in n below {TARGET_GROWTH:g}, every decade: {verdict}")
        lo, hi = min(rank_time), max(rank_time)
        decades = np.log10(hi / lo)
        mean = (rank_time[hi][0] / rank_time[lo][0]) ** (1 / decades)
        mean_ref = (rank_time[hi][1] / rank_time[lo][1]) ** (1 / decades)
        verdict = "PASS" if mean < TARGET_GROWTH else "FAIL"
        print(
            f"  growth per 10x in n below {TARGET_GROWTH:g}, mean over {lo:.0e} -> {hi:.0e}: "
            f"{mean:.1f} (np.argsort {mean_ref:.1f}) -> {verdict}"
        )
        print(
            "  soft_rank fwd+VJP / argsort by n: "
            + ", ".join(f"{n:.0e}: {t / t_ref:.2f}" for n, (t, t_ref) in sorted(rank_time.items()))
        )
    else:
        print(f"  growth per 10x in n below {TARGET_GROWTH:g}: not run (needs two sizes)")
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
