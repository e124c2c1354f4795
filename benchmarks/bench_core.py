"""Core speed and memory report of softorder, as ratios to ``np.argsort`` measured in one run.

Run from the repository root::

    python benchmarks/bench_core.py

Options: ``--repeats R`` (default 5), ``--max-n N`` (default 1e6; e.g. ``--max-n 1e4`` for a
quick run), ``--no-memory`` (skip the memory table), ``--memory-only`` (only the memory table),
``--threads T`` (default 1: the targets are single-threaded).

Time: forward + VJP (``softorder.vjp(op, x, ...)`` then ``pullback(cotangent)``) of every
operation of the targets table on one float64 row of seeded standard normal data
(n = 1e4, 1e5, 1e6) and on a 256 x 1000 float32 batch (rows along the last axis), alpha =
0.1, each divided by the time of ``np.argsort`` of the same data. Each time is the best (min)
of R interleaved repeats (10 R at n <= 1e4, min(R, 3) at n = 1e6): machine noise hits the
calls of one size alike. The clock is the calling thread's CPU time by default
(``--clock cpu``; with one thread every kernel runs on it), so that other processes on a busy
machine do not count; ``--clock wall`` uses ``time.perf_counter``. Every callable is called
once first (numba compiles or loads its kernels).

Memory: extra peak resident memory of one forward + VJP at n = 1e6, divided by the input's
bytes, float32 and float64, each operation in a fresh subprocess: the peak (``VmHWM`` after
resetting it through ``/proc/self/clear_refs``) minus the resident size just before the call,
with the input and the cotangent already allocated and the kernels already compiled, and
glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``) so that the warm-up call leaves no
resident heap behind for the measured call to reuse. tracemalloc would not see numba's
allocations. Linux only; skipped elsewhere. With torchsort installed, its soft_rank and
soft_sort (forward and ``torch.autograd.grad`` on one row, regularization ``ALPHA``) are peer
rows of the table, measured alike: softorder's soft_rank and soft_sort must not need more.

``--memory-profile LABEL DTYPE`` shows where one operation's bytes go (n = 1e6, one process):
at every kernel call of forward + VJP, the NumPy arrays alive (``tracemalloc``: every array's
memory is NumPy's, the kernels' fast paths allocate nothing large of their own) in bytes per
element of the row, each with the line of softorder that allocated it and the rule's line that
led there; the call at which the most is alive is the peak's profile (the caller's input and
cotangent, allocated before, are not counted, as in the memory table).

Targets (issue 13): time ratio <= 3 everywhere, memory ratio <= 8 (float32) and <= 16
(float64). The script prints PASS / FAIL per row and always exits with 0: it is a report,
not a test.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import linecache
import os
import platform
import subprocess
import sys
import time
import tracemalloc

import numba
import numpy as np

import softorder
from softorder._precompile import _host_sort
from softorder._timing import best_times

ALPHA = 0.1
SIZES = (10**4, 10**5, 10**6)
BATCH_SHAPE = (256, 1000)
MEMORY_N = 10**6
TARGET_RATIO = 3.0
TARGET_MEMORY = {"float32": 8.0, "float64": 16.0}
SEED = 20250101

#: (label, function, extra positional arguments for a row of length n)
OPERATIONS = (
    ("soft_rank", softorder.soft_rank, lambda n: ()),
    ("soft_topk k=5", softorder.soft_topk, lambda n: (5,)),
    ("soft_topk k=n/10", softorder.soft_topk, lambda n: (max(1, n // 10),)),
    ("log_soft_topk k=n/10", softorder.log_soft_topk, lambda n: (max(1, n // 10),)),
    ("soft_sort", softorder.soft_sort, lambda n: ()),
    ("soft_quantile 3q", softorder.soft_quantile, None),
    ("topk_cross_entropy K=5", softorder.topk_cross_entropy, None),
    ("permutation_cross_entropy", softorder.permutation_cross_entropy, None),
)


def arguments(label, x, rng):
    """Positional arguments after ``x`` of the operation ``label`` for the input ``x``."""
    n = x.shape[-1]
    if label.startswith("topk_cross_entropy"):
        labels = rng.integers(0, n, size=x.shape[:-1])
        return (labels, np.full(5, 0.2))
    if label.startswith("permutation_cross_entropy"):
        return (np.argsort(np.argsort(rng.standard_normal(x.shape), axis=-1), axis=-1) + 1,)
    if label.startswith("soft_quantile"):
        return (np.array([0.1, 0.5, 0.9]).reshape((1,) * (x.ndim - 1) + (3,)),)
    fn_args = dict((name, extra) for name, _, extra in OPERATIONS)[label]
    return fn_args(n)


def forward_vjp(label, x, rng):
    """A callable running operation ``label`` forward and its pullback once."""
    fn = dict((name, f) for name, f, _ in OPERATIONS)[label]
    args = arguments(label, x, rng)
    out = fn(x, *args, alpha=ALPHA)
    cotangent = np.asarray(rng.standard_normal(np.shape(out)), dtype=np.asarray(out).dtype)

    def run():
        _, pullback = softorder.vjp(fn, x, *args, alpha=ALPHA)
        return pullback(cotangent)

    return run


def repeats_for(n, repeats):
    if n <= 10**4:
        return 10 * repeats
    if n >= 10**6:
        return max(1, min(repeats, 3))
    return repeats


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


#: peers of the memory table (issue 13: soft_rank and soft_sort within torchsort's memory):
#: label -> torchsort's function, on one row (a batch of one) at regularization ``ALPHA``
MEMORY_PEERS = {"torchsort soft_rank": "soft_rank", "torchsort soft_sort": "soft_sort"}


def _peer_forward_backward(label, x, rng):
    """:func:`forward_vjp` of the peer ``label``: forward and ``torch.autograd.grad`` with a
    random cotangent (the leaf that requires grad is a copy made before, as the input).
    """
    import torch
    import torchsort

    fn = getattr(torchsort, MEMORY_PEERS[label])
    leaf = torch.from_numpy(x.reshape(1, -1)).clone().requires_grad_(True)
    cotangent = torch.from_numpy(rng.standard_normal(leaf.shape).astype(x.dtype))

    def run():
        out = fn(leaf, regularization_strength=ALPHA)
        return torch.autograd.grad(out, leaf, cotangent)

    return run


def memory_child(label, dtype, n):
    """Extra peak bytes of one forward + VJP (run in a fresh process)."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal(n).astype(dtype)
    if label in MEMORY_PEERS:
        run = _peer_forward_backward(label, x, rng)
    else:
        run = forward_vjp(label, x, rng)
    run()  # compiles or loads the kernels
    # the scratch the warm-up call left for the next (softorder.set_scratch_limit) goes too:
    # the measured call's peak counts the scratch it takes
    softorder.set_scratch_limit(softorder.set_scratch_limit(0))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status_kib("VmRSS")
    run()
    peak = _status_kib("VmHWM")
    return (peak - before) * 1024, x.nbytes


#: tracemalloc's domain of NumPy's array memory
_NUMPY_DOMAIN = 389047


def _live_arrays(n: int) -> list[tuple[float, str]]:
    """``(bytes per element of a row of n, where softorder allocated it)`` of every NumPy
    allocation alive now of at least 1 byte per 100 elements, largest first.
    """
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.DomainFilter(True, _NUMPY_DOMAIN)]
    )
    found = []
    for trace in snapshot.traces:
        if trace.size * 100 < n:
            continue
        # the line that allocated it, and the rule's line that led there (the innermost line
        # of the rules that is not a helper's return of what it allocated: Context.work)
        frames = [
            (f, linecache.getline(f.filename, f.lineno).strip())
            for f in reversed(trace.traceback)
            if "softorder" in f.filename
        ]
        rule = [
            (f, src)
            for f, src in frames
            if f.filename.endswith("rules.py") and not src.startswith("return ")
        ]
        shown = frames[:1] + [fs for fs in rule[:1] if fs[0] is not frames[0][0]]
        where = " | ".join(
            f"{f.filename.rsplit('softorder/', 1)[-1]}:{f.lineno} {src[:50]}" for f, src in shown
        )
        found.append((trace.size / n, where or "(allocated outside softorder)"))
    return sorted(found, reverse=True)


def _kernels():
    """``(module, name)`` of every CPU kernel (``softorder.core._jit.kernel``: a function with
    a ``serial`` dispatcher) that softorder's CPU modules expose: the rules and the kernels'
    Python wrappers look them up there at each call.
    """
    modules = [softorder.core] + [
        m
        for name, m in sorted(sys.modules.items())
        if name.startswith("softorder.core.") and ".cuda" not in name and m is not None
    ]
    return [
        (m, name)
        for m in modules
        for name, value in vars(m).items()
        if callable(getattr(value, "serial", None))
    ]


def _resident() -> int | None:
    """Resident bytes of this process (``VmRSS``), ``None`` where /proc is not there."""
    try:
        return _status_kib("VmRSS") * 1024
    except OSError:
        return None


def memory_profile(label, dtype, n):
    """Print the NumPy arrays alive at every kernel call of one forward + VJP (see the
    module's docstring) and return the steps as ``[(kernel, [(bytes per element, where)],
    resident)]``: ``resident`` is ``(at the call, after it)``, the extra resident bytes per
    element (``None`` off Linux). Arrays are counted whole; the resident figures count the
    pages written (a kernel may write part of its scratch only).
    """
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal(n).astype(dtype)
    run = forward_vjp(label, x, rng)
    run()  # compiles or loads the kernels
    softorder.set_scratch_limit(softorder.set_scratch_limit(0))
    steps = []
    wrapped = []
    base = [0]

    def resident():
        now = _resident()
        return None if now is None else (now - base[0]) / n

    def watch(module, name, kernel):
        @functools.wraps(kernel)
        def call(*args, **kwargs):
            arrays, entry = _live_arrays(n), resident()
            try:
                return kernel(*args, **kwargs)
            finally:
                after = resident()
                both = None if entry is None else (entry, after)
                steps.append((f"{module.__name__.split('.')[-1]}.{name}", arrays, both))

        return call

    seen = set()
    for module, name in _kernels():
        kernel = getattr(module, name)
        if (module.__name__, name) in seen:
            continue
        seen.add((module.__name__, name))
        wrapped.append((module, name, kernel))
        setattr(module, name, watch(module, name, kernel))
    gc.collect()
    tracemalloc.start(64)
    base[0] = _resident() or 0
    try:
        result = run()
        now = resident()
        steps.append(
            (
                "(after the pullback, the gradients held)",
                _live_arrays(n),
                None if now is None else (now, now),
            )
        )
        del result
    finally:
        tracemalloc.stop()
        for module, name, kernel in wrapped:
            setattr(module, name, kernel)
    itemsize = np.dtype(dtype).itemsize
    print(f"{label}, {dtype}, n = {n:.0e}: NumPy arrays alive at each kernel call, in bytes per")
    print(f"element (input: {itemsize}); x input = their sum over the input's bytes; resident:")
    print("the process's extra resident bytes per element at the call and after it\n")
    peak = max(range(len(steps)), key=lambda i: sum(b for b, _ in steps[i][1]))
    for i, (kernel, arrays, both) in enumerate(steps):
        total = sum(b for b, _ in arrays)
        mark = "  <- the most alive" if i == peak else ""
        where = "" if both is None else f" (resident {both[0]:.1f} -> {both[1]:.1f})"
        print(f"{kernel}: {total:.1f} B/element = {total / itemsize:.2f} x input{where}{mark}")
        for b, at in arrays:
            print(f"    {b:5.1f}  {at}")
    return steps


def memory_peers() -> list[str]:
    """The labels of :data:`MEMORY_PEERS` whose package is installed."""
    import importlib.util

    return list(MEMORY_PEERS) if importlib.util.find_spec("torchsort") else []


def memory_ratios(n, peers=()):
    """``{(label, dtype): extra peak / input bytes}`` of the operations and ``peers``, one
    subprocess each.
    """
    out = {}
    for label in [name for name, _, _ in OPERATIONS] + list(peers):
        for dtype in ("float32", "float64"):
            cmd = [sys.executable, __file__, "--memory-child", label, dtype, str(n)]
            # A fixed mmap threshold: glibc otherwise raises it after the warm-up call frees
            # its large arrays, and the measured call then reuses resident heap pages.
            env = dict(os.environ, NUMBA_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if res.returncode != 0:
                out[label, dtype] = float("nan")
                print(f"memory of {label} {dtype} failed:\n{res.stderr}", file=sys.stderr)
                continue
            extra, nbytes = json.loads(res.stdout.strip().splitlines()[-1])
            out[label, dtype] = extra / nbytes
    return out


def print_times(sizes_txt, argsort_ms, ratios, misses):
    """The time table; misses of the target go to ``misses``."""
    print("fwd+VJP time / np.argsort time (np.argsort ms in the header)\n")
    print("| operation | " + " | ".join(f"{s} ({argsort_ms[s]:.2f} ms)" for s in sizes_txt) + " |")
    print("|---|" + "---:|" * len(sizes_txt))
    for label, _, _ in OPERATIONS:
        cells = []
        for s in sizes_txt:
            r = ratios[label, s]
            cells.append(f"{r:.2f}")
            if r > TARGET_RATIO:
                misses.append(f"{label} at {s}: {r:.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="best of R repeats (default 5)")
    parser.add_argument(
        "--max-n",
        type=lambda s: int(float(s)),
        default=10**6,
        help="largest row length, among 1e4, 1e5, 1e6 (default 1e6)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    parser.add_argument(
        "--memory-only", action="store_true", help="only the memory table (no timing)"
    )
    parser.add_argument("--threads", type=int, default=1, help="numba threads (default 1)")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the calling thread's CPU time (default; with one thread every kernel runs "
        "on it, and other processes on a busy machine do not count); wall: perf_counter",
    )
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--memory-profile",
        nargs=2,
        metavar=("LABEL", "DTYPE"),
        help="the NumPy arrays alive at each kernel call of one forward + VJP of the "
        "operation LABEL (e.g. soft_sort) in DTYPE (float32 or float64), n = 1e6",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.memory_only and args.no_memory:
        parser.error("--memory-only and --no-memory exclude each other")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.memory_child:
        label, dtype, n = args.memory_child
        print(json.dumps(memory_child(label, dtype, int(n))))
        return 0
    if args.memory_profile:
        label, dtype = args.memory_profile
        if label not in [name for name, _, _ in OPERATIONS]:
            names = ", ".join(name for name, _, _ in OPERATIONS)
            sys.exit(f"--memory-profile: unknown operation {label!r}; one of: {names}")
        if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            # the memory table's allocator setting (memory_ratios), for its resident figures
            env = dict(os.environ, NUMBA_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
            cmd = [sys.executable, __file__, "--memory-profile", label, dtype]
            return subprocess.run(cmd, env=env, check=False).returncode
        numba.set_num_threads(1)
        memory_profile(label, np.dtype(dtype).name, MEMORY_N)
        return 0
    if args.clock == "cpu" and args.threads > 1:
        sys.exit("--clock cpu measures the calling thread only: use --clock wall with --threads")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    previous_parallel = softorder.core.set_parallel(args.threads > 1)
    sizes = [n for n in SIZES if n <= args.max_n]
    rng = np.random.default_rng(SEED)

    softorder.soft_rank(np.zeros(2))
    # the host's packed sort, which a process compiles only once its sorts have paid for it:
    # the table times a process in its steady state, as softorder.precompile() leaves it
    _host_sort()
    print(
        f"softorder {softorder.__version__}, numpy {np.__version__}, numba {numba.__version__}"
        f" ({numba.threading_layer()}, {numba.get_num_threads()} threads), "
        f"Python {platform.python_version()}, {platform.machine()}"
    )
    print(
        f"alpha = {ALPHA}; fwd+VJP = softorder.vjp + pullback; best of {args.repeats} "
        f"interleaved repeats (x10 at n = 1e4, at most 3 at n = 1e6), {args.clock} clock\n"
    )

    cases = [(f"{n:.0e}", rng.standard_normal(n), repeats_for(n, args.repeats)) for n in sizes]
    batch = rng.standard_normal(BATCH_SHAPE).astype(np.float32)
    cases.append(("256 x 1000", batch, args.repeats))
    if args.memory_only:
        cases = []
    ratios = {}  # (label, size) -> ratio
    argsort_ms = {}
    for size, x, repeats in cases:
        calls = [forward_vjp(label, x, rng) for label, _, _ in OPERATIONS]
        times = best_times([lambda x=x: np.argsort(x, axis=-1)] + calls, repeats, clock)
        argsort_ms[size] = times[0] * 1e3
        for (label, _, _), t in zip(OPERATIONS, times[1:], strict=True):
            ratios[label, size] = t / times[0]

    sizes_txt = [size for size, _, _ in cases]
    misses = []
    if cases:
        print_times(sizes_txt, argsort_ms, ratios, misses)
    memory = args.memory_only or not args.no_memory
    if memory and sys.platform.startswith("linux") and args.max_n >= MEMORY_N:
        print(f"\nExtra peak memory of fwd+VJP / input bytes, n = {MEMORY_N:.0e} (subprocesses)\n")
        peers = memory_peers()
        mem = memory_ratios(MEMORY_N, peers)
        print("| operation | float32 | float64 |")
        print("|---|---:|---:|")
        for label in [name for name, _, _ in OPERATIONS] + peers:
            cells = []
            for dtype in ("float32", "float64"):
                r = mem[label, dtype]
                cells.append(f"{r:.1f}")
                if label not in MEMORY_PEERS and not r <= TARGET_MEMORY[dtype]:
                    misses.append(f"{label} memory {dtype}: {r:.1f}")
            print(f"| {label} (peer) | " if label in MEMORY_PEERS else f"| {label} | ", end="")
            print(" | ".join(cells) + " |")
        for op in ("soft_rank", "soft_sort"):  # issue 13: no more than torchsort's
            peer = f"torchsort {op}"
            for dtype in ("float32", "float64") if peer in peers else ():
                if not mem[op, dtype] <= mem[peer, dtype]:
                    misses.append(
                        f"{op} memory {dtype} above torchsort's: {mem[op, dtype]:.1f} > "
                        f"{mem[peer, dtype]:.1f}"
                    )

    print(
        f"\nTargets: time <= {TARGET_RATIO:g} x np.argsort; memory <= "
        f"{TARGET_MEMORY['float32']:g} x input (float32), {TARGET_MEMORY['float64']:g} x "
        "(float64)"
    )
    if misses:
        print("FAIL: " + "; ".join(misses))
    else:
        print("PASS: every row")
    softorder.core.set_parallel(previous_parallel)
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
