"""Overhead of the PyTorch bridge, as ratios to calling the core directly in the same run.

Run from the repository root::

    python benchmarks/bench_torch.py [--repeats R]

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
as a ratio to ``core``. Target: ``torch`` within 1.3 x ``core``. A report, not a test.
"""

from __future__ import annotations

import argparse

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
