"""Benchmark plots for the docs: time and peak memory against n, log-log, one line per method.

Run from the repository root (about 10-15 minutes on a 2-core machine)::

    python asv_bench/plot.py                 # n = 1e2 .. 1e6, writes docs/_static/bench/
    python asv_bench/plot.py --max-n 1e4     # a quick look

This is its own harness, not asv's results: it imports the asv benchmark classes
(``asv_bench/benchmarks``), calls their ``setup`` (seeded data, JIT warm-up) and times the same
``forward`` / ``forward_backward`` callables the asv benchmarks time, so the plots and the asv
suite measure the same thing. It does not need asv, a machine file or a results database, and
it measures what asv's ``peakmem_`` cannot: the *extra* peak resident memory of one call (asv
reports the whole process, imported frameworks included).

* Time: the best (min) over repeats of the mean of ``number`` calls, with ``number`` chosen so
  that one repeat lasts at least 20 ms, at most 7 repeats or about 1 s per size (1 repeat for
  calls over a second).
* Memory: the peak resident set size during one forward + backward call minus the resident
  set size just before it (Linux: the peak is reset through ``/proc/self/clear_refs``). Each
  method runs in its own process, sizes ascending, with ``MALLOC_MMAP_THRESHOLD_=65536`` so
  freed buffers are returned to the system and not silently reused. Resolution is a page;
  values under 64 KiB are drawn at 64 KiB.
* Every method gets the same seeded float32 row (standard normal), alpha = 0.1 for softorder
  (regularization 0.1 for torchsort, defaults for the others); the hard floors are
  ``np.sort`` and ``torch.sort`` / ``torch.topk`` of the same row.

Outputs (in ``--out``, default ``docs/_static/bench``): one PNG per family (``rank.png``,
``topk.png``, ``sort.png``, ``permutation.png``, ``more.png``), ``results.json`` with every
number, and ``docs/benchmark_ratios.inc``, the table of ratios the docs include.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = (100, 1_000, 10_000, 100_000, 1_000_000)
MEMORY_FLOOR = 64 * 1024

# Each figure: softorder methods, peers and floors. A method is (label, "module.Class",
# params) where "n" in params stands for the size.
NUMPY = "softorder (NumPy)"
TORCH = "softorder (PyTorch)"
JAX = "softorder (JAX, jit)"
FIGURES = {
    "rank": {
        "title": "soft rank",
        "softorder": [
            (NUMPY, "rank.SoftRank", ("n", "float32")),
            (TORCH, "rank.TorchSoftRank", ("n", "float32")),
            (JAX, "rank.JaxSoftRank", ("n", "float32")),
        ],
        "peers": [
            ("torchsort.soft_rank", "rank.TorchsortSoftRank", ("n", "float32")),
            ("ott-jax soft_sort.ranks", "rank.OttSoftRank", ("n",)),
        ],
        "floors": [
            ("np.sort", "hard.NumpySort", ("n", "float32")),
            ("np.argsort", "hard.NumpyArgsort", ("n", "float32")),
            ("torch.sort", "hard.TorchSort", ("n", "float32")),
        ],
    },
    "topk": {
        "title": "soft top-k (k = n/10)",
        "softorder": [
            (NUMPY, "topk.SoftTopk", ("n", "float32")),
            (TORCH, "topk.TorchSoftTopk", ("n", "float32")),
            (JAX, "topk.JaxSoftTopk", ("n", "float32")),
        ],
        "peers": [
            ("difftopk DiffTopkNet", "topk.DifftopkSoftTopk", ("n",)),
            ("ott-jax soft_sort.topk_mask", "topk.OttTopkMask", ("n",)),
        ],
        "floors": [
            ("np.sort", "hard.NumpySort", ("n", "float32")),
            ("np.argsort", "hard.NumpyArgsort", ("n", "float32")),
            ("torch.topk", "hard.TorchTopk", ("n", "float32")),
        ],
    },
    "sort": {
        "title": "soft sort",
        "softorder": [
            (NUMPY, "sort.SoftSort", ("n", "float32")),
            (TORCH, "sort.TorchSoftSort", ("n", "float32")),
            (JAX, "sort.JaxSoftSort", ("n", "float32")),
        ],
        "peers": [
            ("torchsort.soft_sort", "sort.TorchsortSoftSort", ("n", "float32")),
            ("diffsort DiffSortNet", "sort.DiffsortSoftSort", ("n", "float32")),
            ("ott-jax soft_sort.sort (fwd only)", "sort.OttSoftSort", ("n",)),
        ],
        "floors": [
            ("np.sort", "hard.NumpySort", ("n", "float32")),
            ("np.argsort", "hard.NumpyArgsort", ("n", "float32")),
            ("torch.sort", "hard.TorchSort", ("n", "float32")),
        ],
    },
    "permutation": {
        "title": "soft permutation matrix (n x n output)",
        "softorder": [
            (NUMPY, "permutation.SoftPermutation", ("n", "float32")),
            (TORCH, "permutation.TorchSoftPermutation", ("n", "float32")),
        ],
        "peers": [
            ("NeuralSort (difftopk)", "permutation.NeuralSortPermutation", ("n",)),
            ("SoftSort (difftopk)", "permutation.SoftSortPermutation", ("n", "float32")),
        ],
        "floors": [
            ("np.sort", "hard.NumpySort", ("n", "float32")),
            ("np.argsort", "hard.NumpyArgsort", ("n", "float32")),
        ],
    },
    "more": {
        "title": "quantile, log top-k, permutation loss (NumPy)",
        "softorder": [
            ("soft_quantile (3 q)", "sort.SoftQuantile", ("n", "float32")),
            ("log_soft_topk", "topk.LogSoftTopk", ("n", "float32")),
            ("permutation_cross_entropy", "permutation.PermutationCrossEntropy", ("n", "float32")),
        ],
        "peers": [],
        "floors": [
            ("np.sort", "hard.NumpySort", ("n", "float32")),
            ("np.argsort", "hard.NumpyArgsort", ("n", "float32")),
        ],
        "separate": True,  # several operations, no bridges: each is compared with the floors
    },
}
#: The permutation matrices are n x n: sizes above this are not attempted.
PERMUTATION_MAX_N = 3_000


# ----------------------------------------------------------------------------- measuring


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def extra_peak_bytes(fn) -> int | None:
    """Peak resident memory of one call of ``fn`` above the resident memory before it (the
    kernel scratch softorder keeps for its next call freed first: the call counts its own).
    """
    limit = getattr(sys.modules.get("softorder"), "set_scratch_limit", None)
    if limit is not None:
        limit(limit(0))
    try:
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    fn()
    return max(0, _status_kib("VmHWM") - before) * 1024


def best_time(fn, max_repeats: int = 7, budget: float = 1.0) -> float:
    """Best mean time per call over a few repeats (the callable is already warm)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    number = max(1, int(0.02 / max(first, 1e-9)))
    times = [first]
    begin = time.perf_counter()
    while len(times) < max_repeats and time.perf_counter() - begin < budget:
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return min(times)


def measure(name: str, params: list, sizes: list[int]) -> list[dict]:
    """Set up ``name`` (``module.Class``) at each size and measure it (in this process)."""
    sys.path.insert(0, str(HERE))
    import importlib

    module_name, class_name = name.split(".")
    cls = getattr(importlib.import_module(f"benchmarks.{module_name}"), class_name)
    rows = []
    for n in sizes:
        args = [n if p == "n" else p for p in params]
        bench = cls()
        try:
            bench.setup(*args)
        except NotImplementedError as exc:
            rows.append({"n": n, "skipped": str(exc)})
            continue
        row = {"n": n, "forward": best_time(bench.forward)}
        row["forward_memory"] = extra_peak_bytes(bench.forward)
        fb = getattr(bench, "forward_backward", None)
        if fb is not None:
            row["forward_backward"] = best_time(fb)
            row["forward_backward_memory"] = extra_peak_bytes(fb)
        rows.append(row)
        print(json.dumps({"progress": name, **row}), file=sys.stderr, flush=True)
        del bench
    return rows


def run_method(name: str, params: tuple, sizes: list[int]) -> list[dict]:
    """Measure one method in a fresh process (isolated memory, framework state and JIT)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    command = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--measure",
        name,
        "--params",
        json.dumps(list(params)),
        "--sizes",
        ",".join(str(n) for n in sizes),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        print(result.stderr[-3000:], file=sys.stderr)
        return [{"n": n, "skipped": f"failed: {result.stderr.strip()[-300:]}"} for n in sizes]
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- plotting


def plot_family(key: str, spec: dict, results: dict, out: pathlib.Path) -> None:
    """One PNG per family: forward time, forward + backward time, extra peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("forward", "forward time [s]"),
        ("forward_backward", "forward + backward time [s]"),
        ("forward_backward_memory", "extra peak memory, forward + backward [bytes]"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.4), layout="constrained")
    styles = (
        [(m, {"lw": 2.2, "marker": "o"}) for m in spec["softorder"]]
        + [(m, {"lw": 1.4, "marker": "s"}) for m in spec["peers"]]
        + [
            (m, {"lw": 1.2, "ls": ls, "color": "k"})
            for m, ls in zip(spec["floors"], ("--", ":", "-."), strict=False)
        ]
    )
    for ax, (field, ylabel) in zip(axes, panels, strict=True):
        for (label, name, _), style in styles:
            rows = [r for r in results.get(name, []) if "skipped" not in r]
            key_field = field
            if field == "forward_backward_memory" and name.startswith("hard."):
                key_field = "forward_memory"  # the floors have no backward
            elif field == "forward_backward" and name.startswith("hard."):
                key_field = "forward"
            pts = [(r["n"], r.get(key_field)) for r in rows if r.get(key_field) is not None]
            if field.endswith("memory"):
                pts = [(n, max(v, MEMORY_FLOOR)) for n, v in pts]
            if not pts:
                continue
            floor_note = " (floor)" if name.startswith("hard.") else ""
            ax.plot(*zip(*pts, strict=True), label=label + floor_note, **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("n (one row, float32)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=4, fontsize=9)
    fig.suptitle(spec["title"])
    fig.savefig(out / f"{key}.png", dpi=90)
    plt.close(fig)


def ratio_table(results: dict, sizes: list[int]) -> str:
    """An RST table: forward + backward time of each peer and of the hard sort, relative to
    softorder (NumPy) on the same data. Above 1: softorder is faster; for the floor, the
    ratio is softorder / floor (how many hard sorts softorder costs).
    """
    show = [n for n in (1_000, 10_000, 100_000, 1_000_000) if n in sizes]
    header = ["operation", "compared with"] + [f"n = 1e{len(str(n)) - 1}" for n in show]
    lines = []

    def times(name, field="forward_backward"):
        out = {}
        for r in results.get(name, []):
            if "skipped" not in r:
                out[r["n"]] = r.get(field) or r.get("forward")
        return out

    def cells(num, den, digits=1):
        return [f"{num[n] / den[n]:.{digits}f}x" if n in num and n in den else "--" for n in show]

    for spec in FIGURES.values():
        if spec.get("separate"):
            for label, name, _ in spec["softorder"]:
                mine = times(name)
                for floor_label, floor_name, _ in spec["floors"]:
                    floor = times(floor_name, "forward")
                    row = [label, f"softorder / {floor_label} (floor)", *cells(mine, floor)]
                    lines.append(row)
            continue
        mine = times(spec["softorder"][0][1])
        if not mine:
            continue
        for label, name, _ in spec["peers"]:
            lines.append([spec["title"], f"{label}: peer / softorder", *cells(times(name), mine)])
        for label, name, _ in spec["softorder"][1:]:
            lines.append([spec["title"], f"{label}: bridge / NumPy", *cells(times(name), mine, 2)])
        for label, name, _ in spec["floors"]:
            floor = times(name, "forward")
            lines.append([spec["title"], f"softorder / {label} (floor)", *cells(mine, floor)])
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]

    def fmt(row):
        return "   ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    rule = "   ".join("=" * w for w in widths)
    return "\n".join([rule, fmt(header), rule, *map(fmt, lines), rule]) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-n", type=lambda s: int(float(s)), default=10**6)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "_static" / "bench")
    parser.add_argument(
        "--table", type=pathlib.Path, default=ROOT / "docs" / "benchmark_ratios.inc"
    )
    parser.add_argument("--only", nargs="*", help="figure keys to (re)measure", default=None)
    parser.add_argument("--replot", action="store_true", help="plot results.json, no timing")
    parser.add_argument(
        "--missing", action="store_true", help="measure only methods not in results.json"
    )
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.measure:  # child process
        sizes = [int(s) for s in args.sizes.split(",")]
        print(json.dumps(measure(args.measure, json.loads(args.params), sizes)))
        return 0

    sizes = [n for n in SIZES if n <= args.max_n]
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "results.json"
    data = json.loads(store.read_text()) if store.exists() else {"results": {}}
    results = data["results"]
    if not args.replot:
        keys = args.only or list(FIGURES)
        done = set()
        for key in keys:
            spec = FIGURES[key]
            for label, name, params in spec["softorder"] + spec["peers"] + spec["floors"]:
                if name in done or (args.missing and name in results):
                    continue
                done.add(name)
                todo = sizes
                if key == "permutation" and not name.startswith("hard."):
                    todo = [n for n in sizes if n <= PERMUTATION_MAX_N]
                print(f"measuring {name} ({label}) at n = {todo}", file=sys.stderr, flush=True)
                results[name] = run_method(name, params, todo)
        data["machine"] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
        store.write_text(json.dumps(data, indent=1) + "\n")
    for key, spec in FIGURES.items():
        plot_family(key, spec, results, args.out)
    args.table.write_text(ratio_table(results, sizes))
    print(args.table.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
