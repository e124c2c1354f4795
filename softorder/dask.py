"""Dask: softorder's operations, and their gradients, on dask arrays chunked along batch axes.

Usage::

    import softorder, softorder.dask

    ranks = softorder.dask.apply(softorder.soft_rank, x, alpha=0.5)  # x: a dask.array.Array
    ranks, pullback = softorder.dask.vjp(softorder.soft_rank, x, alpha=0.5)
    x_bar, alpha_bar = pullback(cotangent)  # dask arrays, lazy like ranks

Every operation works row by row, so each chunk of rows is one call of the NumPy operation
(one task), provided the chunk holds whole rows: the rows lie along the last axis, which must
be one chunk (``x.rechunk({-1: -1})``); the batch axes before it may be chunked freely. A row
split over several chunks raises ``ValueError``; it is never computed in pieces.

Arguments
    Per-row arguments (a per-row ``alpha``, ``k`` or ``q``, several ``k`` per row, ``labels``,
    ``target_ranks``, a per-row ``p_k``) are split like the input's chunks: dask arrays,
    whose leading axes must be the input's batch axes, and NumPy arrays or lists whose
    leading axes are those batch axes. Other arguments are checked against the whole batch,
    as the NumPy API checks them; an array that broadcasts along a batch axis split into
    several chunks (``alpha`` of shape ``(rows, 1)``) is split with the rows, its gradient
    summed back to its shape; everything else (scalars, ``p_k`` of shape ``(K,)``, ``q`` of
    shape ``(1, m)``) goes whole to every task.
Losses
    Each task returns its rows' losses; ``reduction="mean"`` and ``"sum"`` are taken over all
    rows by dask, so they equal the NumPy call on the whole batch up to rounding: dask sums
    per chunk, then the chunks' sums (a few ulp from NumPy's pairwise sum over all rows).
Gradients
    ``pullback`` returns the gradients of :func:`softorder.vjp` (same order) as dask arrays:
    the input's, and those of per-row arguments, chunked like them; those of shared
    arguments (a scalar ``alpha``) are sums of the tasks' gradients over the chunks (so,
    as a reduced loss, equal to NumPy's up to rounding: a few ulp). Each
    gradient task runs its chunk's forward pass again (O(n log n) per row), so nothing is kept
    between the two graphs.
Schedulers
    Any: threads (the kernels release the GIL), processes, or ``dask.distributed``, whose
    workers import softorder and load its compiled kernels from the on-disk cache.

This module imports dask; ``import softorder`` does not import it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import dask
import dask.array as da
import numpy as np

from softorder._engine.autodiff import bind, rule_of
from softorder._engine.autodiff import vjp as _vjp
from softorder._engine.backend import unbroadcast
from softorder._engine.checks import check_argument, host_value
from softorder._engine.layout import Layout, row_aligned, trailing_axes

__all__ = ["apply", "vjp"]

_REDUCTIONS = ("mean", "sum", "none")


class _Plan:
    """How one call splits into tasks: the arguments per chunk and the result's layout."""

    def __init__(self, op: Callable, x: Any, args: tuple, kwargs: dict):
        self.op = op
        self.rule = rule_of(op)  # TypeError for anything but a softorder operation
        arguments = bind(op.signature, (x, *args), kwargs)
        parameters = op.signature.parameters.values()
        names = [p.name for p in parameters if p.kind is not p.KEYWORD_ONLY]
        self.input_name = names[0]
        x = arguments[self.input_name]
        if not isinstance(x, da.Array):
            raise TypeError(
                f"softorder.dask: {self.input_name} must be a dask array; got "
                f"{type(x).__name__} (call softorder.{op.__name__} directly on NumPy arrays)"
            )
        if x.ndim == 0:
            raise ValueError(f"softorder.dask: {self.input_name} must have at least one axis")
        if any(np.isnan(n) for n in x.shape):
            raise ValueError(
                f"softorder.dask: {self.input_name} has unknown chunk sizes (shape {x.shape}); "
                f"call {self.input_name}.compute_chunk_sizes() first"
            )
        if "axis" in arguments:
            axis = arguments["axis"]
            if not isinstance(axis, (int, np.integer)) or axis not in (-1, x.ndim - 1):
                raise ValueError(
                    f"softorder.dask works along the last axis; got axis={axis!r} for "
                    f"{self.input_name} of shape {x.shape} (move it last with "
                    f"dask.array.moveaxis({self.input_name}, {axis!r}, -1))"
                )
        if len(x.chunks[-1]) != 1:
            raise ValueError(
                f"softorder.dask: every chunk of {self.input_name} must hold whole rows, but its "
                f"row axis (the last, of length {x.shape[-1]}) is split into chunks "
                f"{x.chunks[-1]}; rechunk it whole: {self.input_name}.rechunk({{-1: -1}})"
            )
        self.nb = x.ndim - 1
        self.batch_chunks = x.chunks[:-1]
        self.reduction = arguments.get("reduction")
        if self.reduction is not None:
            if self.reduction not in _REDUCTIONS:
                raise ValueError(f"reduction must be one of {_REDUCTIONS}; got {self.reduction!r}")
            arguments["reduction"] = "none"  # each task returns its rows' losses
        self.per_row = {self.input_name: x}
        #: shared arguments that broadcast along a chunked batch axis, split as per-row ones
        #: (broadcast to the batch): their shapes, to which their gradients are summed
        self.spread: dict = {}
        layout = None
        for name in names[1:]:
            value = arguments[name]
            if isinstance(value, da.Array):
                pass
            elif row_aligned(name, value, x.shape[:-1]):
                # one entry per row as NumPy data (labels, a per-row alpha): split with the rows
                value = da.from_array(np.asarray(value), chunks=-1)
            else:
                # the NumPy API's check on the whole batch: a task sees only its chunk's rows,
                # where alpha of shape (2, 3) for a batch (4, 3) broadcasts (silently reused
                # by every chunk of 2 rows)
                layout = layout or Layout.of(tuple(x.shape), -1, self.input_name)
                check_argument(name, host_value(value, name), layout)
                spread = _spread(name, value, self.batch_chunks)
                if spread is not None:
                    self.spread[name] = np.shape(value)
                    value = da.from_array(spread, chunks=-1)
            if isinstance(value, da.Array):
                if value.shape[: self.nb] != x.shape[:-1]:
                    raise ValueError(
                        f"softorder.dask: {name}, a dask array, is a per-row argument: its "
                        f"leading axes must be the batch axes {x.shape[:-1]} of "
                        f"{self.input_name}; got shape {value.shape}"
                    )
                whole = tuple((n,) for n in value.shape[self.nb :])
                self.per_row[name] = value.rechunk(self.batch_chunks + whole)
        self.shared = {k: v for k, v in arguments.items() if k not in self.per_row}
        shape, _ = self.rule.describe(arguments)  # from the shapes alone
        if tuple(shape[: self.nb]) != x.shape[:-1]:  # pragma: no cover - every rule has them
            raise NotImplementedError(
                f"softorder.dask: the result of {op.__name__} does not start with the batch axes"
            )
        self.tail = tuple(shape[self.nb :])
        kind = np.dtype(x.dtype).kind
        self.dtype = np.dtype(x.dtype) if kind == "f" else np.dtype(np.float64)
        self.blocks = {
            name: value.to_delayed().reshape(x.numblocks[:-1] + (-1,))
            for name, value in self.per_row.items()
        }

    def indices(self):
        return itertools.product(*(range(len(c)) for c in self.batch_chunks))

    def rows(self, index: tuple) -> tuple:
        return tuple(c[i] for c, i in zip(self.batch_chunks, index, strict=True))

    def chunk_arguments(self, index: tuple) -> dict:
        return {name: blocks[index][0] for name, blocks in self.blocks.items()}

    def assemble(self, pieces: dict) -> da.Array:
        """One dask array from the chunks' arrays (``index -> array``), along the batch axes."""

        def join(level: int, prefix: tuple) -> da.Array:
            if level == self.nb:
                return pieces[prefix]
            parts = [join(level + 1, prefix + (i,)) for i in range(len(self.batch_chunks[level]))]
            return parts[0] if len(parts) == 1 else da.concatenate(parts, axis=level)

        return join(0, ())

    def reduce(self, losses: da.Array) -> da.Array:
        """The rows' losses (float64 when reduced) reduced as the NumPy API reduces them: the
        mean as the sum times ``1 / rows``, in float64, then in the input's dtype.
        """
        if self.reduction == "mean":
            rows = losses.size
            mean = losses.sum() * (1.0 / rows) if rows else da.full((), np.nan)
            return mean.astype(self.dtype)
        if self.reduction == "sum":
            return losses.sum().astype(self.dtype)
        return losses


def _spread(name: str, value: Any, batch_chunks: tuple) -> np.ndarray | None:
    """``value`` of argument ``name`` (valid for the whole batch) broadcast to one entry per
    row, when it broadcasts along a batch axis split into several chunks (alpha of shape
    ``(4, 1)`` for a batch ``(4, 3)`` chunked along its first axis: a task's rows would not
    match it); ``None`` when every task can take it whole.
    """
    arr = np.asarray(value)
    nb = len(batch_chunks)
    trailing = trailing_axes(name, arr, nb)
    lead = arr.shape[: arr.ndim - trailing]
    if len(lead) > nb:
        return None
    batch = tuple(sum(chunks) for chunks in batch_chunks)
    if not any(
        size != 1 and len(batch_chunks[nb - len(lead) + i]) > 1 for i, size in enumerate(lead)
    ):
        return None
    return np.broadcast_to(arr, batch + arr.shape[arr.ndim - trailing :])


def _forward_chunk(
    op: Callable, shared: dict, dtype: np.dtype, chunk: dict, widen: str | None = None
) -> np.ndarray:
    if widen is not None:  # (see _backward_chunk)
        chunk = {**chunk, widen: np.asarray(chunk[widen], dtype=np.float64)}
    return np.asarray(op(**shared, **chunk), dtype=dtype)


def _backward_chunk(
    op: Callable,
    shared: dict,
    dtypes: tuple,
    chunk: dict,
    cotangent: np.ndarray,
    widen: str | None = None,
) -> tuple:
    if widen is not None:
        # the input (``widen`` names it) in float64: the kernels run in float64 either way,
        # and the gradients come back unrounded, for a sum over the chunks rounded once
        chunk = {**chunk, widen: np.asarray(chunk[widen], dtype=np.float64)}
    _, pullback = _vjp(op, **shared, **chunk)
    grads = pullback(np.asarray(cotangent))
    return tuple(np.asarray(g, dtype=t) for g, t in zip(grads, dtypes, strict=True))


def apply(op: Callable, x: da.Array, *args: Any, **kwargs: Any) -> da.Array:
    """A softorder operation on a dask array, one task per chunk of whole rows.

    Parameters
    ----------
    op : callable
        A softorder operation of the NumPy API, e.g. :func:`softorder.soft_rank`.
    x : dask.array.Array
        Its input, with the rows along the last axis, which must be one chunk.
    *args, **kwargs
        Its other arguments, as for ``op``: dask arrays, and NumPy arrays or lists whose
        leading axes are ``x``'s batch axes, are per-row arguments, split like ``x``'s
        chunks; anything else is checked against the whole batch and goes whole to every
        task (split with the rows where it broadcasts along a chunked batch axis).

    Returns
    -------
    dask.array.Array
        ``op(x, *args, **kwargs)``, lazily, chunked like ``x`` along the batch axes.

    Raises
    ------
    ValueError
        If a row of ``x`` is split over several chunks, ``axis`` is not the last axis, or a
        per-row argument does not have ``x``'s batch axes.

    Examples
    --------
    >>> import dask.array as da, numpy as np, softorder, softorder.dask
    >>> x = da.from_array(np.array([[0.5, -1.0, 3.0], [2.0, 1.0, 0.0]]), chunks=(1, 3))
    >>> ranks = softorder.dask.apply(softorder.soft_rank, x, alpha=0.01)
    >>> ranks.chunks
    ((1, 1), (3,))
    >>> ranks.compute(scheduler="threads")
    array([[2., 1., 3.],
           [3., 2., 1.]])
    >>> softorder.dask.apply(softorder.soft_rank, x.rechunk((2, 2)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: softorder.dask: every chunk of x must hold whole rows, but its row axis ...
    """
    plan = _Plan(op, x, args, kwargs)
    task = dask.delayed(_forward_chunk, pure=True)
    # the rows' losses of a reduced loss are computed and summed in float64, then rounded
    # once, as in the NumPy API: rounded to the input's dtype (float32) first, they lost bits
    reduced = plan.reduction in ("mean", "sum")
    dtype = np.dtype(np.float64) if reduced else plan.dtype
    widen = plan.input_name if reduced and plan.dtype != np.float64 else None
    pieces = {
        index: da.from_delayed(
            task(op, plan.shared, dtype, plan.chunk_arguments(index), widen),
            shape=plan.rows(index) + plan.tail,
            dtype=dtype,
        )
        for index in plan.indices()
    }
    return plan.reduce(plan.assemble(pieces))


def vjp(op: Callable, x: da.Array, *args: Any, **kwargs: Any) -> tuple[da.Array, Callable]:
    """A softorder operation on a dask array and its pullback, like :func:`softorder.vjp`.

    Parameters
    ----------
    op, x, *args, **kwargs
        As for :func:`apply`.

    Returns
    -------
    out : dask.array.Array
        :func:`apply` of the same arguments.
    pullback : callable
        ``pullback(cotangent)`` takes an array shaped like ``out`` (a dask or NumPy array, or
        a scalar for a reduced loss) and returns, lazily, the gradients of the differentiable
        arguments in :func:`softorder.vjp`'s order: those of ``x`` and of per-row arguments
        chunked like them, those of shared arguments summed over the chunks.

    Examples
    --------
    >>> import dask.array as da, numpy as np, softorder, softorder.dask
    >>> x_np = np.array([[0.5, -1.0, 3.0], [2.0, 1.0, 0.0]])
    >>> x = da.from_array(x_np, chunks=(1, 3))
    >>> ranks, pullback = softorder.dask.vjp(softorder.soft_rank, x, alpha=0.5)
    >>> x_bar, alpha_bar = pullback(np.ones((2, 3)) * [1.0, 0.0, 0.0])
    >>> _, reference = softorder.vjp(softorder.soft_rank, x_np, alpha=0.5)
    >>> ref_x, ref_alpha = reference(np.ones((2, 3)) * [1.0, 0.0, 0.0])
    >>> bool(np.allclose(x_bar.compute(), ref_x)), bool(np.isclose(alpha_bar.compute(), ref_alpha))
    (True, True)
    """
    plan = _Plan(op, x, args, kwargs)
    out = apply(op, x, *args, **kwargs)
    differentiable = plan.rule.differentiable

    def pullback(cotangent: Any) -> tuple:
        rows_shape = x.shape[:-1]
        if plan.reduction in ("mean", "sum"):
            rows = int(np.prod(rows_shape))
            scale = 1.0 / max(rows, 1) if plan.reduction == "mean" else 1.0
            # widened, then scaled in float64, as the NumPy API does: in the input's dtype
            # (float32) the cotangent and its share of each row were rounded
            per_row = da.asarray(cotangent).astype(np.float64) * scale
            if per_row.ndim != 0:
                raise ValueError(
                    f"softorder.dask: the cotangent of a {plan.reduction!r} loss is a scalar; "
                    f"got shape {per_row.shape}"
                )
            cotangent = da.broadcast_to(per_row, rows_shape, chunks=plan.batch_chunks)
        elif np.shape(cotangent) != out.shape:
            raise ValueError(
                f"softorder.dask: cotangent must have the result's shape {out.shape}; got "
                f"{np.shape(cotangent)}"
            )
        whole = tuple((n,) for n in plan.tail)
        cotangent = da.asarray(cotangent).rechunk(plan.batch_chunks + whole)
        ct_blocks = cotangent.to_delayed().reshape(x.numblocks[:-1] + (-1,))
        # the NumPy API's dtypes; a shared argument's gradient (the sum of the chunks') is
        # summed in float64 first: summed in the input's dtype (float16, float32) it lost bits
        summed = [n for n in differentiable if n not in plan.per_row or n in plan.spread]
        dtypes = tuple(np.dtype(np.float64) if n in summed else plan.dtype for n in differentiable)
        narrow = plan.dtype != np.float64 and bool(summed)
        widen = plan.input_name if narrow else None
        task = dask.delayed(_backward_chunk, pure=True, nout=len(differentiable))
        grads: dict = {name: {} for name in differentiable}
        for index in plan.indices():
            chunk = plan.chunk_arguments(index)
            results = task(op, plan.shared, dtypes, chunk, ct_blocks[index][0], widen)
            for name, dtype, grad in zip(differentiable, dtypes, results, strict=True):
                if name in plan.per_row:
                    shape = plan.rows(index) + plan.per_row[name].shape[plan.nb :]
                else:
                    shape = np.shape(plan.shared[name])
                grads[name][index] = da.from_delayed(grad, shape=shape, dtype=dtype)
        out_grads = []
        for name in differentiable:
            if name in plan.spread:  # summed over the axes it was broadcast along
                total = unbroadcast(plan.assemble(grads[name]), plan.spread[name])
                out_grads.append(total.astype(plan.dtype))
            elif name in plan.per_row:
                out_grads.append(plan.assemble(grads[name]))
            else:  # a shared argument: the chunks' gradients add up
                total = da.stack(list(grads[name].values())).sum(axis=0)
                out_grads.append(total.astype(plan.dtype))
        return tuple(out_grads)

    return out, pullback
