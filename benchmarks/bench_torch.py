"""Overhead of the PyTorch bridge, as ratios to calling the core directly in the same run.

Run from the repository root::

    python benchmarks/bench_torch.py [--repeats R] [--floor-only]

For ``soft_rank`` and ``soft_topk`` (k = n / 10), float32, alpha = 0.1, on one row of n = 1e4
and on a batch of 256 x 1000 (along the last axis), it times forward + backward:

* ``core``: the NumPy API, ``softorder.vjp(op, x, ...)`` then ``pullback(cotangent)``;
* ``torch``: ``softorder.bridges.torch``, the op on a tensor that requires grad, then
  ``out.backward(cotangent)``;
* ``torch.compile``: the same function compiled with ``torch.compile(fullgraph=True)``;
* ``torchsort``: ``torchsort.soft_rank`` (regularization "l2", strength 0.1) forward +
  backward on the same data, when torchsort is installed (it has no top-k);
* ``torch.sort``: the hard floor, ``torch.sort`` of the same tensor.

Each figure is the best of R interleaved repeats (``softorder._timing.best_times``), printed
as a ratio to ``core``. Target: ``torch`` within 1.3 x ``core``.

Then the per-call floor at small sizes (float64, one row of n = 1e2 and 1e3, one thread:
``torch.set_num_threads(1)``, numba kernels on the calling thread): for ``soft_rank`` and
``soft_topk`` forward + backward, the time of the NumPy API (``core``), of the bridge
(``torch``) and of ``np.argsort`` of the same row, each the best of R interleaved repeats of a
loop of calls, timed in thread CPU time (``time.thread_time``) so that a busy machine's other
processes weigh less. It prints the bridge's overhead over the NumPy API in microseconds
(target: at most 15 us) and the bridge's time as a multiple of ``np.argsort`` (target for
``soft_topk`` at 1 x 1e3: at most 10x). It also prints a minimal ``torch.autograd.Function``
around the same rule (``floor``), the least any autograd bridge costs, and PyTorch's own
``x * 1.0`` forward + backward on the same row (``mul``), the least any differentiable PyTorch
call costs through ``Tensor.backward``. ``--floor-only`` prints this table alone. A report, not a
test.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import softorder
import softorder.bridges.torch as sot
from softorder._timing import best_times

ALPHA = 0.1

try:
    import torchsort
except ImportError:  # optional peer
    torchsort = None


def _calls(name: str, x: np.ndarray, v: np.ndarray) -> dict:
    n = x.shape[-1]
    np_op, torch_op = getattr(softorder, name), getattr(sot, name)
    extra = (n / 10.0,) if name == "soft_topk" else ()
    xt, vt = torch.from_numpy(x), torch.from_numpy(v)

    def core():
        _, pullback = softorder.vjp(np_op, x, *extra, ALPHA)
        pullback(v)

    def bridge():
        leaf = xt.clone().requires_grad_()
        torch_op(leaf, *extra, ALPHA).backward(vt)

    compiled_op = torch.compile(lambda t: torch_op(t, *extra, ALPHA), fullgraph=True)

    def compiled():
        leaf = xt.clone().requires_grad_()
        compiled_op(leaf).backward(vt)

    calls = {"core": core, "torch": bridge, "torch.compile": compiled}
    if name == "soft_rank" and torchsort is not None:
        x2 = xt.reshape(-1, n)
        v2 = vt.reshape(-1, n)

        def peer():
            leaf = x2.clone().requires_grad_()
            torchsort.soft_rank(leaf, regularization_strength=ALPHA).backward(v2)

        calls["torchsort"] = peer
    calls["torch.sort"] = lambda: torch.sort(xt, dim=-1)
    return calls


def _best_per_call(calls: list, repeats: int, number: int = 30) -> list[float]:
    """Best thread CPU seconds per call of each callable, over interleaved loops of calls."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for j, call in enumerate(calls):
            start = time.thread_time()
            for _ in range(number):
                call()
            best[j] = min(best[j], (time.thread_time() - start) / number)
    return best


def _floor_function(rule, arguments: dict):
    """A minimal autograd.Function around ``rule``: what an autograd bridge cannot avoid."""

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(holder, x):
            holder.ctx = rule.prepare(x=x.detach().numpy(), **arguments)
            return torch.from_numpy(rule.forward(holder.ctx))

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.holder = inputs[0]

        @staticmethod
        def backward(ctx, cotangent):
            return None, torch.from_numpy(rule.vjp(ctx.holder.ctx, cotangent.numpy())[0])

    return Floor


class _Holder:
    ctx = None


def per_call_floor(repeats: int) -> None:
    """Print the bridge's fixed cost per forward + backward at 1 x 1e2 and 1 x 1e3."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = np.random.default_rng(1)
    print(f"\nper-call floor, float64, one row, one thread; best of {repeats} (thread CPU time)")
    print(
        f"{'operation':10s} {'shape':>7s} {'core us':>8s} {'torch us':>9s} {'floor us':>9s}"
        f" {'mul us':>7s} {'overhead us':>12s} {'torch/argsort':>14s}"
    )
    try:
        for n in (100, 1000):
            x = rng.normal(size=(1, n))
            v = rng.normal(size=(1, n))
            xt, vt = torch.from_numpy(x), torch.from_numpy(v)
            for name in ("soft_rank", "soft_topk"):
                np_op, torch_op = getattr(softorder, name), getattr(sot, name)
                extra = (n / 10.0,) if name == "soft_topk" else ()
                arguments = {"alpha": ALPHA, "axis": -1}
                if name == "soft_topk":
                    arguments.update(k=n / 10.0, largest=True)
                else:
                    arguments.update(descending=False)
                floor = _floor_function(np_op.rule, arguments)

                def core(np_op=np_op, extra=extra, x=x, v=v):
                    _, pullback = softorder.vjp(np_op, x, *extra, ALPHA)
                    pullback(v)

                def bridge(torch_op=torch_op, extra=extra, xt=xt, vt=vt):
                    leaf = xt.detach().requires_grad_()
                    torch_op(leaf, *extra, ALPHA).backward(vt)

                def minimal(floor=floor, xt=xt, vt=vt):
                    leaf = xt.detach().requires_grad_()
                    # (the C apply, as the bridge calls it: Function.apply binds arguments)
                    super(torch.autograd.Function, floor).apply(_Holder(), leaf).backward(vt)

                def argsort(x=x):
                    np.argsort(x[0])

                def mul(xt=xt, vt=vt):
                    leaf = xt.detach().requires_grad_()
                    (leaf * 1.0).backward(vt)

                t_core, t_torch, t_floor, t_argsort, t_mul = _best_per_call(
                    [core, bridge, minimal, argsort, mul], repeats
                )
                print(
                    f"{name:10s} {'1x' + str(n):>7s} {t_core * 1e6:8.1f} {t_torch * 1e6:9.1f}"
                    f" {t_floor * 1e6:9.1f} {t_mul * 1e6:7.1f} {(t_torch - t_core) * 1e6:12.1f}"
                    f" {t_torch / t_argsort:13.1f}x"
                )
    finally:
        torch.set_num_threads(threads)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--floor-only", action="store_true", help="the per-call floor alone")
    args = parser.parse_args(argv)
    if args.floor_only:
        per_call_floor(args.repeats)
        return 0
    rng = np.random.default_rng(0)
    print(f"torch {torch.__version__}, torchsort {'present' if torchsort else 'absent'}")
    print(f"{'operation':10s} {'shape':>11s} {'core ms':>8s}  ratios to core")
    for shape in [(10_000,), (256, 1000)]:
        x = rng.normal(size=shape).astype(np.float32)
        v = rng.normal(size=shape).astype(np.float32)
        for name in ["soft_rank", "soft_topk"]:
            calls = _calls(name, x, v)
            times = dict(zip(calls, best_times(list(calls.values()), args.repeats), strict=True))
            ratios = "  ".join(f"{k} {t / times['core']:.2f}x" for k, t in times.items())
            shape_text = "x".join(map(str, shape))
            print(f"{name:10s} {shape_text:>11s} {times['core'] * 1e3:8.3f}  {ratios}")
    per_call_floor(args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
