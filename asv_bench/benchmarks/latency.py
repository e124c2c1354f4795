"""Per-call floor: forward + backward of one small row, or of a batch of small rows, through
each API, on one thread.

At n = 1e2 the kernels take a few microseconds; what is left is each API's fixed cost
(argument checks, layout, allocation, autograd or callbacks), which decides small training
steps (256 x 100 class scores: :class:`BatchedPerCallFloor`). ``benchmarks/bench_latency.py``
prints the same figures next to ``np.argsort``, plus the first-call and import times that asv
cannot measure (they need fresh processes).
"""

from ._common import ALPHA, _Base, _jax_callables, cotangent_like, make_input, require, torch

OPS = ("soft_rank", "soft_topk", "soft_sort")


def _extra(op: str, n: int) -> tuple:
    return (n // 10,) if op == "soft_topk" else ()


class PerCallFloor(_Base):
    """Forward + backward of one row (float64; JAX in its default float32), with PyTorch on
    one thread (one row always runs numba's kernels on the calling thread).
    """

    params = (OPS, ("numpy", "torch", "jax"), (100, 1_000))
    param_names = ("op", "api", "n")

    def setup(self, op, api, n):
        softorder = require("softorder")
        self._threads = None
        extra = _extra(op, n)
        if api == "numpy":
            fn = getattr(softorder, op)
            x = make_input("random", (n,))
            v = cotangent_like(fn(x, *extra, ALPHA))

            def forward_backward():
                _, pullback = softorder.vjp(fn, x, *extra, ALPHA)
                return pullback(v)

            self.prepare(lambda: fn(x, *extra, ALPHA), forward_backward)
        elif api == "torch":
            torch_ = torch()
            sot = require("softorder.bridges.torch")
            self._threads = torch_.get_num_threads()
            torch_.set_num_threads(1)
            fn = getattr(sot, op)
            xt = torch_.from_numpy(make_input("random", (n,)))
            xg = xt.clone().requires_grad_(True)
            v = torch_.from_numpy(cotangent_like(fn(xt, *extra, ALPHA).numpy()))

            def forward():
                with torch_.no_grad():
                    return fn(xt, *extra, ALPHA)

            self.prepare(forward, lambda: torch_.autograd.grad(fn(xg, *extra, ALPHA), xg, v))
        else:
            soj = require("softorder.bridges.jax")
            fn = getattr(soj, op)
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
            torch_, sot = torch(), require("softorder.bridges.torch")
        self._parallel = softorder.core.set_parallel(False)
        dims = tuple(int(s) for s in shape.split("x"))
        extra = _extra(op, dims[-1])
        x = make_input("random", dims)
        if api == "numpy":
            fn = getattr(softorder, op)
            v = cotangent_like(fn(x, *extra, ALPHA))

            def forward_backward():
                _, pullback = softorder.vjp(fn, x, *extra, ALPHA)
                return pullback(v)

            self.prepare(lambda: fn(x, *extra, ALPHA), forward_backward)
        else:
            self._threads = torch_.get_num_threads()
            torch_.set_num_threads(1)
            fn = getattr(sot, op)
            xt = torch_.from_numpy(x)
            xg = xt.clone().requires_grad_(True)
            v = torch_.from_numpy(cotangent_like(fn(xt, *extra, ALPHA).numpy()))

            def forward():
                with torch_.no_grad():
                    return fn(xt, *extra, ALPHA)

            self.prepare(forward, lambda: torch_.autograd.grad(fn(xg, *extra, ALPHA), xg, v))

    def teardown(self, op, api, shape):
        if self._threads is not None:
            torch().set_num_threads(self._threads)
        require("softorder").core.set_parallel(self._parallel)

    def time_forward(self, op, api, shape):
        self.forward()

    def time_forward_backward(self, op, api, shape):
        self.forward_backward()
