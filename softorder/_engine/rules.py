"""How each public operation maps onto the core kernels: its forward pass and gradient products.

Everything here is routing: the mathematics is in :mod:`softorder.core`, the shapes in
:mod:`softorder._engine.layout`. Bridges reuse these rules.
"""

from __future__ import annotations

import numpy as np

from softorder import core
from softorder._engine import scratch
from softorder._engine.autodiff import Rule
from softorder._engine.backend import NUMPY
from softorder._engine.backends.numpy_host import runs_serially, serial_kernel, sum_over_rows
from softorder._engine.backends.protocol import Backend
from softorder._engine.checks import (
    LARGEST_FLOAT,
    SMALLEST_ALPHA,
    alpha_batch_shape,
    alpha_rows,
    check_alpha,
    check_flag,
    check_labels,
    check_p_k,
    check_reduction,
    check_target_ranks,
    label_rows,
    p_k_rows,
    target_rows,
)
from softorder._engine.layout import Rows, Targets

#: the dtypes the small calls' paths test for and view with (comparing a dtype with a dtype
#: object is cheaper than with a scalar type, and it happens on every small call)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_U8 = np.dtype(np.uint8)
_F32_MAX = float(np.finfo(np.float32).max)
_WIDE = (_F32, _F64)
_WIDE_SCALARS = (float, np.float64, np.float32)


def _kernel(ctx, fn):
    """The kernel ``fn`` of ``ctx.kernels`` as a call of ``ctx`` runs it: its serial dispatcher
    where its wrapper would choose that one (:func:`serial_kernel`), ``fn`` otherwise. For a
    kernel whose first argument is the sorted rows ``ctx.rows.xs`` (what :attr:`Context.serial`
    looks at).
    """
    return serial_kernel(fn) if ctx.serial else fn


class Context:
    """The validated arguments of one call (``params``) and what its forward pass saved
    (``saved``: arrays of shape ``(rows, width)``, the residuals a bridge keeps for the
    gradients).

    ``backend``, ``kernels`` (the kernels that run on this call's arrays: ``softorder.core``
    or its GPU twin), ``serial`` (whether the host kernels run on the calling thread for these
    rows whatever the parallel policy: :func:`_kernel`) and ``empty`` (``empty(shape,
    dtype=float64)``: an uninitialised array of the backend) are the backend's, looked up
    once: a small call reads them a dozen times.
    """

    __slots__ = (
        "rows",
        "alpha",
        "alpha_shape",
        "params",
        "saved",
        "alpha_wanted",
        "backend",
        "kernels",
        "serial",
        "empty",
    )

    def __init__(
        self,
        rows: Rows,
        alpha: np.ndarray,  # (rows,): alpha of each row
        alpha_shape: tuple,  # the shape the caller gave alpha, for its gradient
        alpha_wanted: bool = True,
    ) -> None:
        self.rows, self.alpha, self.alpha_shape = rows, alpha, alpha_shape
        self.params: dict = {}
        self.saved: dict = {}
        #: whether the rules' VJPs form alpha's gradient (a bridge that knows nobody asks for
        #: it, e.g. for an alpha given as a number, sets this false; the VJPs then give None)
        self.alpha_wanted = alpha_wanted
        backend = rows.backend
        self.backend: Backend = backend
        self.kernels = backend.kernels
        self.serial = backend is NUMPY and runs_serially(rows.xs.shape)
        # (np.empty itself on the host: the backend's method only calls it)
        self.empty = np.empty if backend is NUMPY else backend.empty

    @classmethod
    def of(cls, rows: Rows, alpha) -> Context:
        backend = rows.backend
        if (
            type(alpha) is float
            and SMALLEST_ALPHA <= alpha <= LARGEST_FLOAT  # (false for NaN)
            and rows.rows
            and backend is NUMPY
        ):  # one valid Python float for host rows: check_alpha's first case, inline
            per_row = np.empty(rows.rows)
            per_row.fill(alpha)
            return cls(rows, per_row, ())
        per_row, alpha_shape = check_alpha(alpha, rows.batch_shape, rows.layout.axis)
        return cls(rows, per_row if backend is NUMPY else backend.from_host(per_row), alpha_shape)

    def zeros(self, shape):
        return self.rows.backend.zeros(shape)

    def work(self, width: int, length: int | None = None) -> np.ndarray:
        """Scratch for one kernel call: (rows, width, length or n), uninitialised. Host
        scratch is a view of the thread's reused buffer (:mod:`softorder._engine.scratch`):
        it is never a result nor saved (a view kept alive keeps its region from later calls,
        which then allocate afresh).
        """
        rows = self.rows
        if length is None:
            length = rows.n
        if length < 1:
            length = 1
        shape = (rows.rows, width, length)
        if self.backend is NUMPY:
            if 8 * rows.rows * width * length >= scratch.MIN_BYTES:
                return scratch.take(shape)
            return np.empty(shape)
        return self.backend.empty(shape)

    def target_storage(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Arrays (rows, m) that the forward kernels fill with each target's ``(anchor,
        offset)``; saved in the context for the gradients.
        """
        shape = (self.rows.rows, m)
        saved = self.saved
        saved["anchor"] = anchor = self.empty(shape, _I64)
        saved["offset"] = offset = self.empty(shape)
        return anchor, offset

    def scalar(self, value) -> np.floating:
        return self.backend.to_result(value, self.rows.dtype)

    def alpha_grad(self, alpha_bar: np.ndarray) -> np.ndarray:
        """Per-row gradient of alpha -> gradient of the caller's alpha (its shape); ``None``
        when it is not wanted (:attr:`alpha_wanted`).
        """
        if not self.alpha_wanted:
            return None
        dtype = self.rows.dtype
        if not self.alpha_shape and self.backend is NUMPY:  # one alpha for every row
            # (sum_over_rows: unbroadcast's sum without its reshapes, most of a small call's
            # cost of this gradient; a sum within float32's range cannot overflow in the cast,
            # and rounds as the cast rounds it: no error state)
            total = sum_over_rows(alpha_bar, bool(self.rows.batch_shape))
            if dtype == _F64:
                return total
            if dtype == _F32 and abs(total) <= _F32_MAX:
                return _F32.type(total)
            return self.backend.to_result(total, dtype)
        if not self.alpha_shape and not self.rows.batch_shape:  # one row, one alpha
            return self.backend.to_result(alpha_bar.reshape(()), dtype)
        return self._alpha_grad_general(alpha_bar)

    def _alpha_grad_general(self, alpha_bar: np.ndarray) -> np.ndarray:
        """:meth:`alpha_grad` for any alpha and backend: the per-row gradients summed over the
        axes alpha was broadcast along, in the caller's dtype.
        """
        shaped = alpha_bar.reshape(self.rows.batch_shape)
        reduced = self.backend.unbroadcast(shaped, self._alpha_aligned()).reshape(self.alpha_shape)
        return self.backend.to_result(reduced, self.rows.dtype)

    def alpha_tangent(self, tangents: dict) -> np.ndarray:
        """The tangent of alpha once per row, as the kernels take it (0 when absent)."""
        if "alpha" not in tangents:
            return self.zeros(self.rows.rows)
        arr, _ = self.backend.float_input(tangents["alpha"], "tangent of alpha")
        if tuple(arr.shape) != self.alpha_shape:
            raise ValueError(
                f"the tangent of alpha must have alpha's shape {self.alpha_shape}; "
                f"got {tuple(arr.shape)}"
            )
        aligned = arr.reshape(self._alpha_aligned())
        return self.backend.broadcast_f64(aligned, self.rows.batch_shape).reshape(-1)

    def _alpha_aligned(self) -> tuple:
        """The shape of alpha lined up with the batch axes (keepdims alpha loses the axis)."""
        rows = self.rows
        return alpha_batch_shape(self.alpha_shape, len(rows.batch_shape), rows.layout.axis)


def _targets_to_user(ctx: Context, out, kind: str):
    """A (rows, m, ...) result of per-row targets in the caller's layout: with one target per
    row (no trailing axis in the argument) the m axis goes.
    """
    targets, rows = ctx.params["targets"], ctx.rows
    if not targets.multi:
        out = out.reshape((rows.rows,) + tuple(out.shape[2:]))  # m == 1: a contiguous reshape
    return rows.to_user(out, kind)


def _float32_cotangent(ctx: Context, cotangent, kind: str, core_shape: tuple):
    """A float32 host cotangent of a float32 input as ``(rows, *core_shape)`` float32 (a view
    where the layout allows), for a CPU kernel that reads float32 cotangents: 4 bytes per
    element instead of a float64 copy's 8. ``None`` for anything else, which
    :meth:`Rows.to_core_owned` converts (and checks: a wrong shape also gives ``None`` here).
    """
    rows = ctx.rows
    if rows.dtype != _F32 or type(cotangent) is not np.ndarray:
        return None
    if cotangent.dtype != _F32 or not isinstance(rows.xs, np.ndarray):
        return None
    layout = rows.layout
    nb = len(layout.batch_shape)
    if (
        kind == "row"
        and layout.axis == nb
        and cotangent.flags.c_contiguous
        and cotangent.shape == layout.batch_shape + core_shape
    ):  # the common case, the rows as they are, without the general moves' calls
        return cotangent.reshape((rows.rows,) + core_shape)
    if cotangent.shape != layout.user_shape(kind, core_shape):
        return None
    dst, ncore = layout._positions(kind)
    source = list(range(nb, nb + ncore))
    moved = cotangent if source == dst else NUMPY.moveaxis(cotangent, dst, source)
    return np.ascontiguousarray(moved).reshape((rows.rows,) + core_shape)


def _x_tangent(tangents: dict, rows: Rows, name: str = "x") -> np.ndarray:
    if name in tangents:
        return rows.tangent_to_core(tangents[name], f"tangent of {name}")
    return rows.backend.zeros(rows.xs.shape)


def _descending_context(x, alpha, axis, descending, order) -> Context:
    """The context of an operation of ``(x, alpha, axis, descending)``: descending is the
    ascending operation on ``-x`` (the rank of -x; -(the sort of -x); P of -x sorts x
    descending), so descending rows are negated on the way in.
    """
    negate = check_flag(descending, "descending")
    return Context.of(Rows.from_input(x, axis, negate=negate, order=order), alpha)


# --- restore: a forward pass's context, rebuilt for its gradients ----------------------------
# A bridge's backward pass receives the arguments its forward pass checked (the same arrays)
# and the residuals that forward pass handed out. The restore methods below check nothing
# again: the rows are gathered by the saved order (not sorted) and the other arguments are
# converted as prepare converted them (softorder._engine.checks: alpha_rows, target_rows,
# label_rows, p_k_rows give what the checks gave for arguments they accepted).


def _restored(arguments: dict, residuals: dict, name="x", axis=-1, negate=False) -> Context:
    """The context of a forward pass of ``arguments`` (its rows, alpha and saved arrays),
    from the ``residuals`` it handed out.
    """
    rows = Rows.from_input(arguments[name], axis, name, negate, residuals["order"])
    backend = rows.backend
    per_row, alpha_shape = alpha_rows(arguments["alpha"], rows.batch_shape, rows.layout.axis)
    ctx = Context(rows, per_row if backend is NUMPY else backend.from_host(per_row), alpha_shape)
    for key, arr in residuals.items():
        if key != "order":
            width = tuple(arr.shape)[-1]  # (numba's simulated device shapes refuse -1)
            if type(arr) is not np.ndarray or not arr.flags.c_contiguous:
                arr = backend.contiguous(arr)
            ctx.saved[key] = arr.reshape(rows.rows, width)
    return ctx


def _restored_targets(value, rows: Rows, name: str, high: float, high_text: str) -> Targets:
    """The :class:`Targets` prepare parsed from ``value``, without checking it again."""
    if type(value) in (int, float):  # Targets.parse's path for one scalar: a comparison
        return Targets.parse(value, rows, name, high, high_text)
    values, multi, shape = target_rows(value, rows.batch_shape)
    order = np.zeros(values.shape, np.int64) if values.shape[1] == 1 else values.argsort(axis=1)
    backend = rows.backend
    return Targets(backend.from_host(values), backend.from_host(order), multi, shape)


class OrderRule(Rule):
    """A rule whose index residuals (:attr:`index_residuals`: the sort ``order``, and the
    targets' ``anchor`` where a kernel keeps them narrow) are handed out as int64, the dtype
    :meth:`describe` declares for them, whatever index dtype the host keeps (int32 for rows
    shorter than 2**31: 4 bytes per element less at every step).
    """

    index_residuals: tuple = ("order",)

    def residuals(self, ctx) -> dict:
        arrays = super().residuals(ctx)
        for name in self.index_residuals:
            index = arrays.get(name)
            if isinstance(index, np.ndarray) and index.dtype != np.int64:
                arrays[name] = index.astype(np.int64)
        return arrays


class RankRule(OrderRule):
    differentiable = ("x", "alpha")
    residual_names = ("order", "decay")

    def prepare(self, x, alpha, axis, descending, order=None):
        # (_descending_context, inline: a small call feels each frame)
        negate = descending if descending is False else check_flag(descending, "descending")
        ctx = Context.of(Rows.from_input(x, axis, "x", negate, order), alpha)
        rows = ctx.rows
        if rows.dtype is not _F64 and rows.dtype == _F32 and ctx.kernels is core:
            # a float32 input's sorted values are float32 numbers: the CPU kernels read them
            # in float32 and widen each one exactly (the same arithmetic, 4 bytes per element
            # less from the forward pass to the last VJP)
            rows.xs = rows.xs.astype(np.float32)
        return ctx

    def result(self, layout, arguments):
        return "row", (layout.n,)

    def saved_widths(self, layout, arguments):
        return {"decay": (layout.n, np.float64)}

    def forward(self, ctx):
        rows = ctx.rows
        if ctx.serial and rows.dtype is _F64:  # a small float64 call: the lines below, lean
            xs = rows.xs
            shape = xs.shape
            out = np.empty(shape)
            ctx.saved["decay"] = decay = np.empty(shape)
            work = ctx.work(core.rank.FORWARD_WORK)
            serial_kernel(core.rank_forward)(xs, rows.order, ctx.alpha, out, decay, work)
            layout = rows.layout
            if layout.axis == layout.ndim - 1:  # what to_user returns: the rows reshaped
                return out.reshape(rows.batch_shape + (rows.n,))
            return rows.to_user(out, "row")
        # the CPU kernel writes a float32 input's ranks in float32 (rounded once, as the cast
        # rounded them): no float64 row of results beside the decays
        narrow = rows.dtype == _F32 and ctx.kernels is core
        shape = rows.xs.shape
        out = ctx.empty(shape, _F32 if narrow else _F64)
        ctx.saved["decay"] = decay = ctx.empty(shape)
        _kernel(ctx, ctx.kernels.rank_forward)(
            rows.xs, rows.order, ctx.alpha, out, decay, ctx.work(core.rank.FORWARD_WORK)
        )
        return rows.to_user(out, "row")

    def vjp(self, ctx, cotangent):
        rows = ctx.rows
        xs = rows.xs
        shape = rows.batch_shape + (rows.n,)
        if (
            ctx.serial
            and xs.dtype is _F64
            and rows.dtype is _F64
            and type(cotangent) is np.ndarray
            and cotangent.dtype is _F64
            and cotangent.flags.c_contiguous
            and cotangent.shape == shape
            and rows.layout.axis == len(rows.batch_shape)
        ):  # a small float64 call (_plain_row) and a float64 cotangent of the result's shape
            # (_plain_cotangent): the lines below, lean (to_core_owned would return the
            # cotangent's rows, not owned)
            x_bar = np.empty(xs.shape)
            alpha_bar = np.empty(rows.rows)
            work = ctx.work(core.rank.LINEAR_WORK)
            same = shape == xs.shape  # (then the reshapes below are views of the same shape)
            serial_kernel(core.rank_vjp)(
                xs,
                rows.order,
                ctx.alpha,
                ctx.saved["decay"],
                cotangent if same else cotangent.reshape(xs.shape),
                x_bar,
                alpha_bar,
                work,
            )
            if rows.sign < 0:
                np.negative(x_bar, out=x_bar)  # (grad_to_user's negation: the kernel's output)
            if ctx.alpha_shape or not ctx.alpha_wanted:
                alpha_grad = ctx.alpha_grad(alpha_bar)
            elif rows.rows == 1:  # alpha_grad of one alpha, one row: sum_over_rows's value
                alpha_grad = alpha_bar[0] + 0.0 if rows.batch_shape else alpha_bar[0]
            else:
                alpha_grad = sum_over_rows(alpha_bar, True)
            return x_bar if same else x_bar.reshape(shape), alpha_grad
        cpu = ctx.kernels is core
        # a float32 cotangent of a float32 input: the CPU kernel reads it as it is and
        # writes the gradient in float32 (the float64 one rounded once, as the cast gave it)
        v = (
            _float32_cotangent(ctx, cotangent, "row", (rows.n,))
            if cpu and rows.dtype == _F32
            else None
        )
        if v is not None:
            x_bar = ctx.empty(rows.xs.shape, _F32)
        else:
            v, owned = rows.to_core_owned(cotangent, "row", (rows.n,), "cotangent")
            # rank_vjp gathers each row of v before it writes that row of x_bar
            x_bar = v if owned and cpu else ctx.empty(rows.xs.shape)
        alpha_bar = ctx.empty(rows.rows)
        narrow = x_bar.dtype == _F32
        _kernel(ctx, core.rank_vjp_narrow if narrow else ctx.kernels.rank_vjp)(
            rows.xs,
            rows.order,
            ctx.alpha,
            ctx.saved["decay"],
            v,
            x_bar,
            alpha_bar,
            ctx.work(core.rank.NARROW_VJP_WORK if narrow else core.rank.LINEAR_WORK),
        )
        return rows.grad_to_user(x_bar), ctx.alpha_grad(alpha_bar)

    def jvp(self, ctx, tangents):
        rows = ctx.rows
        out = ctx.empty(rows.xs.shape)
        _kernel(ctx, ctx.kernels.rank_jvp)(
            rows.xs,
            rows.order,
            ctx.alpha,
            ctx.saved["decay"],
            _x_tangent(tangents, rows),
            ctx.alpha_tangent(tangents),
            out,
            ctx.work(core.rank.LINEAR_WORK),
        )
        return rows.to_user(out, "row")


class InverseRule(OrderRule):
    """Values of the inverse Lap-sum: soft sort (``w = k - 1/2``), soft quantile (``w = q n``)."""

    def _target_order(self, ctx) -> np.ndarray:  # pragma: no cover - interface
        """Argsort of each row's targets ``w``, (rows, m)."""
        raise NotImplementedError

    def _forward_targets(self, ctx, w, worder):
        rows = ctx.rows
        out = ctx.empty(w.shape)
        anchor, offset = ctx.target_storage(w.shape[1])
        _kernel(ctx, ctx.kernels.inverse_kernel)(
            rows.xs, ctx.alpha, w, worder, out, anchor, offset, ctx.work(core.lapsum.TABLES)
        )
        return out

    #: whether the gradient in the targets is used (soft sort's targets are constants)
    targets_differentiable = True

    def _pullback(self, ctx, u, u_owned: bool = False):
        """``(x_bar, w_bar, alpha_bar)``; with ``u_owned`` (``u`` is softorder's own host
        array of shape (rows, n)) the CPU kernel writes ``x_bar`` into ``u``: it reads each
        row of ``u`` before it writes that row of ``x_bar`` (one array of n float64 less).
        """
        rows, s = ctx.rows, ctx.saved
        reuse = u_owned and ctx.kernels is core and u.shape == rows.xs.shape
        x_bar = u if reuse else ctx.empty(rows.xs.shape)
        host = isinstance(rows.xs, np.ndarray)
        # the CPU kernel skips w_bar when it has width 0 (the GPU twin always writes it)
        w_bar = ctx.empty(u.shape if self.targets_differentiable or not host else (rows.rows, 0))
        alpha_bar = ctx.empty(rows.rows)
        # the CPU kernel reads neither the targets' order nor per-target scratch (for soft
        # sort at n = 1e6 they were 24 MB)
        cpu = ctx.kernels is core
        few = cpu and core.sort.few_targets(u.shape[1], rows.n)
        _kernel(ctx, core.few_inverse_vjp if few else ctx.kernels.inverse_vjp)(
            rows.xs,
            rows.order,
            ctx.alpha,
            s["anchor"],
            s["offset"],
            np.empty((rows.rows, 0), np.int64) if cpu else self._target_order(ctx),
            u,
            x_bar,
            w_bar,
            alpha_bar,
            ctx.work(core.sort.FEW_VJP_WORK if few else core.sort.VJP_WORK),
            ctx.work(0 if cpu else core.lapsum.PULLBACK_WORK, u.shape[1]),
        )
        return x_bar, w_bar, alpha_bar

    def _pushforward(self, ctx, tangents, w_dot):
        rows, s = ctx.rows, ctx.saved
        out = ctx.empty(w_dot.shape)
        _kernel(ctx, ctx.kernels.inverse_jvp)(
            rows.xs,
            rows.order,
            ctx.alpha,
            s["anchor"],
            s["offset"],
            self._target_order(ctx),
            _x_tangent(tangents, rows),
            w_dot,
            ctx.alpha_tangent(tangents),
            out,
            ctx.work(core.sort.JVP_WORK),
            ctx.work(core.lapsum.PUSHFORWARD_WORK, w_dot.shape[1]),
        )
        return out


def _same_row(ctx: Context, row: np.ndarray) -> np.ndarray:
    """The host vector ``row`` for every row, as ``(rows, len(row))``: a view for one row of
    host arrays (the sort targets of one row of 1e6 were two 8 MB copies per call).
    """
    if ctx.rows.rows == 1 and isinstance(ctx.rows.xs, np.ndarray):
        return row.reshape(1, -1)
    return ctx.backend.tile_rows(row, ctx.rows.rows)


def _ladder_wide(xs: np.ndarray, work: np.ndarray) -> np.ndarray:
    """The ``wide`` rows of :func:`~softorder.core.sort.ladder_forward`: ``xs`` itself when
    float64; for float32 ``xs``, ``work`` seen as (rows, ``LADDER_WORK * n``), whose row of
    ``B`` takes each widened row (no array beside the scratch).
    """
    return xs if xs.dtype != _F32 else work.reshape(xs.shape[0], -1)


def _signed(ctx: Context, a):
    """``sign * a`` of the sorted variable ``r = sign * x``: ``a`` itself for ascending rows
    (the kernels only read it; a copy was one more array of n per call).
    """
    return a if ctx.rows.sign > 0 else ctx.backend.scale(a, ctx.rows.sign)


class SortRule(InverseRule):
    """Soft sort. On the CPU (rows shorter than 2**31) the forward pass keeps each target's
    offset but not its anchor (:func:`~softorder.core.sort.ladder_forward`), which the VJP
    counts again (:func:`~softorder.core.sort.ladder_vjp`, also after a restore from
    residuals); rows of :data:`~softorder.core.sort.SOLVE_AGAIN_N` or more keep no offsets
    either, which the VJP solves again; float32 rows of :data:`~softorder.core.sort.LEAN_N`
    or more take each pass in two rows of scratch (:func:`~softorder.core.sort.lean_vjp`).
    Anchors and offsets are solved
    (:meth:`_solved_targets`, by the forward kernel) where they are handed out or read: the
    bridges' residuals, the JVP, rows the ladder VJP hands back.
    """

    differentiable = ("x", "alpha")
    targets_differentiable = False
    index_residuals = ("order", "anchor")  # the CPU forward keeps int32 anchors

    def prepare(self, x, alpha, axis, descending, order=None):
        ctx = _descending_context(x, alpha, axis, descending, order)
        rows = ctx.rows
        if rows.dtype == _F32 and rows.backend is NUMPY and rows.n < 2**31:
            # a float32 input's sorted values are float32 numbers: the ladder kernels read
            # them in float32 and widen each one exactly (4 bytes per element less)
            rows.xs = rows.xs.astype(np.float32)
        return ctx

    @staticmethod
    def _widened(ctx):
        """The sorted rows in float64, as the kernels other than the ladder's read them (kept
        in the context: the paths that need them are the rarer ones).
        """
        rows = ctx.rows
        if rows.xs.dtype != np.float64:
            rows.xs = rows.xs.astype(np.float64)
        return rows.xs

    def result(self, layout, arguments):
        return "row", (layout.n,)

    def target_count(self, layout, arguments):
        return layout.n

    def _target_order(self, ctx):
        return _same_row(ctx, np.arange(ctx.rows.n))

    def forward(self, ctx):
        rows = ctx.rows
        if rows.backend is NUMPY:  # the CPU kernel needs no targets: they are k - 1/2
            xs = rows.xs
            shape = xs.shape
            if rows.n >= 2**31:
                work = ctx.work(core.lapsum.SORT_TABLES)
                out = ctx.empty(shape)
                anchor, offset = ctx.target_storage(rows.n)
                core.lapsum.sort_kernel(xs, ctx.alpha, out, anchor, offset, work)
                return rows.to_user(_signed(ctx, out), "row")
            # a float32 input's result in float32 (rounded once, as the cast rounded it); the
            # counts of the targets wait in the result's own memory
            if rows.dtype == _F32:
                out = np.empty(shape, _F32)
                counts = out.view(_I32)
            else:
                out = np.empty(shape)
                counts = out.view(_I64)
            # long rows keep no offsets: the VJP solves them again (8 bytes per element); the
            # longest float32 rows solve in two rows of scratch (no row of A)
            long_row = rows.n >= core.sort.SOLVE_AGAIN_N
            if self._lean(rows):  # (its rows side by side: the kernel's two-row path)
                work = ctx.work(core.sort.LEAN_FORWARD_WORK).reshape(shape[0], -1)
            else:
                work = ctx.work(core.lapsum.SORT_TABLES)
            offset = ratios = None  # (exactly one: each a specialization of the kernel)
            if not long_row:
                ctx.saved["offset"] = offset = np.empty(shape)
            else:
                ratios = np.empty((shape[0], core.sort.TBLOCK))
            wide = _ladder_wide(xs, work)
            core.sort.ladder_forward(xs, ctx.alpha, out, counts, offset, ratios, wide, work, True)
            if rows.sign < 0:  # _signed's product, in place: no copy beside the scratch
                np.multiply(out, rows.sign, out=out)
            return rows.to_user(out, "row")
        w = np.arange(rows.n, dtype=np.float64)
        w += 0.5
        w = _same_row(ctx, w)
        out = self._forward_targets(ctx, w, self._target_order(ctx))
        return rows.to_user(_signed(ctx, out), "row")

    def _solved_targets(self, ctx, rows_at=None):
        """The anchors and offsets of the CPU forward pass, solved again by its kernel (the
        same bits as :func:`~softorder.core.lapsum.sort_forward`'s), of every row or of the
        rows ``rows_at``: ``(xs, alpha, anchor, offset)`` of those rows (``anchor`` int32
        for float32 rows, else int64: the kernel's anchors take the place of its values).
        """
        xs, alpha = ctx.rows.xs, ctx.alpha
        if rows_at is not None:
            xs, alpha = xs[rows_at], alpha[rows_at]
        shape = xs.shape
        narrow = xs.dtype == np.float32
        anchor, offset = np.empty(shape, np.int32 if narrow else np.int64), np.empty(shape)
        values = anchor.view(np.float32 if narrow else np.float64)
        work = np.empty((shape[0], core.sort.LADDER_WORK, max(shape[1], 1)))
        wide = _ladder_wide(xs, work)
        core.sort.ladder_forward(xs, alpha, values, anchor, offset, None, wide, work, False)
        return xs, alpha, anchor, offset

    def residuals(self, ctx):
        s = ctx.saved
        if ctx.kernels is core and "anchor" not in s:
            s.pop("offset", None)  # (residual_names' order: anchor, then offset)
            s["anchor"], s["offset"] = self._solved_targets(ctx)[2:]
        return super().residuals(ctx)

    def vjp(self, ctx, cotangent):
        rows = ctx.rows
        cpu = rows.backend is NUMPY  # (the backend whose kernels are softorder.core)
        v = (
            _float32_cotangent(ctx, cotangent, "row", (rows.n,))
            if cpu and rows.dtype == _F32
            else None
        )
        if v is None:
            u, owned = rows.to_core_owned(cotangent, "row", (rows.n,), "cotangent")
            if rows.sign < 0:
                u, owned = _signed(ctx, u), True  # a new array
        if not cpu:
            x_bar, _, alpha_bar = self._pullback(ctx, u, owned)
            return rows.grad_to_user(x_bar), ctx.alpha_grad(alpha_bar)
        # a float32 cotangent of a float32 input is read as it is, into a float32 x_bar (the
        # float64 gradient rounded once)
        negate = False  # (a float32 cotangent of a descending sort: the kernels negate it)
        if v is not None:
            u, negate = v, rows.sign < 0
        grad_dtype = _F32 if v is not None else _F64
        s = ctx.saved
        alpha_bar = np.empty(rows.rows)
        if rows.n < 2**31:  # the ladder forward (or its residuals): anchors counted again
            redo = np.empty(rows.rows, _U8)
            offset = s.get("offset")  # (none kept: solved again)
            if offset is None and self._lean(rows):
                x_bar = self._lean_vjp(ctx, u, negate, grad_dtype, alpha_bar, redo)
            else:
                if negate:
                    u, negate = np.negative(u), False
                x_bar = np.empty(rows.xs.shape, grad_dtype)  # (the counts wait in x_bar)
                ring = np.empty((rows.rows, core.sort.WINDOW)) if offset is None else None
                self._ladder_vjp(
                    rows.xs,
                    rows.order,
                    ctx.alpha,
                    offset,
                    ring,
                    u,
                    x_bar,
                    alpha_bar,
                    redo,
                    ctx.work(core.sort.LADDER_WORK),
                )
            # rows whose ties threw an injection beyond the window: sort_vjp's rows
            # (count_nonzero, and one row's flag read directly, are cheaper than redo.any()
            # on a small call)
            if redo[0] if rows.rows == 1 else np.count_nonzero(redo):
                at = np.flatnonzero(redo)
                if negate:
                    u = np.negative(u)
                xs, alpha, anchor, offset = self._solved_targets(ctx, at)
                xs = xs.astype(np.float64)  # (sort_vjp reads float64 rows)
                sub_x_bar, sub_alpha_bar = np.empty(xs.shape, x_bar.dtype), np.empty(len(at))
                work = np.empty((len(at), core.sort.SORT_VJP_WORK, rows.n))
                core.sort.sort_vjp(
                    xs,
                    rows.order[at],
                    alpha,
                    anchor,
                    offset,
                    u[at],
                    sub_x_bar,
                    sub_alpha_bar,
                    work,
                )
                x_bar[at], alpha_bar[at] = sub_x_bar, sub_alpha_bar
            return rows.grad_to_user(x_bar), ctx.alpha_grad(alpha_bar)
        # rows of 2**31 or more (int64 anchors): x_bar in u when softorder owns u (sort_vjp
        # reads each row of u before it writes that row of x_bar)
        if v is None:
            x_bar = u if owned and u.shape == rows.xs.shape else ctx.empty(rows.xs.shape)
        else:  # a float32 cotangent as it is (sort_vjp reads no sign: negated here)
            x_bar = np.empty(rows.xs.shape, _F32)
            u = np.negative(u) if negate else u
        core.sort.sort_vjp(
            self._widened(ctx),
            rows.order,
            ctx.alpha,
            s["anchor"],
            s["offset"],
            u,
            x_bar,
            alpha_bar,
            ctx.work(core.sort.SORT_VJP_WORK),
        )
        return rows.grad_to_user(x_bar), ctx.alpha_grad(alpha_bar)

    @staticmethod
    def _lean(rows) -> bool:
        """Whether soft sort's passes take two rows of scratch (float32 rows of
        :data:`~softorder.core.sort.LEAN_N` or more, which keep no offsets either).
        """
        return rows.n >= core.sort.LEAN_N and rows.xs.dtype == _F32

    @staticmethod
    def _ladder_vjp(xs, order, alpha, offset, ring, u, x_bar, alpha_bar, redo, work):
        """:func:`~softorder.core.sort.ladder_vjp` of the rows ``xs``, its counts in
        ``x_bar``'s memory.
        """
        counts = x_bar.view(_I32 if x_bar.dtype == _F32 else _I64)
        core.sort.ladder_vjp(
            xs, order, alpha, offset, ring, u, x_bar, counts, alpha_bar, work, redo
        )

    def _lean_vjp(self, ctx, u, negate, grad_dtype, alpha_bar, redo):
        """The gradient ``x_bar`` (of ``grad_dtype``) of long float32 rows, which keep no
        offsets (:func:`~softorder.core.sort.lean_vjp`; ``negate``: the cotangent is ``-u``,
        negated where the kernel reads it, no copy): two rows of scratch and 2-byte
        counts, the gradient in sorted order left in the row ``B``, which ``scatter_rows``
        reads once the other row and the counts are gone (the gradient's array comes after
        them). The rows it hands back (a count beyond 2 bytes; ties that send an injection
        below or beyond its window) take :func:`~softorder.core.sort.ladder_vjp` (three rows
        of scratch, their own); those that one hands back stay flagged in ``redo``.
        """
        rows = ctx.rows
        shape = rows.xs.shape
        counts = np.empty(shape, core.sort.LEAN_COUNTS)
        E = ctx.work(1).reshape(shape)
        B = ctx.work(1).reshape(shape)
        marks = np.empty((shape[0], shape[1] // core.sort.BD_STEP + 1))
        core.sort.lean_vjp(rows.xs, ctx.alpha, u, negate, counts, E, B, marks, alpha_bar, redo)
        del counts, E, marks
        x_bar = np.empty(shape, grad_dtype)
        core.sort.scatter_rows(rows.xs, B, rows.order, x_bar, redo)
        del B
        if not (redo[0] if rows.rows == 1 else np.count_nonzero(redo)):
            return x_bar
        at = np.flatnonzero(redo)
        ring = np.empty((len(at), core.sort.WINDOW))
        work = np.empty((len(at), core.sort.LADDER_WORK, rows.n))
        if len(at) == rows.rows:  # (every row: into x_bar itself)
            u = np.negative(u) if negate else u
            self._ladder_vjp(
                rows.xs, rows.order, ctx.alpha, None, ring, u, x_bar, alpha_bar, redo, work
            )
            return x_bar
        sub_x_bar, sub_alpha_bar = np.empty((len(at), rows.n), grad_dtype), np.empty(len(at))
        sub_redo = np.empty(len(at), _U8)
        self._ladder_vjp(
            rows.xs[at],
            rows.order[at],
            ctx.alpha[at],
            None,
            ring,
            np.negative(u[at]) if negate else u[at],
            sub_x_bar,
            sub_alpha_bar,
            sub_redo,
            work,
        )
        x_bar[at], alpha_bar[at], redo[at] = sub_x_bar, sub_alpha_bar, sub_redo
        return x_bar

    def jvp(self, ctx, tangents):
        rows, s = ctx.rows, ctx.saved
        cpu = ctx.kernels is core
        solved = cpu and "anchor" not in s
        kept = s.get("offset")
        if solved:  # for this call only: the forward pass's memory stays what it was
            s["anchor"], s["offset"] = self._solved_targets(ctx)[2:]
        if cpu:
            self._widened(ctx)  # (inverse_jvp reads float64 rows)
        try:
            out = self._pushforward(ctx, tangents, ctx.zeros(rows.xs.shape))
        finally:
            if solved:
                del s["anchor"], s["offset"]
                if kept is not None:
                    s["offset"] = kept
        return rows.to_user(_signed(ctx, out), "row")


class QuantileRule(InverseRule):
    differentiable = ("x", "q", "alpha")

    def prepare(self, x, q, alpha, axis, order=None):
        ctx = Context.of(Rows.from_input(x, axis, order=order), alpha)
        ctx.params["targets"] = Targets.parse(q, ctx.rows, "q", 1.0, "1")
        return ctx

    def restore(self, arguments, residuals):
        ctx = _restored(arguments, residuals, axis=arguments["axis"])
        ctx.params["targets"] = _restored_targets(arguments["q"], ctx.rows, "q", 1.0, "1")
        return ctx

    def result(self, layout, arguments):
        m = Targets.count(arguments["q"], layout)
        multi = np.ndim(arguments["q"]) == len(layout.batch_shape) + 1
        return ("targets", (m,)) if multi else ("none", ())

    def target_count(self, layout, arguments):
        return Targets.count(arguments["q"], layout)

    def _target_order(self, ctx):
        return ctx.params["targets"].order

    def _kind(self, ctx):
        return "targets" if ctx.params["targets"].multi else "none"

    def forward(self, ctx):
        targets = ctx.params["targets"]
        w = ctx.backend.scale(targets.values, ctx.rows.n)
        out = self._forward_targets(ctx, w, self._target_order(ctx))
        return _targets_to_user(ctx, out, self._kind(ctx))

    def _cotangent(self, ctx, cotangent):
        rows, targets = ctx.rows, ctx.params["targets"]
        core_shape = (targets.m,) if targets.multi else ()
        return rows.to_core(cotangent, self._kind(ctx), core_shape, "cotangent").reshape(
            rows.rows, targets.m
        )

    def vjp(self, ctx, cotangent):
        rows, targets = ctx.rows, ctx.params["targets"]
        x_bar, w_bar, alpha_bar = self._pullback(ctx, self._cotangent(ctx, cotangent))
        q_bar = targets.grad_to_user(ctx.backend.scale(w_bar, rows.n), rows, rows.dtype)
        return rows.grad_to_user(x_bar), q_bar, ctx.alpha_grad(alpha_bar)

    def jvp(self, ctx, tangents):
        rows, targets = ctx.rows, ctx.params["targets"]
        w_dot = (
            ctx.backend.scale(targets.tangent_to_core(tangents["q"], rows, "tangent of q"), rows.n)
            if "q" in tangents
            else ctx.zeros(targets.values.shape)
        )
        return _targets_to_user(ctx, self._pushforward(ctx, tangents, w_dot), self._kind(ctx))


def _plain_row(rows: Rows) -> bool:
    """Whether a (rows, n) float64 host result is already the caller's: host arrays, float64
    results, the axis last (what :meth:`Rows.to_user` of a ``row`` returns then is a reshape).
    """
    return (
        rows.backend is NUMPY and rows.dtype == _F64 and rows.layout.axis == len(rows.batch_shape)
    )


def _plain_cotangent(cotangent, rows: Rows) -> bool:
    """Whether a cotangent of a :func:`_plain_row` result is what the host kernels read as it
    is: a C-contiguous float64 ndarray of the result's shape (else :meth:`Rows.to_core_owned`
    converts it, or names what is wrong with it).
    """
    return (
        type(cotangent) is np.ndarray
        and cotangent.dtype == _F64
        and cotangent.flags.c_contiguous
        and cotangent.shape == rows.batch_shape + (rows.n,)
    )


class TopKRule(OrderRule):
    differentiable = ("x", "k", "alpha")

    def __init__(self, log: bool):
        self.log = log

    def prepare(self, x, k, alpha, axis, largest, order=None):
        # The kernels select the k smallest; the k largest of x are the k smallest of -x.
        negate = largest if largest is True else check_flag(largest, "largest")
        rows = Rows.from_input(x, axis, "x", negate, order)
        ctx = Context.of(rows, alpha)
        n = rows.n
        ctx.params["targets"] = Targets.parse(k, rows, "k", float(n), f"n={n}")
        return ctx

    def restore(self, arguments, residuals):
        negate = bool(arguments["largest"])
        ctx = _restored(arguments, residuals, axis=arguments["axis"], negate=negate)
        n = ctx.rows.n
        ctx.params["targets"] = _restored_targets(arguments["k"], ctx.rows, "k", float(n), f"n={n}")
        return ctx

    def result(self, layout, arguments):
        m = Targets.count(arguments["k"], layout)
        multi = np.ndim(arguments["k"]) == len(layout.batch_shape) + 1
        return ("targets_row", (m, layout.n)) if multi else ("row", (layout.n,))

    def target_count(self, layout, arguments):
        return Targets.count(arguments["k"], layout)

    def _kind(self, ctx):
        return "targets_row" if ctx.params["targets"].multi else "row"

    def forward(self, ctx):
        rows, targets = ctx.rows, ctx.params["targets"]
        out = ctx.empty((rows.rows, targets.m, rows.n))
        anchor, offset = ctx.target_storage(targets.m)
        _kernel(ctx, ctx.kernels.topk_forward)(
            rows.xs,
            rows.order,
            ctx.alpha,
            targets.values,
            targets.order,
            self.log,
            out,
            anchor,
            offset,
            # (np.empty itself for host rows: what ctx.work gives, at half its cost)
            np.empty((rows.rows, core.topk.FORWARD_WORK, rows.n))
            if rows.backend is NUMPY
            else ctx.work(core.topk.FORWARD_WORK),
        )
        if not targets.multi and _plain_row(rows):  # what _targets_to_user returns, directly
            return out.reshape(rows.layout.batch_shape + (rows.n,))
        if not self.log and rows.dtype != _F64 and rows.backend is NUMPY:
            # memberships lie in [0, 1] (or are NaN): their cast to a narrower float never
            # overflows, and needs no error state (which to_user's cast sets, at a cost felt
            # by small calls)
            out = out.astype(rows.dtype)
        return _targets_to_user(ctx, out, self._kind(ctx))

    def vjp(self, ctx, cotangent):
        rows, targets, s = ctx.rows, ctx.params["targets"], ctx.saved
        core_shape = (targets.m, rows.n) if targets.multi else (rows.n,)
        # with one target per row the CPU kernel reads a float32 cotangent as it is and
        # writes the gradient of a float32 input in float32 (the float64 one rounded once,
        # as the cast gave it: 12 bytes per element less at the peak); and it gathers each
        # row of v before it scatters that row of x_bar
        one = targets.m == 1 and ctx.kernels is core
        narrow = False
        plain = not targets.multi and _plain_row(rows)
        if plain and _plain_cotangent(cotangent, rows):  # what to_core_owned returns then
            v = cotangent
            x_bar = np.empty(rows.xs.shape)
        else:
            if one and rows.dtype == np.float32:
                v = _float32_cotangent(ctx, cotangent, self._kind(ctx), core_shape)
                narrow = v is not None
            if narrow:
                x_bar = ctx.empty(rows.xs.shape, np.float32)
            else:
                v, owned = rows.to_core_owned(cotangent, self._kind(ctx), core_shape, "cotangent")
                x_bar = v.reshape(rows.xs.shape) if owned and one else ctx.empty(rows.xs.shape)
        v = v.reshape(rows.rows, targets.m, rows.n)
        w_bar = ctx.empty((rows.rows, targets.m))
        alpha_bar = ctx.empty(rows.rows)
        vjp = core.topk_vjp_narrow if narrow else ctx.kernels.topk_vjp
        if ctx.serial:
            # (topk_vjp picks its kernel by the number of targets; its serial dispatcher is
            # the one-target kernel's)
            one_kernel = targets.m == 1 and vjp is core.topk.topk_vjp  # (not a test's stand-in)
            vjp = vjp.serial if one_kernel else serial_kernel(vjp)
        vjp(
            rows.xs,
            rows.order,
            ctx.alpha,
            s["anchor"],
            s["offset"],
            self.log,
            v,
            x_bar,
            w_bar,
            alpha_bar,
            # (the CPU VJP needs no tables; the GPU twin scans them)
            np.empty((rows.rows, core.topk.VJP_WORK, rows.n))
            if plain
            else ctx.work(
                core.topk.GPU_VJP_WORK
                if ctx.kernels is not core
                else core.topk.ONE_TARGET_VJP_WORK
                if narrow
                else core.topk.VJP_WORK
            ),
        )
        if plain and not targets.shape and not ctx.alpha_shape:
            # scalar k and alpha: what grad_to_user and alpha_grad return (a 0-d array for k,
            # a scalar for alpha), directly; with batch axes summed over them (sum_over_rows),
            # without them the values as they are
            if rows.sign < 0:
                np.negative(x_bar, x_bar)  # the kernel's own output
            x_bar = x_bar.reshape(rows.batch_shape + (rows.n,))
            alpha_wanted = ctx.alpha_wanted
            if rows.batch_shape:
                a_bar = sum_over_rows(alpha_bar, True) if alpha_wanted else None
                return x_bar, np.array(sum_over_rows(w_bar, True)), a_bar
            return x_bar, w_bar.reshape(()), alpha_bar[0] if alpha_wanted else None
        k_bar = targets.grad_to_user(w_bar, rows, rows.dtype)
        return rows.grad_to_user(x_bar), k_bar, ctx.alpha_grad(alpha_bar)

    def jvp(self, ctx, tangents):
        rows, targets, s = ctx.rows, ctx.params["targets"], ctx.saved
        w_dot = (
            targets.tangent_to_core(tangents["k"], rows, "tangent of k")
            if "k" in tangents
            else ctx.zeros(targets.values.shape)
        )
        out = ctx.empty((rows.rows, targets.m, rows.n))
        _kernel(ctx, ctx.kernels.topk_jvp)(
            rows.xs,
            rows.order,
            ctx.alpha,
            s["anchor"],
            s["offset"],
            self.log,
            _x_tangent(tangents, rows),
            w_dot,
            ctx.alpha_tangent(tangents),
            out,
            ctx.work(core.topk.GRADIENT_WORK),
        )
        return _targets_to_user(ctx, out, self._kind(ctx))


class PermutationRule(OrderRule):
    differentiable = ("x", "alpha")

    def prepare(self, x, alpha, axis, descending, order=None):
        return _descending_context(x, alpha, axis, descending, order)

    def restore(self, arguments, residuals):
        negate = bool(arguments["descending"])
        return _restored(arguments, residuals, axis=arguments["axis"], negate=negate)

    def result(self, layout, arguments):
        return "matrix", (layout.n, layout.n)

    def target_count(self, layout, arguments):
        return layout.n - 1

    def forward(self, ctx):
        rows = ctx.rows
        out = ctx.empty((rows.rows, rows.n, rows.n))
        anchor, offset = ctx.target_storage(rows.n - 1)
        ctx.kernels.permutation_forward(
            rows.xs,
            rows.order,
            ctx.alpha,
            *_boundary_targets(rows),
            out,
            anchor,
            offset,
            ctx.work(core.permutation.FORWARD_WORK),
        )
        return rows.to_user(out, "matrix")

    def vjp(self, ctx, cotangent):
        rows, s = ctx.rows, ctx.saved
        V = rows.to_core(cotangent, "matrix", (rows.n, rows.n), "cotangent")
        x_bar = ctx.empty(rows.xs.shape)
        alpha_bar = ctx.empty(rows.rows)
        ctx.kernels.permutation_vjp(
            rows.xs,
            rows.order,
            ctx.alpha,
            s["anchor"],
            s["offset"],
            _boundary_targets(rows)[1],
            V,
            x_bar,
            alpha_bar,
            ctx.work(core.permutation.GRADIENT_WORK),
            ctx.work(core.permutation.BOUNDARY_WORK, rows.n - 1),
        )
        return rows.grad_to_user(x_bar), ctx.alpha_grad(alpha_bar)

    def jvp(self, ctx, tangents):
        rows, s = ctx.rows, ctx.saved
        out = ctx.empty((rows.rows, rows.n, rows.n))
        ctx.kernels.permutation_jvp(
            rows.xs,
            rows.order,
            ctx.alpha,
            s["anchor"],
            s["offset"],
            _boundary_targets(rows, read=True)[1],
            _x_tangent(tangents, rows),
            ctx.alpha_tangent(tangents),
            out,
            ctx.work(core.permutation.GRADIENT_WORK),
            ctx.work(core.permutation.BOUNDARY_WORK, rows.n - 1),
        )
        return rows.to_user(out, "matrix")


def _boundary_targets(rows: Rows, read: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Targets ``w = 1..n-1`` of the permutation boundaries and their (sorted) order.

    The CPU kernels invert this ladder without reading them (``solve_ladder``); unless
    ``read`` (the JVP's pushforward reads the order) they get empty arrays of the same types,
    two arrays of n - 1 less per call.
    """
    if not read and rows.backend.kernels is core:
        return np.empty(0), np.empty(0, np.int64)
    m = rows.n - 1
    return rows.backend.from_host(np.arange(1.0, m + 1.0)), rows.backend.from_host(np.arange(m))


class LossRule(OrderRule):
    """Shared by the two losses: per-row values reduced by ``reduction``; the JVP of a scalar
    per row is its gradient dotted with the tangents (one VJP with unit cotangents).
    """

    def result(self, layout, arguments):
        return ("none", ()) if arguments["reduction"] == "none" else ("scalar", ())

    def _reduce(self, ctx, per_row):
        rows, reduction = ctx.rows, ctx.params["reduction"]
        if reduction == "none":
            return rows.to_user(per_row, "none")
        total = ctx.backend.total(per_row)
        if reduction == "sum":
            return ctx.scalar(total)
        # the mean of nothing is NaN
        return ctx.scalar(ctx.backend.scale(total, 1.0 / rows.rows) if rows.rows else np.nan)

    def _row_cotangent(self, ctx, cotangent):
        rows, reduction = ctx.rows, ctx.params["reduction"]
        if reduction == "none":
            return rows.to_core(cotangent, "none", (), "cotangent")
        scale = 1.0 / max(rows.rows, 1) if reduction == "mean" else 1.0
        kind = type(cotangent)
        if ctx.backend is NUMPY and (
            kind in _WIDE_SCALARS
            or (kind is np.ndarray and cotangent.shape == () and cotangent.dtype in _WIDE)
        ):  # the common case: float() widens exactly, and one product in float64 rounds
            # as the general path's below
            return np.full(rows.rows, float(cotangent) * scale)
        arr, _ = ctx.backend.float_input(cotangent, "cotangent")
        if tuple(arr.shape) != ():
            raise ValueError(
                f"cotangent must be a scalar for reduction={reduction!r}; "
                f"got shape {tuple(arr.shape)}"
            )
        # widened first: a float32 cotangent scaled in float32 was rounded once more
        return ctx.backend.scale(ctx.backend.broadcast_f64(arr, (rows.rows,)), scale)

    def _row_gradients(self, ctx, cot):  # pragma: no cover - interface
        raise NotImplementedError

    def vjp(self, ctx, cotangent):
        x_bar, alpha_bar = self._row_gradients(ctx, self._row_cotangent(ctx, cotangent))
        return ctx.rows.grad_to_user(x_bar), ctx.alpha_grad(alpha_bar)

    def jvp(self, ctx, tangents):
        rows = ctx.rows
        x_bar, alpha_bar = self._row_gradients(ctx, ctx.backend.full(rows.rows, 1.0))
        x_name = self.differentiable[0]
        per_row = ctx.backend.row_dots(x_bar, _x_tangent(tangents, rows, x_name))
        ctx.backend.add_product(per_row, alpha_bar, ctx.alpha_tangent(tangents))
        return self._reduce(ctx, per_row)


class TopKCrossEntropyRule(LossRule):
    differentiable = ("logits", "alpha")

    input_name = "logits"

    def prepare(self, logits, labels, p_k, alpha, reduction, split_top1, order=None):
        rows = Rows.from_input(logits, -1, name="logits", negate=True, order=order)
        ctx = Context.of(rows, alpha)
        n = rows.n
        ctx.params["reduction"] = check_reduction(reduction)
        ctx.params["labels"] = rows.backend.from_host(
            check_labels(labels, rows.batch_shape, "labels", 0, n - 1)
        )
        pk = check_p_k(p_k, rows.batch_shape, n)
        pk = pk.reshape(rows.rows, pk.shape[-1])
        with np.errstate(divide="ignore"):
            ctx.params["log_pk"] = rows.backend.from_host(np.log(pk))
        ctx.params["pk1"] = rows.backend.from_host(np.ascontiguousarray(pk[:, 0]))
        ctx.params["split"] = check_flag(split_top1, "split_top1")
        return ctx

    def restore(self, arguments, residuals):
        ctx = _restored(arguments, residuals, name="logits", negate=True)
        rows, params = ctx.rows, ctx.params
        params["reduction"] = arguments["reduction"]
        params["labels"] = rows.backend.from_host(label_rows(arguments["labels"], rows.batch_shape))
        pk = p_k_rows(arguments["p_k"], rows.batch_shape)
        pk = pk.reshape(rows.rows, pk.shape[-1])
        with np.errstate(divide="ignore"):
            params["log_pk"] = rows.backend.from_host(np.log(pk))
        params["pk1"] = rows.backend.from_host(np.ascontiguousarray(pk[:, 0]))
        params["split"] = bool(arguments["split_top1"])
        return ctx

    def forward(self, ctx):
        rows, p = ctx.rows, ctx.params
        per_row = ctx.empty(rows.rows)
        anchor, offset = ctx.target_storage(p["log_pk"].shape[1])
        _kernel(ctx, ctx.kernels.topk_loss_forward)(
            rows.xs,
            rows.order,
            ctx.alpha,
            p["labels"],
            p["log_pk"],
            p["split"],
            p["pk1"],
            per_row,
            anchor,
            offset,
            ctx.work(core.topk_loss.FORWARD_WORK),
        )
        return self._reduce(ctx, per_row)

    def target_count(self, layout, arguments):
        return int(np.shape(arguments["p_k"])[-1])

    def _row_gradients(self, ctx, cot):
        rows, p, s = ctx.rows, ctx.params, ctx.saved
        x_bar = ctx.empty(rows.xs.shape)
        alpha_bar = ctx.empty(rows.rows)
        _kernel(ctx, ctx.kernels.topk_loss_vjp)(
            rows.xs,
            rows.order,
            ctx.alpha,
            p["labels"],
            p["log_pk"],
            p["split"],
            p["pk1"],
            s["anchor"],
            s["offset"],
            cot,
            x_bar,
            alpha_bar,
            ctx.work(
                core.topk_loss.CPU_GRADIENT_WORK
                if ctx.kernels is core
                else core.topk_loss.GRADIENT_WORK
            ),
        )
        return x_bar, alpha_bar


class PermutationCrossEntropyRule(LossRule):
    differentiable = ("x", "alpha")
    index_residuals = ("order", "anchor")  # the CPU forward keeps int32 anchors

    @staticmethod
    def _ladder(ctx: Context) -> bool:
        """Whether the CPU's ladder kernels run (int32 anchors, 3 rows of scratch)."""
        return ctx.kernels is core and ctx.rows.n < 2**31

    def prepare(self, x, target_ranks, alpha, reduction, descending, order=None):
        rows = Rows.from_input(x, -1, negate=check_flag(descending, "descending"), order=order)
        ctx = Context.of(rows, alpha)
        ctx.params["reduction"] = check_reduction(reduction)
        if self._ladder(ctx):
            # the ladder forward finds repeated ranks as it places the values by rank, so
            # whether each row is a permutation is checked there (check_target_ranks' own
            # pass would cost a noticeable part of the sort); here only the ranks' range, kept
            # as int32 (their copy: 4 bytes per element, not 8)
            ranks = check_labels(
                target_ranks, rows.batch_shape, "target_ranks", 1, rows.n, (rows.n,), np.int32
            )
        else:
            ranks = check_target_ranks(target_ranks, rows.batch_shape, rows.n)
        ctx.params["target"] = rows.backend.from_host(ranks)
        return ctx

    def restore(self, arguments, residuals):
        negate = bool(arguments["descending"])
        ctx = _restored(arguments, residuals, negate=negate)
        rows = ctx.rows
        ctx.params["reduction"] = arguments["reduction"]
        dtype = np.int32 if self._ladder(ctx) else np.int64  # (as prepare keeps them)
        ranks = label_rows(arguments["target_ranks"], rows.batch_shape, (rows.n,), dtype)
        ctx.params["target"] = rows.backend.from_host(ranks)
        return ctx

    def target_count(self, layout, arguments):
        return layout.n - 1

    def forward(self, ctx):
        rows = ctx.rows
        per_row = ctx.empty(rows.rows)
        if self._ladder(ctx):
            # int32 anchors (4 bytes per element less while the gradients keep them) and 3
            # rows of scratch, the same losses and boundaries to the bit
            shape = (rows.rows, rows.n - 1)
            s = ctx.saved
            s["anchor"], s["offset"] = ctx.empty(shape, np.int32), ctx.empty(shape)
            repeated = core.permutation.ladder_loss_forward(
                rows.xs,
                rows.order,
                ctx.alpha,
                ctx.params["target"],
                per_row,
                s["anchor"],
                s["offset"],
                ctx.work(core.permutation.LADDER_FORWARD_WORK),
                repeated=False,  # (refused below: no kernel of their own to compile)
            )
            if repeated or np.isnan(per_row).any():
                # a row that repeats a rank, or one with NaN (its ranks were not read): the
                # full check raises the error that names the row
                ranks = ctx.params["target"].reshape(rows.batch_shape + (rows.n,))
                check_target_ranks(ranks, rows.batch_shape, rows.n)
            return self._reduce(ctx, per_row)
        anchor, offset = ctx.target_storage(rows.n - 1)
        ctx.kernels.permutation_loss_forward(
            rows.xs,
            rows.order,
            ctx.alpha,
            ctx.params["target"],
            *_boundary_targets(rows),
            per_row,
            anchor,
            offset,
            ctx.work(core.permutation.LOSS_FORWARD_WORK),
        )
        return self._reduce(ctx, per_row)

    def _row_gradients(self, ctx, cot):
        rows, s = ctx.rows, ctx.saved
        alpha_bar = ctx.empty(rows.rows)
        x_bar = ctx.empty(rows.xs.shape)
        if ctx.kernels is core:
            # the VJP in 3 rows of scratch and the row of x_bar (the same values to the bit)
            core.permutation.ladder_loss_vjp(
                rows.xs,
                rows.order,
                ctx.alpha,
                ctx.params["target"],
                s["anchor"],
                s["offset"],
                cot,
                x_bar,
                alpha_bar,
                ctx.work(core.permutation.LADDER_VJP_WORK),
            )
            return x_bar, alpha_bar
        ctx.kernels.permutation_loss_vjp(
            rows.xs,
            rows.order,
            ctx.alpha,
            ctx.params["target"],
            s["anchor"],
            s["offset"],
            _boundary_targets(rows)[1],
            cot,
            x_bar,
            alpha_bar,
            ctx.work(core.permutation.GRADIENT_WORK),
            ctx.work(core.permutation.BOUNDARY_WORK, rows.n - 1),
        )
        return x_bar, alpha_bar
