"""GPU forward + backward of soft_topk and soft_rank against ``torch.sort`` on the same tensor.

Run on a machine with a CUDA GPU, from the repository root::

    python benchmarks/bench_gpu.py [--repeats R] [--dtype float32|float64]

Shapes (along the last axis): a batch of 4096 x 1000 (many short rows: one block per row) and
one row of 1e7 (one long row: 9766 blocks per scan, whose carries take two more levels). For
each it times, with ``torch.cuda.synchronize()`` before starting and before stopping every
timing:

* ``torch.sort``: the hard floor, ``torch.sort(x, dim=-1)``;
* ``soft_rank``: ``softorder.bridges.torch.soft_rank(x, alpha)`` then ``.backward(v)``;
* ``soft_topk``: ``soft_topk(x, k = n / 10, alpha)`` then ``.backward(v)``;

and prints best-of-R times (interleaved rounds, ``softorder._timing.best_times``) and the
ratio to ``torch.sort``. ``--device cpu`` runs the same script on CPU tensors (a smoke test
of the script; the figures are the CPU kernels'). A report, not a test.
"""

from __future__ import annotations

import argparse
import sys

import torch

import softorder.bridges.torch as sot
from softorder._timing import best_times

ALPHA = 0.1
SHAPES = {"4096 x 1000": (4096, 1000), "1 x 1e7": (1, 10_000_000)}
QUICK_SHAPES = {"64 x 100": (64, 100), "1 x 1e4": (1, 10_000)}


def _synchronized(fn, device: torch.device):
    """``fn`` with the device synchronized before and after (GPU work is asynchronous)."""
    if device.type != "cuda":
        return fn

    def run():
        torch.cuda.synchronize(device)
        fn()
        torch.cuda.synchronize(device)

    return run


def _calls(x: torch.Tensor, v: torch.Tensor) -> dict:
    n = x.shape[-1]

    def hard_sort():
        torch.sort(x, dim=-1)

    def rank():
        leaf = x.detach().requires_grad_()
        sot.soft_rank(leaf, ALPHA).backward(v)

    def topk():
        leaf = x.detach().requires_grad_()
        sot.soft_topk(leaf, n / 10.0, ALPHA).backward(v)

    return {"torch.sort": hard_sort, "soft_rank fwd+bwd": rank, "soft_topk fwd+bwd": topk}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA device here; run it on a machine with a GPU")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    rows_out = []
    print(f"{args.dtype} on {device}, alpha = {ALPHA}, best of {args.repeats} (ms)")
    for label, shape in (QUICK_SHAPES if args.quick else SHAPES).items():
        x = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        v = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        calls = _calls(x, v)
        times = best_times([_synchronized(c, device) for c in calls.values()], args.repeats)
        floor = times[0]
        cells = "  ".join(
            f"{name} {t * 1e3:9.3f} ({t / floor:5.2f}x)"
            for name, t in zip(calls, times, strict=True)
        )
        print(f"{label:>12}: {cells}")
        rows_out.append(dict(zip(calls, times, strict=True)) | {"shape": label})
    return rows_out


if __name__ == "__main__":
    main()
