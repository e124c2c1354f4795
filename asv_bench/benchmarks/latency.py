"""Per-call floor: forward + backward of one small row, or of a batch of small rows, through
each API, on one thread.

At n = 1e2 the kernels take a few microseconds; what is left is each API's fixed cost
(argument checks, layout, allocation, autograd or callbacks), which decides small training
steps (256 x 100 class scores: :class:`BatchedPerCallFloor`). ``benchmarks/bench_latency.py``
prints the same figures next to ``np.argsort``, plus the first-call and import times that asv
cannot measure (they need fresh processes).
"""

import numpy as np

from ._common import (
    ALPHA,
    SEED,
    _Base,
    _jax_callables,
    cotangent_like,
    make_input,
    require,
    torch,
)

OPS = (
    "soft_rank",
    "soft_topk",
    "soft_sort",
    "soft_quantile",
    "topk_cross_entropy",
    "permutation_cross_entropy",
)


def _extra(op: str, shape: tuple) -> tuple:
    """The arguments of ``op`` between the input of ``shape`` and alpha: k = n/10, the median,
    a label and a two-entry ``p_k`` per row, or a random permutation per row.
    """
    batch, n = shape[:-1], shape[-1]
    if op == "soft_topk":
        return (n // 10,)
    if op == "soft_quantile":
        return (0.5,)
    if op == "topk_cross_entropy":
        return (np.zeros(batch, dtype=np.int64), [0.5, 0.5])
    if op == "permutation_cross_entropy":
        noise = np.random.default_rng(SEED).standard_normal(shape)
        return (np.argsort(noise, axis=-1) + 1,)
    return ()


def _numpy_callables(op: str, x, extra: tuple) -> tuple:
    """Forward and forward + backward (``softorder.vjp`` and its pullback) of ``op`` on ``x``."""
    softorder = require("softorder")
    fn = getattr(softorder, op)
    v = cotangent_like(fn(x, *extra, ALPHA))

    def forward_backward():
        _, pullback = softorder.vjp(fn, x, *extra, ALPHA)
        return pullback(v)

    return lambda: fn(x, *extra, ALPHA), forward_backward


def _torch_callables(op: str, x, extra: tuple) -> tuple:
    """Forward (no grad) and forward + ``torch.autograd.grad`` of the torch bridge's ``op`` on
    ``x``, PyTorch set to one thread; the thread count to restore comes first.
    """
    torch_ = torch()
    fn = getattr(require("softorder.bridges.torch"), op)
    threads = torch_.get_num_threads()
    torch_.set_num_threads(1)
    xt = torch_.from_numpy(x)
    xg = xt.clone().requires_grad_(True)
    extra = tuple(torch_.from_numpy(e) if type(e) is np.ndarray else e for e in extra)
    v = torch_.from_numpy(cotangent_like(fn(xt, *extra, ALPHA).numpy()))

    def forward():
        with torch_.no_grad():
            return fn(xt, *extra, ALPHA)

    return threads, forward, lambda: torch_.autograd.grad(fn(xg, *extra, ALPHA), xg, v)


class PerCallFloor(_Base):
    """Forward + backward of one row (float64; JAX in its default float32), with PyTorch on
    one thread (one row always runs numba's kernels on the calling thread).
    """

    params = (OPS, ("numpy", "torch", "jax"), (100, 1_000))
    param_names = ("op", "api", "n")

    def setup(self, op, api, n):
        self._threads = None
        extra = _extra(op, (n,))
        if api == "numpy":
            self.prepare(*_numpy_callables(op, make_input("random", (n,)), extra))
        elif api == "torch":
            self._threads, *callables = _torch_callables(op, make_input("random", (n,)), extra)
            self.prepare(*callables)
        else:
            fn = getattr(require("softorder.bridges.jax"), op)
            x = make_input("random", (n,), "float32")
            self.prepare(*_jax_callables(lambda a: fn(a, *extra, ALPHA), x))

    def teardown(self, op, api, n):
        if self._threads is not None:
            torch().set_num_threads(self._threads)

    def time_forward(self, op, api, n):
        self.forward()

    def time_forward_backward(self, op, api, n):
        self.forward_backward()


#: Shapes of the batched floors: one row with a batch axis, and 256 rows of 1e2 (class scores
#: in a training step, issue 14).
BATCHED_SHAPES = ("1x100", "256x100")


class BatchedPerCallFloor(_Base):
    """Forward + backward of a batch of rows of 1e2 along the last axis (float64): what
    :class:`PerCallFloor` measures at one row, at a training step's size; on one thread
    (numba's kernels on the calling thread, PyTorch on one thread).
    """

    params = (OPS, ("numpy", "torch"), BATCHED_SHAPES)
    param_names = ("op", "api", "shape")

    def setup(self, op, api, shape):
        softorder = require("softorder")
        self._threads = None
        if api == "torch":  # (a skip before any setting changes: asv then skips teardown)
            torch(), require("softorder.bridges.torch")
        self._parallel = softorder.core.set_parallel(False)
        dims = tuple(int(s) for s in shape.split("x"))
        x, extra = make_input("random", dims), _extra(op, dims)
        if api == "numpy":
            self.prepare(*_numpy_callables(op, x, extra))
        else:
            self._threads, *callables = _torch_callables(op, x, extra)
            self.prepare(*callables)

    def teardown(self, op, api, shape):
        if self._threads is not None:
            torch().set_num_threads(self._threads)
        require("softorder").core.set_parallel(self._parallel)

    def time_forward(self, op, api, shape):
        self.forward()

    def time_forward_backward(self, op, api, shape):
        self.forward_backward()
