"""Latency: the first call (empty and warm numba cache), import times and per-call floors.

Run from the repository root::

    python benchmarks/bench_latency.py [--quick] [--ops soft_rank,soft_topk] [--apis numpy,torch]

Every figure of issue 14's table, each measured as users meet it:

* **first call, empty cache**: a fresh interpreter with a fresh, empty ``NUMBA_CACHE_DIR``
  imports the API, then times one forward + backward of one row of 1000 (float64): the
  NumPy API (``softorder.vjp`` and its pullback), the torch bridge (``.sum().backward()``) and
  the JAX bridge (``jax.jit(jax.grad(...))``). Wall time and the process's CPU time are both
  printed: on a busy machine the CPU time is what a quiet one would see as wall time.
* **first call, warm cache**: the same, in a second fresh interpreter with the cache the first
  one filled.
* **import**: ``import softorder`` in a fresh interpreter, and what ``import
  softorder.bridges.torch`` / ``softorder.bridges.jax`` add after ``import torch`` /
  ``import jax`` (best of 3 interpreters).
* **per-call floor**: forward + backward of each operation (but ``soft_permutation``, whose
  n x n output is no floor) at one row of n = 1e2 and 1e3, and at batches of rows of 1e2
  (1 x 100 and 256 x 100: a training step's class scores) through each API on one thread,
  best of R interleaved repeats (``softorder._timing.best_times``), with ``np.argsort`` of
  the same data (along the last axis) as the yardstick.

``--cold-repeats R`` repeats each first-call pair R times and prints the least of each figure
(on a busy machine other processes only ever add to them); ``--cold-repeats 0`` skips them.
``--quick`` (what the tests run) measures ``soft_rank`` through the NumPy API only, cold and
warm, the import of ``softorder`` and the NumPy floors of ``soft_rank`` and ``soft_topk``, with
few repeats. A report, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

from softorder._precompile import OPERATIONS, _arguments

# One forward + backward of ``op`` through ``api`` in a fresh interpreter, timed after the
# imports; prints a JSON line.
CHILD = textwrap.dedent(
    """
    import json, sys, time
    api, op = sys.argv[1], sys.argv[2]
    wall, cpu = time.perf_counter(), time.process_time()
    import numpy as np
    from softorder._precompile import _arguments
    if api == "torch":
        import torch
        import softorder.bridges.torch as mod
    elif api == "jax":
        import jax
        import softorder.bridges.jax as mod
    else:
        import softorder as mod
    imported_wall, imported_cpu = time.perf_counter(), time.process_time()
    x = np.random.default_rng(0).standard_normal((1, 1000))
    args = list(_arguments(op, x))
    fn = getattr(mod, op)
    if api == "numpy":
        out, pullback = mod.vjp(fn, *args)
        pullback(np.ones_like(out))
    elif api == "torch":
        args = [torch.tensor(a) if isinstance(a, (np.ndarray, list)) else a for a in args]
        args[0].requires_grad_(True)
        fn(*args).sum().backward()
    else:
        args = [jax.numpy.asarray(a) if isinstance(a, (np.ndarray, list)) else a for a in args]
        grad = jax.jit(jax.grad(lambda u: fn(u, *args[1:]).sum()))
        jax.block_until_ready(grad(args[0]))
    print(json.dumps({
        "import_wall": imported_wall - wall,
        "first_wall": time.perf_counter() - imported_wall,
        "first_cpu": time.process_time() - imported_cpu,
    }))
    """
)

IMPORT = textwrap.dedent(
    """
    import json, sys, time
    before = sys.argv[1]
    if before:
        __import__(before)
    start = time.perf_counter()
    __import__(sys.argv[2])
    print(json.dumps({"seconds": time.perf_counter() - start}))
    """
)


def _child(code: str, args: list[str], env: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _best(runs: list[dict]) -> dict:
    """The least of each figure over repeated runs (a busy machine only ever adds)."""
    return {key: min(run[key] for run in runs) for key in runs[0]}


def first_calls(ops, apis, repeats: int = 1) -> list[tuple]:
    """(api, op, cold dict, warm dict) for each pair, each in fresh interpreters; with
    ``repeats``, the least of each figure over that many cold and warm pairs; none with 0.
    """
    rows = []
    if repeats == 0:
        return rows
    for api in apis:
        for op in ops:
            colds, warms = [], []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory() as cache:
                    env = {"NUMBA_CACHE_DIR": cache, "JAX_PLATFORMS": "cpu"}
                    colds.append(_child(CHILD, [api, op], env))
                    warms.append(_child(CHILD, [api, op], env))
            cold, warm = _best(colds), _best(warms)
            rows.append((api, op, cold, warm))
            print(
                f"first call  {api:5s} {op:26s} empty cache {cold['first_wall']:6.2f} s "
                f"(CPU {cold['first_cpu']:5.2f} s)   warm cache {warm['first_wall']:5.2f} s "
                f"(CPU {warm['first_cpu']:4.2f} s)",
                flush=True,
            )
    return rows


def import_times(apis) -> dict:
    """Best of 3 fresh interpreters: ``import softorder``, and each bridge after its framework."""
    cases = {"softorder": ("", "softorder")}
    if "torch" in apis:
        cases["softorder.bridges.torch after torch"] = ("torch", "softorder.bridges.torch")
    if "jax" in apis:
        cases["softorder.bridges.jax after jax"] = ("jax", "softorder.bridges.jax")
    out = {}
    for label, (before, module) in cases.items():
        env = {"JAX_PLATFORMS": "cpu"}
        out[label] = min(_child(IMPORT, [before, module], env)["seconds"] for _ in range(3))
        print(f"import      {label:40s} {out[label]:.3f} s", flush=True)
    return out


#: Shapes of the per-call floors and their labels: one row of 1e2 and 1e3, and batches of rows
#: of 1e2 (one row with a batch axis, and 256 rows: class scores in a training step).
FLOOR_SHAPES = {"n=100": (100,), "1x100": (1, 100), "256x100": (256, 100), "n=1000": (1000,)}


def floors(ops, apis, repeats: int) -> dict:
    """Forward + backward of each operation at each of :data:`FLOOR_SHAPES` (float64, one
    thread), microseconds; the ratio is to ``np.argsort`` of the same data (along the last
    axis).
    """
    import softorder
    from softorder._precompile import _host_sort
    from softorder._timing import best_times

    _host_sort()  # a steady state's floors: the packed sort a long-running process compiles
    calls, labels = [], []
    for tag, shape in FLOOR_SHAPES.items():
        n = shape[-1]
        x = np.random.default_rng(0).standard_normal(shape)
        calls.append(lambda x=x: np.argsort(x, axis=-1))
        labels.append(f"np.argsort {tag}")
        for op in (op for op in ops if op != "soft_permutation"):
            # soft_topk at k = n/10, the others as precompile calls them (alpha 0.5 last)
            extra = ((x, n // 10, 0.5) if op == "soft_topk" else _arguments(op, x))[1:-1]
            fn = getattr(softorder, op)
            v = np.ones_like(fn(x, *extra, 0.5))

            def numpy_call(fn=fn, x=x, v=v, extra=extra):
                _, pullback = softorder.vjp(fn, x, *extra, 0.5)
                return pullback(v)

            calls.append(numpy_call)
            labels.append(f"numpy {op} {tag}")
            if "torch" in apis:
                import torch

                import softorder.bridges.torch as sot

                torch.set_num_threads(1)
                xt, vt = torch.from_numpy(x), torch.from_numpy(v)
                top = getattr(sot, op)
                tensors = tuple(torch.from_numpy(e) if type(e) is np.ndarray else e for e in extra)

                def torch_call(top=top, xt=xt, vt=vt, extra=tensors):
                    xg = xt.detach().requires_grad_(True)
                    return torch.autograd.grad(top(xg, *extra, 0.5), xg, vt)

                calls.append(torch_call)
                labels.append(f"torch {op} {tag}")
            if "jax" in apis:
                import jax

                import softorder.bridges.jax as soj

                jop = getattr(soj, op)
                xj, vj = jax.numpy.asarray(x), jax.numpy.asarray(v)
                grad = jax.jit(
                    jax.grad(lambda u, jop=jop, vj=vj, e=extra: (jop(u, *e, 0.5) * vj).sum())
                )

                def jax_call(grad=grad, xj=xj):
                    return jax.block_until_ready(grad(xj))

                calls.append(jax_call)
                labels.append(f"jax   {op} {tag}")
    previous = softorder.core.set_parallel(False)
    try:
        times = best_times(calls, repeats)
    finally:
        softorder.core.set_parallel(previous)
    out = {}
    for label, t in zip(labels, times, strict=True):
        out[label] = t * 1e6
        tag = label.rsplit(" ", 1)[1]
        ratio = t / times[labels.index(f"np.argsort {tag}")]
        print(f"floor       {label:40s} {t * 1e6:8.1f} us  ({ratio:5.1f}x np.argsort)")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="soft_rank, NumPy API only")
    parser.add_argument("--ops", default=",".join(OPERATIONS))
    parser.add_argument("--apis", default="numpy,torch,jax")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--cold-repeats",
        type=int,
        default=1,
        help="fresh-process pairs per first-call row; the least of each figure is printed "
        "(0: no first-call rows)",
    )
    args = parser.parse_args(argv)
    ops = ("soft_rank",) if args.quick else tuple(args.ops.split(","))
    apis = ("numpy",) if args.quick else tuple(args.apis.split(","))
    repeats = 20 if args.quick else args.repeats
    if args.cold_repeats < 0:
        parser.error("--cold-repeats must be 0 or more")
    for name in ops:
        if name not in OPERATIONS:
            parser.error(f"unknown operation {name!r}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return {
        "first_calls": first_calls(ops, apis, args.cold_repeats),
        "imports": import_times(apis),
        "floors": floors(("soft_rank", "soft_topk") if args.quick else ops, apis, repeats),
    }


if __name__ == "__main__":
    main()
