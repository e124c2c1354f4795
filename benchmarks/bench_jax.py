"""Speed of the JAX bridge, as ratios measured in one run.

Run from the repository root::

    python benchmarks/bench_jax.py

Options: ``--repeats R`` (default 5), ``--no-ott`` to skip ott-jax, ``--ott-kwargs`` (default
none: ott's defaults), ``--ott-float32`` (see below), ``--ott-timeout S`` (default 300),
``--floor-only`` and ``--sizes`` (one table each, below).
A quick run: ``--repeats 1 --ott-timeout 60``.

What it measures (``time.perf_counter``; every callable runs once first, so JAX compiles and
numba loads its kernels; each time is the best (min) of R interleaved repeats, 10 R for the
single rows): the forward and backward pass of ``soft_rank``, as
``value_and_grad(lambda x: sum(soft_rank(x) * w))`` with seeded standard normal float32 data
``x`` and weights ``w``, on one row of n = 1e4, on a batch of 256 x 1000 (ranked along the
last axis) and on one row of n = 1e3 (where ott-jax finishes), for

* the JAX bridge, ``jax.jit`` compiled (``softorder.bridges.jax.soft_rank``, alpha = 0.1);
  on the batch also ``jax.vmap`` over the rows of an unbatched call, which must cost the
  same (one batched callback);
* the core called directly through the NumPy API: ``softorder.vjp(softorder.soft_rank, x,
  alpha)`` and then the pullback with ``w`` (the bridge's overhead is the difference);
* ``ott.tools.soft_sort.ranks`` (ott-jax, Sinkhorn; optional), ``jax.jit`` compiled, on the
  same data with its defaults (``num_targets = n``, implicit differentiation). It runs in a
  child process with a time limit, because it can exhaust memory (an n x n transport plan
  per row, more when unrolled) or run for minutes; a failure or a timeout is reported in the
  table instead of a time (a timeout as a lower bound of the ratio). ott runs in float64
  (``jax_enable_x64`` in its child process only), because in float32 its implicit
  differentiation fails: the linear solve returns NaN (``--ott-float32`` shows it;
  ``--ott-kwargs implicit_diff=None`` backpropagates through the unrolled Sinkhorn
  iterations instead, which needs tens of GB for the batch). When ott-jax is not installed
  the rows are skipped.

Ratios are to the bridge in the same run; they, not absolute times, compare across machines.
The script is a report, not a test: it always exits with 0.

A second table gives the per-call floor at small sizes: ``jax.jit(jax.grad(...))`` of every
operation (``soft_topk`` with k = 10, ``soft_quantile`` at q = 0.3 and at q = 0.25, 0.5, 0.75,
the losses on one row, their labels and ranks constants of the step: traced ones take the same
route) on one row of n = 1e2 and 1e3, through the bridge's default route on
the CPU (the FFI route where it covers the call: see :mod:`softorder.bridges.jax`), through
``buffer_callback`` (the CPU kernels in place: the other calls' default, and every
operation's with a traced ``k`` or ``q``) and through ``pure_callback``
(``_IN_PLACE = False``), against the NumPy API's forward + VJP, as ratios to the NumPy API.
Each call takes the next of 16 different inputs: sorting the same row over and over lets the
branch predictor learn it, which flatters comparison sorts. ``--floor-only`` prints only this table.

``--sizes`` prints instead a third table: ``jax.jit(jax.grad(...))`` of ``soft_rank``,
``soft_sort`` and ``soft_topk`` (k = 10) on one row of n = 1e2 to 1e6, float32 and float64
(``jax_enable_x64``), through the FFI route and through ``buffer_callback``, against the NumPy
API's forward + VJP: process CPU time (the calls run on the calling thread), best of
interleaved repeats (fewer at large n), each call on the next of a few different inputs. For
one thread as in the docs: ``NUMBA_NUM_THREADS=1 XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1"``.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numba
import numpy as np

import softorder
import softorder.bridges.jax as soj
from softorder._timing import best_times

ALPHA = 0.1
CASES = (  # (name, shape, repeat factor); the small row is where ott-jax still runs in seconds
    ("one row", (10**4,), 10),
    ("batch", (256, 1000), 1),
    ("small row", (1000,), 10),
)


def bridge_step(w):
    @jax.jit
    def step(x):
        return jax.value_and_grad(lambda x: jnp.sum(soj.soft_rank(x, ALPHA) * w))(x)

    return step


def vmapped_bridge_step(w):
    def row_loss(x, w):
        return jnp.sum(soj.soft_rank(x, ALPHA) * w)

    @jax.jit
    def step(x):
        return jax.vmap(jax.value_and_grad(row_loss))(x, w)

    return step


def ott_child(path, kwargs_text, repeats, x64):
    """Time ott's ranks on the data saved at ``path``; print one line: seconds or an error."""
    if x64:
        jax.config.update("jax_enable_x64", True)
    from ott.tools.soft_sort import ranks

    data = np.load(path)
    dtype = jnp.float64 if x64 else jnp.float32
    x, w = jnp.asarray(data["x"], dtype=dtype), jnp.asarray(data["w"], dtype=dtype)
    kwargs = parse_kwargs(kwargs_text)

    @jax.jit
    def step(x):
        return jax.value_and_grad(lambda x: jnp.sum(ranks(x, **kwargs) * w))(x)

    try:
        _, grad = jax.block_until_ready(step(x))
        if not bool(jnp.all(jnp.isfinite(grad))):
            print("error: NaN gradients")
            return
        (t,) = best_times([lambda: jax.block_until_ready(step(x))], repeats)
    except Exception as error:  # noqa: BLE001 - reported, not raised: the table goes on
        print(f"error: {type(error).__name__}: {str(error).splitlines()[0][:80]}")
        return
    print(f"seconds: {t!r}")


def time_ott(x, w, args, repeats):
    """(seconds or None, note) of ott's ranks, measured in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.npz")
        np.savez(path, x=x, w=w)
        command = [sys.executable, __file__, "--ott-child", path, "--repeats", str(repeats)]
        command += ["--ott-kwargs", args.ott_kwargs]
        command += ["--ott-float32"] if args.ott_float32 else []
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=args.ott_timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return None, f"timed out after {args.ott_timeout:g} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:80]
        return None, f"failed (exit {done.returncode}: {tail})"
    if lines[-1].startswith("seconds: "):
        return float(lines[-1].split(": ", 1)[1]), ""
    return None, lines[-1]


#: the rows of the floor table: (operation and what differs, extra arguments before alpha, as
#: JAX / NumPy)
FLOOR_OPS = (
    ("soft_rank", (), ()),
    ("soft_topk", (10,), (10,)),
    ("soft_sort", (), ()),
    ("soft_quantile q=0.3", (0.3,), (0.3,)),
    ("soft_quantile 3 q", (jnp.array([0.25, 0.5, 0.75]),), (np.array([0.25, 0.5, 0.75]),)),
    ("soft_permutation", (), ()),
    ("topk_cross_entropy", "labels", "labels"),
    ("permutation_cross_entropy", "ranks", "ranks"),
)
#: the bridge's routes on the CPU: (column, _FFI_CALLS, _IN_PLACE)
ROUTES = (
    ("JAX default", "auto", True),
    ("JAX buffer_callback", False, True),
    ("JAX pure_callback", False, False),
)


def floor_table(repeats):
    """The per-call floor at n = 1e2 and 1e3: the bridge's routes and the NumPy API."""
    import itertools

    rng = np.random.default_rng(20250102)
    print(f"per-call floor, float32, alpha = {ALPHA}, best of {repeats} interleaved repeats\n")
    columns = " | ".join(f"{label} us" for label, _, _ in ROUTES)
    print(f"| operation | n | {columns} | NumPy API us | default/NumPy |")
    print("|---|---:|" + "---:|" * (len(ROUTES) + 2))
    for n in (100, 1000):
        inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(16)]
        w_np = rng.standard_normal(n).astype(np.float32)
        w = jnp.asarray(w_np)
        for label, extra, extra_np in FLOOR_OPS:
            name = label.split()[0]
            if extra == "labels":  # a loss of one row: the labels' class among n
                extra, extra_np = (jnp.array([3]), [0.5, 0.5]), (np.array([3]), [0.5, 0.5])
            elif extra == "ranks":
                ranks = rng.permutation(n)[None] + 1
                extra, extra_np = (jnp.asarray(ranks),), (ranks,)
            loss_op = "cross_entropy" in name
            bridge, numpy_op = getattr(soj, name), getattr(softorder, name)
            host = [x[None] if loss_op else x for x in inputs]

            def loss(x, bridge=bridge, extra=extra, w=w, loss_op=loss_op):
                out = bridge(x, *extra, ALPHA)
                weights = w[: out.shape[-1]] if out.ndim else w[0]  # (one quantile: a scalar)
                return jnp.sum(out) if loss_op else jnp.sum(out * weights)

            steps = []
            for _, ffi, in_place in ROUTES:
                soj._FFI_CALLS, soj._IN_PLACE = ffi, in_place  # read when the step is traced
                step = jax.jit(jax.grad(loss))
                step(jnp.asarray(host[0])).block_until_ready()
                steps.append(step)
            soj._FFI_CALLS, soj._IN_PLACE = "auto", True
            device_inputs = itertools.cycle([jnp.asarray(x) for x in host])
            host_inputs = itertools.cycle(host)

            out = numpy_op(host[0], *extra_np, ALPHA)  # the JAX loss's cotangent, below
            out = np.asarray(out)
            v = w_np[: out.shape[-1]] if out.ndim else w_np[0]
            v = 1.0 if loss_op else np.broadcast_to(v, out.shape).copy()

            def numpy_call(numpy_op=numpy_op, extra=extra_np, inputs=host_inputs, v=v):
                _, pullback = softorder.vjp(numpy_op, next(inputs), *extra, ALPHA)
                return pullback(v)

            calls = [
                lambda step=step, inputs=device_inputs: step(next(inputs)).block_until_ready()
                for step in steps
            ]
            *times, t_numpy = best_times([*calls, numpy_call], repeats)
            cells = " | ".join(f"{t * 1e6:.1f}" for t in times)
            print(f"| {label} | {n} | {cells} | {t_numpy * 1e6:.1f} | {times[0] / t_numpy:.2f} |")
    print()


def sizes_table(repeats):
    """The FFI route, ``buffer_callback`` and the NumPy API on one row of n = 1e2 .. 1e6."""
    import itertools
    import time

    rng = np.random.default_rng(20250103)
    print(f"one row, alpha = {ALPHA}, CPU time, best of interleaved repeats (at most {repeats})\n")
    print(
        "| operation | dtype | n | FFI route us | buffer_callback us | NumPy API us "
        "| FFI/NumPy | callback/NumPy |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in ("soft_rank", "soft_sort", "soft_topk"):
        bridge, numpy_op = getattr(soj, name), getattr(softorder, name)
        extra = (10,) if name == "soft_topk" else ()
        for dtype in ("float32", "float64"):
            for n in (10**2, 10**3, 10**4, 10**5, 10**6):
                rounds = max(3, min(repeats, 10**7 // n))
                host = [rng.standard_normal(n).astype(dtype) for _ in range(8 if n < 10**5 else 3)]
                w_np = rng.standard_normal(n).astype(dtype)
                with jax.enable_x64(dtype == "float64"):
                    w = jnp.asarray(w_np)
                    steps = []
                    for ffi in ("auto", False):
                        soj._FFI_CALLS = ffi  # read when the step is traced

                        def loss(x, bridge=bridge, extra=extra, w=w):
                            return jnp.sum(bridge(x, *extra, ALPHA) * w)

                        step = jax.jit(jax.grad(loss))
                        step(jnp.asarray(host[0])).block_until_ready()
                        steps.append(step)
                    soj._FFI_CALLS = "auto"
                    device_inputs = itertools.cycle([jnp.asarray(x) for x in host])
                    host_inputs = itertools.cycle(host)

                    def numpy_call(numpy_op=numpy_op, extra=extra, inputs=host_inputs, w=w_np):
                        return softorder.vjp(numpy_op, next(inputs), *extra, ALPHA)[1](w)

                    calls = [
                        lambda step=step, inputs=device_inputs: step(
                            next(inputs)
                        ).block_until_ready()
                        for step in steps
                    ]
                    ffi, callback, t_numpy = best_times(
                        [*calls, numpy_call], rounds, clock=time.process_time
                    )
                print(
                    f"| {name} | {dtype} | {n:.0e} | {ffi * 1e6:.0f} | {callback * 1e6:.0f} "
                    f"| {t_numpy * 1e6:.0f} | {ffi / t_numpy:.2f} | {callback / t_numpy:.2f} |"
                )
    print()


def core_call(x, w):
    def run():
        _, pullback = softorder.vjp(softorder.soft_rank, x, ALPHA)
        return pullback(w)

    return run


def blocking(step, x):
    return lambda: jax.block_until_ready(step(x))


def parse_kwargs(text):
    kwargs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        kwargs[key.strip()] = ast.literal_eval(value.strip())
    return kwargs


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="best of R repeats (default 5)")
    parser.add_argument("--no-ott", action="store_true", help="skip ott-jax")
    parser.add_argument(
        "--ott-kwargs",
        default="",
        help="keyword arguments of ott.tools.soft_sort.ranks, e.g. 'implicit_diff=None'",
    )
    parser.add_argument("--ott-float32", action="store_true", help="run ott in float32")
    parser.add_argument(
        "--ott-timeout", type=float, default=300.0, help="seconds per ott case (default 300)"
    )
    parser.add_argument(
        "--floor-only", action="store_true", help="only the per-call floor at n = 1e2, 1e3"
    )
    parser.add_argument(
        "--sizes",
        action="store_true",
        help="only the table of one row of n = 1e2 .. 1e6 (FFI route, buffer_callback, NumPy)",
    )
    parser.add_argument("--ott-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.ott_child:
        ott_child(args.ott_child, args.ott_kwargs, args.repeats, not args.ott_float32)
        return 0
    use_ott = False
    ott_note = "ott-jax skipped (--no-ott)"
    if not args.no_ott:
        try:
            import ott
        except ImportError as error:
            ott_note = f"ott-jax skipped (not importable: {error})"
        else:
            use_ott = True
            precision = "float32" if args.ott_float32 else "float64"
            call = f"ranks(x, {args.ott_kwargs})" if args.ott_kwargs else "ranks(x)"
            ott_note = f"ott-jax {ott.__version__}: {call} in {precision}"

    print(
        f"softorder {softorder.__version__}, jax {jax.__version__} ({jax.default_backend()}), "
        f"numpy {np.__version__}, numba {numba.__version__} ({numba.get_num_threads()} threads), "
        f"Python {platform.python_version()}, {platform.machine()}"
    )
    if args.sizes:
        sizes_table(args.repeats * 40)
        return 0
    floor_table(args.repeats * 40)
    if args.floor_only:
        return 0
    print(
        f"soft_rank forward + backward, float32, alpha = {ALPHA}; best of {args.repeats} "
        f"repeats (x10 for one row); {ott_note}\n"
    )

    rng = np.random.default_rng(20250101)
    rows = []  # (data, method, time or None, bridge time, note)
    for case, shape, factor in CASES:
        x_np = rng.standard_normal(shape).astype(np.float32)
        w_np = rng.standard_normal(shape).astype(np.float32)
        x, w = jnp.asarray(x_np), jnp.asarray(w_np)
        calls = [
            ("JAX bridge, jit", blocking(bridge_step(w), x)),
            ("core via NumPy API (softorder.vjp)", core_call(x_np, w_np)),
        ]
        if len(shape) > 1:
            calls.append(("JAX bridge, jit + vmap over rows", blocking(vmapped_bridge_step(w), x)))
        times = best_times([call for _, call in calls], args.repeats * factor)
        data = f"{case} ({' x '.join(str(s) for s in shape)})"
        for (name, _), t in zip(calls, times, strict=True):
            rows.append((data, name, t, times[0], ""))
        if use_ott:
            t, note = time_ott(x_np, w_np, args, args.repeats * factor)
            rows.append((data, "ott-jax soft_sort.ranks, jit", t, times[0], note))

    print("| data | method | time ms | ratio to JAX bridge |")
    print("|---|---|---:|---:|")
    for data, name, t, t_ref, note in rows:
        if t is None:
            bound = f"> {args.ott_timeout / t_ref:.0f}" if note.startswith("timed out") else "-"
            print(f"| {data} | {name} | {note} | {bound} |")
        else:
            print(f"| {data} | {name} | {t * 1e3:.3f} | {t / t_ref:.2f} |")
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
