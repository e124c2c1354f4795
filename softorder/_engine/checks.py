"""Validation of the arguments, from values and shapes alone: written once for the NumPy API,
the rules and both bridges.

Every function here takes plain values (host arrays, Python numbers) and the shapes they must
fit (a batch shape, a row length ``n``, or a :class:`~softorder._engine.layout.Layout`), never
the sorted rows of a call, so that a bridge can check its arguments when a function is traced,
before any data exists. Each raises ``TypeError`` or ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import TYPE_CHECKING

import numpy as np

from softorder._engine.backend import float_array, host_array

if TYPE_CHECKING:
    from softorder._engine.layout import Layout

#: the reductions of the losses
REDUCTIONS = ("mean", "sum", "none")

#: the smallest alpha taken: 1/alpha must be finite
SMALLEST_ALPHA = float(np.finfo(np.float64).tiny)
#: the largest finite float64: a per-row alpha above it is inf (refused by the general path)
LARGEST_FLOAT = float(np.finfo(np.float64).max)
#: NumPy's scalar types that check_alpha converts without the general path: any value of a
#: narrower float, a positive integer up to _EXACT_INTEGER (float() is exact for those)
_NARROW_FLOATS = (np.float32, np.float16)
_NUMPY_INTEGERS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32)
_EXACT_INTEGER = 2**53


def refuse_masked(value, name: str) -> None:
    """``TypeError`` for a :class:`numpy.ma.MaskedArray`: its mask would be silently lost."""
    if type(value) is not np.ndarray and isinstance(value, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a numpy.ma.MaskedArray; softorder does not read masks (np.asarray would "
            f"silently drop it): fill the masked entries explicitly, e.g. {name}.filled(-np.inf) "
            "as padding for soft_topk(largest=True), or pass np.ma.getdata"
            f"({name}) to ignore the mask"
        )


def check_flag(value, name: str) -> bool:
    """``value`` as a bool, or ``TypeError`` naming ``name``: only ``True``/``False`` (or NumPy
    bools) are flags; a string such as ``"False"`` would otherwise count as true.
    """
    if value is True or value is False:  # (the common case, before isinstance's call)
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False); got {value!r}")


def alpha_batch_shape(alpha_shape: tuple, batch_ndim: int, axis: int) -> tuple:
    """The shape of an ``alpha`` argument lined up with the batch axes: an ``alpha`` with as
    many axes as ``x`` (NumPy's ``keepdims`` shape, e.g. ``x.std(axis, keepdims=True)``) loses
    the operation's ``axis`` (its length is 1); any other shape is already aligned.
    """
    if len(alpha_shape) == batch_ndim + 1:
        return alpha_shape[:axis] + alpha_shape[axis + 1 :]
    return alpha_shape


def check_alpha(
    alpha, batch_shape: tuple = (), axis: int | None = None
) -> tuple[np.ndarray, tuple]:
    """``alpha`` once per row as float64 ``(rows,)``, and the shape the caller gave it.

    ``alpha`` is a positive finite scalar, or an array of them broadcastable to
    ``batch_shape`` (one temperature per row). With ``axis`` (the operation's axis, counted
    from 0 in ``x``, which has ``len(batch_shape) + 1`` axes) ``alpha`` may also have ``x``'s
    number of axes with length 1 along ``axis`` (NumPy's ``keepdims`` shape). Anything else
    raises ``TypeError`` or ``ValueError`` naming alpha and the offending value.
    """
    # the common cases first, fast: one valid scalar (np.ndarray exactly: not a masked array)
    # as the general path converts it (np.asarray(alpha, float64): a float, a narrower float
    # widened exactly, an integer up to 2**53 exactly)
    value = math.nan
    if isinstance(alpha, float):
        value = alpha
    elif type(alpha) in _NARROW_FLOATS:  # (before any comparison with a Python int: 2**53
        value = float(alpha)  # would overflow a float16, with a warning)
    elif type(alpha) is int or type(alpha) in _NUMPY_INTEGERS:
        if 0 < alpha <= _EXACT_INTEGER:
            value = float(alpha)
    elif type(alpha) is np.ndarray and alpha.shape == () and alpha.dtype.kind in "iuf":
        value = float(alpha)
    rows = math.prod(batch_shape)
    if math.isfinite(value) and value >= SMALLEST_ALPHA and rows:
        per_row = np.empty(rows)  # (np.full's Python wrapper costs twice as much)
        per_row.fill(value)
        return per_row, ()
    if type(alpha) is np.ndarray and alpha.dtype.kind == "f" and rows:
        # one alpha per row already (a bridge's call, or x.std(axis)), or in the keepdims
        # shape (x.std(axis, keepdims=True): its C order is the batch's), checked in two
        # passes (the ufuncs' reductions: ndarray.min's Python wrapper costs as much)
        shape = alpha.shape
        if shape == batch_shape or (
            axis is not None
            and len(shape) == len(batch_shape) + 1
            and shape[axis] == 1
            and shape[:axis] + shape[axis + 1 :] == batch_shape
        ):
            per_row = alpha.reshape(-1).astype(np.float64)  # (a copy: writable, never aliased)
            if (
                np.minimum.reduce(per_row) >= SMALLEST_ALPHA
                and np.maximum.reduce(per_row) <= LARGEST_FLOAT
            ):
                return per_row, shape
    refuse_masked(alpha, "alpha")
    if isinstance(alpha, bool) or (
        not isinstance(alpha, numbers.Real) and host_array(alpha, "alpha").dtype.kind not in "iuf"
    ):
        raise TypeError(f"alpha must be a positive real scalar or array; got {alpha!r}")
    arr = np.asarray(alpha, dtype=np.float64)
    nb = len(batch_shape)
    try:
        if axis is not None and arr.ndim == nb + 1:  # the keepdims shape: length 1 along axis
            if arr.shape[axis] != 1:
                raise ValueError
            full = np.broadcast_to(arr.reshape(alpha_batch_shape(arr.shape, nb, axis)), batch_shape)
        else:
            full = np.broadcast_to(arr, batch_shape)
    except ValueError:
        keepdims = batch_shape[:axis] + (1,) + batch_shape[axis:] if axis is not None else None
        raise ValueError(
            f"alpha of shape {arr.shape} does not broadcast to the batch shape {batch_shape}"
            + (f" or to the keepdims shape {keepdims} (one alpha per row)" if keepdims else "")
        ) from None
    bad = ~(np.isfinite(arr) & (arr > 0.0))
    if bad.any():
        raise ValueError(
            f"alpha must be positive and finite; got alpha={arr[bad].flat[0].item()!r}"
        )
    if (arr < SMALLEST_ALPHA).any():
        raise ValueError(
            f"alpha must be at least {SMALLEST_ALPHA:.3g} (1/alpha must be finite); "
            f"got alpha={arr[arr < SMALLEST_ALPHA].flat[0].item()!r}"
        )
    return _writable(np.ascontiguousarray(full).reshape(-1)), arr.shape


def check_labels(
    labels,
    batch_shape: tuple,
    name: str,
    low: int,
    high: int,
    core_shape: tuple = (),
    dtype=np.int64,
) -> np.ndarray:
    """Integer ``labels`` of shape ``batch_shape + core_shape`` with values in ``[low, high]``,
    as a new ``(rows, *core_shape)`` array of ``dtype`` (a copy even where the caller's array
    is one already: a pullback keeps it, and the caller's later changes to their own array
    must not reach the gradients); ``TypeError``/``ValueError`` naming ``name`` otherwise.
    """
    refuse_masked(labels, name)
    arr = host_array(labels, name)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array; got dtype {arr.dtype}")
    expected = tuple(batch_shape) + core_shape
    if arr.shape != expected:
        raise ValueError(f"{name} must have shape {expected}; got {arr.shape}")
    if arr.size and (arr.min() < low or arr.max() > high):
        bad = arr[(arr < low) | (arr > high)].flat[0]
        raise ValueError(f"{name} must lie in [{low}, {high}]; got {bad.item()}")
    return np.array(arr, dtype=dtype, order="C").reshape((math.prod(batch_shape),) + core_shape)


def _writable(arr: np.ndarray) -> np.ndarray:
    """``arr``, or a copy where it is read-only (a ``broadcast_to`` view, a caller's read-only
    array): numba types read-only arrays apart and would compile every kernel a second time.
    """
    return arr if arr.flags.writeable else arr.copy()


def check_target_ranks(target_ranks, batch_shape: tuple, n: int) -> np.ndarray:
    """``target_ranks`` as int64 ``(rows, n)``: in each row a permutation of ``1..n`` (the
    loss is the cross-entropy of a permutation), or ``ValueError``/``TypeError`` naming it.
    """
    ranks = check_labels(target_ranks, batch_shape, "target_ranks", 1, n, (n,))
    # ranks lie in [1, n]: a row holds all of them iff none repeats (flat indices: cheaper
    # than put_along_axis)
    seen = np.zeros(ranks.shape[0] * (n + 1), dtype=bool)
    seen[(ranks + (n + 1) * np.arange(ranks.shape[0])[:, None]).ravel()] = True
    missing = ~seen.reshape(-1, n + 1)[:, 1:].all(axis=1)
    if missing.any():
        row = int(np.argmax(missing))
        repeated = int(np.argmax(np.bincount(ranks[row], minlength=n + 1) > 1))
        where = np.unravel_index(row, batch_shape) if batch_shape else ()
        raise ValueError(
            f"target_ranks must be a permutation of 1..{n} along the last axis (each rank "
            f"once); row {tuple(int(i) for i in where)} repeats rank {repeated}"
        )
    return ranks


#: how far each row of ``p_k`` may sum from 1 (in float64), beyond the rounding of its dtype
P_K_TOLERANCE = 1e-6


def _p_k_tolerance(pk: np.ndarray) -> float:
    """How far a row of ``p_k`` may sum from 1: :data:`P_K_TOLERANCE`, or four steps of a
    narrow float that holds every entry exactly. float16 and bfloat16 cannot sum to 1 within
    1e-6, and a p_k in one of them may reach this check widened (the bridges compute narrow
    tensors in float32; a loss module's buffer follows ``.half()`` or ``.to(torch.bfloat16)``).
    """
    tolerance = P_K_TOLERANCE
    if pk.dtype.kind == "f":
        tolerance = max(tolerance, 4 * float(np.finfo(pk.dtype).eps))
    if pk.dtype.kind != "f" or pk.dtype.itemsize < 4 or not pk.size:
        return tolerance
    with np.errstate(over="ignore", invalid="ignore"):
        wide = pk.astype(np.float32)
        if not np.array_equal(wide, pk):
            return tolerance
        if not (wide.view(np.uint32) & 0xFFFF).any():  # bfloat16: the top 16 bits only
            return max(tolerance, 4 * 2.0**-7)
        if np.array_equal(wide.astype(np.float16), wide):
            return max(tolerance, 4 * float(np.finfo(np.float16).eps))
    return tolerance


def check_p_k(p_k, batch_shape: tuple, n: int) -> np.ndarray:
    """``p_k`` broadcast to ``batch_shape + (K,)`` as float64, or ``ValueError`` saying what
    is wrong: no trailing K axis, K >= n classes, a shape that does not broadcast, or not a
    probability distribution.
    """
    given = float_array(p_k, "p_k")[0] if type(p_k) in (list, tuple) else p_k
    if (
        type(given) is np.ndarray
        and given.dtype.kind == "f"
        and given.shape[:-1] in (batch_shape, ())
        and 0 < given.shape[-1] < n
        and given.itemsize >= 4
        and given.size  # (an empty batch has nothing to reduce: the general path)
    ):  # one distribution per row, as the bridges' callbacks pass it, or one for every row
        pk = given.astype(np.float64)
        if pk.min() >= 0.0 and np.abs(pk.sum(-1) - 1.0).max() <= P_K_TOLERANCE:
            # (no entry is NaN or inf: the row sums would not be near 1)
            if pk.ndim > 1:
                return pk
            if math.prod(batch_shape) == 1:  # one row: np.tile's copy, as a view of pk's own
                return pk.reshape(batch_shape + pk.shape)
            return np.tile(pk, batch_shape + (1,))
    refuse_masked(p_k, "p_k")
    pk, _ = float_array(p_k, "p_k")
    if pk.dtype.kind == "b":
        raise TypeError(f"p_k must hold probabilities, not bools; got {p_k!r}")
    tolerance = _p_k_tolerance(pk)
    if pk.ndim == 0 or pk.shape[-1] == 0:
        raise ValueError(
            f"p_k must list P_K(k) for k = 1..K along its last axis; got shape {pk.shape}"
        )
    K = pk.shape[-1]
    if K >= n:
        raise ValueError(
            f"p_k has K={K} entries but top-k needs k < number of classes "
            f"(C={n}); give at most {n - 1}"
        )
    try:
        full = np.broadcast_to(pk, batch_shape + (K,))
    except ValueError:
        raise ValueError(
            f"p_k of shape {np.shape(p_k)} does not broadcast to {batch_shape + (K,)}"
        ) from None
    # the caller's rows, not the broadcast ones: an empty batch does not hide a bad p_k
    pk = pk.astype(np.float64)
    if not np.all(np.isfinite(pk) & (pk >= 0)):
        bad = pk[~(np.isfinite(pk) & (pk >= 0))].flat[0]
        raise ValueError(
            "p_k must be a probability distribution over k = 1..K (non-negative, summing to "
            f"1); got an entry {bad.item()!r}"
        )
    deviation = np.abs(pk.sum(-1) - 1.0)
    if deviation.size and deviation.max() > tolerance:
        worst = pk.sum(-1).flat[int(np.argmax(deviation))]
        raise ValueError(
            "p_k must be a probability distribution over k = 1..K (non-negative, summing to "
            f"1 within {tolerance:.3g}); got a sum of {worst.item()!r}. It is used as given, "
            "not renormalised: divide it by its sum first if that is what you mean"
        )
    return full.astype(np.float64)


def check_reduction(reduction) -> str:
    """``reduction`` of a loss, or ``ValueError`` naming the choices."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    return reduction


def check_targets(
    value, batch_shape: tuple, name: str, high: float, high_text: str
) -> tuple[np.ndarray, bool, tuple]:
    """Inversion targets (``k`` of top-k, ``q`` of quantile) strictly between 0 and ``high``.

    ``value`` broadcasts to ``batch_shape`` (one target per row) or, with one more trailing
    axis, lists several targets per row. Returns the targets as float64 ``(rows, m)``, whether
    there were several per row, and the shape the caller gave (for the gradient).
    """
    nb = len(batch_shape)
    if (
        type(value) is np.ndarray
        and value.dtype.kind == "f"
        and value.shape[:nb] == batch_shape
        and value.ndim - nb in (0, 1)
        and value.size
    ):  # already one (or m) per row, as the bridges' callbacks pass them: two reductions
        m = value.shape[-1] if value.ndim > nb else 1
        values = value.astype(np.float64).reshape(math.prod(batch_shape), m)
        if values.min() > 0.0 and values.max() < high:
            return values, value.ndim > nb, value.shape
    if (
        not nb
        and type(value) in (list, tuple)
        and value
        and all(type(v) in (float, int) for v in value)
    ):  # several targets of one row as a list of numbers, the usual call: no broadcast
        values = np.array(value, dtype=np.float64)
        if values.min() > 0.0 and values.max() < high:  # (NaN fails both)
            return values.reshape(1, -1), True, values.shape
    if (
        nb
        and type(value) in (list, tuple)
        and (len(value) == 1 or (nb == 1 and len(value) == batch_shape[0]))
        and all(type(v) in (float, int) for v in value)
    ):  # a list of numbers with batch axes: one for every row, or (one batch axis) one per
        # row; what the general path's broadcast gives, without it
        values = np.array(value, dtype=np.float64)
        if values.min() > 0.0 and values.max() < high:  # (NaN fails both)
            rows = math.prod(batch_shape)
            if len(value) == rows:
                return values.reshape(rows, 1), False, values.shape
            full = np.empty((rows, 1))
            full.fill(values[0])
            return full, False, values.shape
    refuse_masked(value, name)
    arr, _ = float_array(value, name)
    if arr.dtype.kind == "b":  # True would silently be 1
        raise TypeError(f"{name} must be a real number or array, not a bool; got {value!r}")
    multi = arr.ndim == nb + 1
    if arr.ndim > nb + 1:
        raise ValueError(
            f"{name} has {arr.ndim} dimensions; expected at most {nb + 1}: the batch shape "
            f"{batch_shape} plus one optional trailing axis listing several {name} per row"
        )
    target_shape = tuple(batch_shape) + ((arr.shape[-1],) if multi else ())
    try:
        full = np.broadcast_to(arr, target_shape)
    except ValueError:
        hint = (
            f"; to ask for several {name} per row give {name} a trailing axis, "
            f"e.g. shape {(1,) * nb + arr.shape[-1:]}"
            if arr.ndim == nb
            else ""
        )
        raise ValueError(
            f"{name} of shape {arr.shape} does not broadcast to the batch shape {batch_shape}{hint}"
        ) from None
    # the caller's values, not the broadcast ones: an empty batch does not hide a bad k or q
    if arr.size and not np.all((arr > 0) & (arr < high)):
        bad = arr[~((arr > 0) & (arr < high))].flat[0]
        raise ValueError(f"{name} must lie strictly between 0 and {high_text}; got {bad.item()}")
    m = arr.shape[-1] if multi else 1
    values = np.ascontiguousarray(full, dtype=np.float64).reshape(math.prod(batch_shape), m)
    return values, multi, arr.shape


# --- arguments already checked: what the checks return, computed again without them ---------
# A bridge's backward pass rebuilds the context of a forward pass from its residuals and the
# same arguments, which the forward pass checked (softorder._engine.rules: each rule's
# restore); these give the same arrays as the checks above for arguments those accepted.


def alpha_rows(alpha, batch_shape: tuple, axis: int | None = None) -> tuple[np.ndarray, tuple]:
    """:func:`check_alpha`'s result for an ``alpha`` it accepted, without checking it again."""
    rows = math.prod(batch_shape)
    if isinstance(alpha, float) and rows:
        per_row = np.empty(rows)
        per_row.fill(alpha)
        return per_row, ()
    arr = np.asarray(alpha, dtype=np.float64)
    nb = len(batch_shape)
    if axis is not None and arr.ndim == nb + 1:  # the keepdims shape
        arr = arr.reshape(alpha_batch_shape(arr.shape, nb, axis))
    full = np.broadcast_to(arr, batch_shape)
    return _writable(np.ascontiguousarray(full).reshape(-1)), np.shape(alpha)


def target_rows(value, batch_shape: tuple) -> tuple[np.ndarray, bool, tuple]:
    """:func:`check_targets`'s result for targets it accepted, without checking them again."""
    arr = value if type(value) is np.ndarray else np.asarray(value)
    nb = len(batch_shape)
    multi = arr.ndim == nb + 1
    m = arr.shape[-1] if multi else 1
    full = np.broadcast_to(arr, tuple(batch_shape) + ((m,) if multi else ()))
    values = np.ascontiguousarray(full, dtype=np.float64).reshape(math.prod(batch_shape), m)
    return _writable(values), multi, arr.shape


def label_rows(labels, batch_shape: tuple, core_shape: tuple = (), dtype=np.int64) -> np.ndarray:
    """:func:`check_labels`'s (and :func:`check_target_ranks`') result for labels it
    accepted, without checking them again (the bridges' own arrays, alive for the call: no
    copy).
    """
    arr = np.ascontiguousarray(labels, dtype=dtype)
    return _writable(arr.reshape((math.prod(batch_shape),) + core_shape))


def p_k_rows(p_k, batch_shape: tuple) -> np.ndarray:
    """:func:`check_p_k`'s result for a ``p_k`` it accepted, without checking it again."""
    pk = np.asarray(p_k)
    return np.broadcast_to(pk, tuple(batch_shape) + pk.shape[-1:]).astype(np.float64)


# --- checking an argument before the call: the bridges' trace-time checks ------------------

#: the arguments that are real numbers, computed in the call's compute dtype
FLOAT_ARGUMENTS = ("alpha", "k", "q", "p_k")
#: the flags of the operations (keyword-only, bools)
FLAGS = ("largest", "descending", "split_top1")


def positional(parameters) -> tuple:
    """The names of an operation's positional ``parameters`` (its input and array arguments).

    Examples
    --------
    >>> import softorder
    >>> positional(softorder.soft_topk.signature.parameters)
    ('x', 'k', 'alpha')
    """
    return tuple(p.name for p in parameters.values() if p.kind is not p.KEYWORD_ONLY)


def split_arguments(parameters, arguments: dict, is_array=None) -> tuple[tuple, dict]:
    """The names of a call's array arguments and its statics, checked.

    ``parameters`` are the operation's (``inspect.signature(op).parameters``), or the names of
    its positional ones, and ``arguments`` every argument of the call by name. The array
    arguments are the positional parameters, in order; the statics are the keyword-only ones
    (``axis``, the flags, ``reduction``), with the flags as bools. With ``is_array`` (a bridge
    whose numbers are statics: PyTorch's), a positional argument other than the input for
    which ``is_array(value)`` is false is a static too, as a :func:`plain` value.

    Examples
    --------
    >>> import softorder
    >>> parameters = softorder.soft_rank.signature.parameters
    >>> split_arguments(parameters, {"x": 0, "alpha": 1.0, "axis": -1, "descending": False})
    (('x', 'alpha'), {'axis': -1, 'descending': False})
    >>> split_arguments(("x", "alpha"), {"x": 0, "alpha": 1.0, "axis": -1}, lambda v: False)
    (('x',), {'alpha': 1.0, 'axis': -1})
    """
    if type(parameters) is not tuple:
        parameters = positional(parameters)
    names, statics = [], {}
    for name, value in arguments.items():
        if name not in parameters:
            statics[name] = value
        elif is_array is None or name == parameters[0] or is_array(value):
            names.append(name)
        else:
            statics[name] = plain(value, name)
    if "reduction" in statics:
        check_reduction(statics["reduction"])
    for flag in FLAGS:
        if flag in statics:
            statics[flag] = check_flag(statics[flag], flag)
    return tuple(names), statics


#: the types that pass as statics as they are
PLAIN_TYPES = (bool, int, float, str, type(None))


def plain(value, name: str):
    """A static argument as a plain Python value (bool, int, float, str, None, or a list of
    them), so that a call spec holds only literals; ``TypeError`` naming ``name`` otherwise.

    Examples
    --------
    >>> plain(np.float32(0.5), "alpha"), plain((1, np.int64(2)), "k")
    (0.5, [1, 2])
    """
    if type(value) in PLAIN_TYPES or isinstance(value, (bool, str, type(None))):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [plain(v, name) for v in value]
    raise TypeError(f"{name} must be a real number, a sequence of them or a tensor; got {value!r}")


def check_axis(axis, shape: tuple, name: str = "x", word: str = "axis") -> int:
    """``axis`` of an input ``name`` of ``shape`` as an int: anything :func:`operator.index`
    takes but a bool, in range, along a non-empty dimension (every API's one check of it).
    ``word`` is what the caller calls the argument; ``"dim"`` (PyTorch) also gives PyTorch's
    words and its ``IndexError`` for a dimension out of range, where NumPy's gives a
    ``ValueError``.

    Examples
    --------
    >>> check_axis(np.int64(-1), (2, 3))
    -1
    >>> check_axis(2, (2, 3))
    Traceback (most recent call last):
    ...
    ValueError: axis 2 is out of range for x with 2 dimensions
    >>> check_axis(2, (2, 3), word="dim")
    Traceback (most recent call last):
    ...
    IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)
    """
    try:
        if isinstance(axis, (bool, np.bool_)):
            raise TypeError
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{word} must be an integer; got {axis!r}") from None
    torch_words = word == "dim"
    ndim = len(shape)
    if ndim == 0:
        what = "dimension" if torch_words else "axis"
        raise ValueError(f"{name} must have at least one {what}; got a scalar")
    if not -ndim <= axis < ndim:
        if torch_words:
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], "
                f"but got {axis})"
            )
        raise ValueError(f"axis {axis} is out of range for {name} with {ndim} dimensions")
    if shape[axis] == 0:
        raise ValueError(
            f"{name} has an empty {word} {axis % ndim} (shape {tuple(shape)}); need n >= 1"
        )
    return axis


def is_floating(dtype) -> bool:
    """Whether ``dtype`` (a NumPy dtype, ml_dtypes' ``bfloat16`` and ``float8_*`` included) is
    a floating dtype.
    """
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("float", "bfloat")))


def check_input_dtype(dtype, name: str) -> bool:
    """Whether an input of ``dtype`` is floating (``False`` for integers and bools), or
    ``TypeError`` naming ``name`` for a dtype that is not real (complex, strings, ...).
    """
    if is_floating(dtype):
        return True
    float_array(np.empty(0, dtype=dtype), name)  # raises for anything not real
    return False


def host_value(value, name: str = "value"):
    """A concrete argument as NumPy sees it: Python numbers as they are, narrow floats
    (float16, bfloat16, ...) widened to float32; a ragged list raises ``ValueError`` naming
    the argument ``name``.
    """
    if isinstance(value, (int, float, bool, complex)):
        return value
    arr = host_array(value, name)
    if is_floating(arr.dtype) and arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float32)
    return arr


def check_concrete(name: str, value, layout: Layout, compute) -> None:
    """:func:`check_argument` for an argument ``name`` other than the input, before the call
    runs: ``value`` (an array of any kind NumPy converts, or a number) as :func:`host_value`
    gives it, and as rounded to ``compute``.
    """
    refuse_masked(value, name)
    check_argument(name, host_value(value, name), layout, compute)


def check_traced(name: str, shape: tuple, dtype, layout: Layout) -> None:
    """:func:`check_argument` for an argument ``name`` whose values are not known yet (a
    traced value): its ``shape`` and the kind of its ``dtype`` (a NumPy dtype, ml_dtypes'
    included), through a :func:`placeholder`.
    """
    kind = np.float64 if is_floating(dtype) else dtype
    check_argument(name, placeholder(name, shape, kind, layout.n), layout)


def row_values(name: str, value, layout: Layout, compute) -> np.ndarray | None:
    """A concrete ``alpha`` or ``k`` that :func:`check_concrete` accepted, once per row as
    the kernels see it in a call computing in ``compute`` (rounded to it, subnormals flushed),
    in ``compute``: ``(rows,)`` for ``alpha``, ``(rows, 1)`` for ``k``; ``None`` for several
    ``k`` per row.
    """
    value = _as_computed_float64(value, compute)
    if name == "alpha":
        return check_alpha(value, layout.batch_shape, layout.axis)[0].astype(compute)
    n = layout.n
    targets, multi, _ = check_targets(value, layout.batch_shape, name, n, f"n={n}")
    return None if multi else targets.astype(compute)


def row_quantiles(value, layout: Layout, compute) -> np.ndarray:
    """A concrete ``q`` that :func:`check_concrete` accepted, as the kernels see it in a call
    computing in ``compute`` (rounded to it, subnormals flushed): ``(rows, m)`` float64, one
    row of ``m`` quantile levels per row of the input (``m = 1`` for one level per row).
    """
    value = _as_computed_float64(value, compute)
    return check_targets(value, layout.batch_shape, "q", 1.0, "1")[0]


def _as_computed_float64(value, compute) -> np.ndarray:
    """A concrete real argument rounded to ``compute`` as the kernels see it, in float64."""
    host = host_value(value)
    if np.dtype(compute) == np.float64:
        return np.asarray(host, dtype=np.float64)
    return as_computed(host, compute).astype(np.float64)


def check_argument(name: str, value, layout: Layout, compute=np.float64) -> None:
    """Raise the NumPy API's error for a bad argument ``name`` (other than the input) of a
    call whose input has ``layout``; ``value`` is a host value or a :func:`placeholder`.

    A real-valued argument (:data:`FLOAT_ARGUMENTS`) of a call that computes in a narrower
    ``compute`` dtype (float32) is checked also as the kernels will see it, rounded to that
    dtype with subnormals flushed to zero: ``alpha=1e-40`` raises "alpha=1e-40 rounds to 0.0
    in float32, ...".

    Examples
    --------
    >>> from softorder._engine.layout import Layout
    >>> layout = Layout.of((2, 5), axis=-1)
    >>> check_argument("k", [[1.0], [4.5]], layout)  # one k per row: valid
    >>> check_argument("alpha", 1e-40, layout, np.float32)
    Traceback (most recent call last):
    ...
    ValueError: alpha=1e-40 rounds to 0.0 in float32, ...: alpha must be positive and finite; ...
    """
    refuse_masked(value, name)
    _validate(name, value, layout)
    if name not in FLOAT_ARGUMENTS or np.dtype(compute) == np.float64:
        return
    rounded = as_computed(value, compute)
    if np.array_equal(rounded, np.asarray(value, dtype=np.float64)):
        return  # exact in float32 (0.5, 2.0, ...): nothing new to check
    try:
        _validate(name, rounded, layout)
    except ValueError as error:
        raise ValueError(f"{_rounding(name, value, rounded, layout.n, compute)}: {error}") from None


def _validate(name: str, value, layout: Layout) -> None:
    n, batch_shape = layout.n, layout.batch_shape
    if name == "alpha":
        check_alpha(value, batch_shape, layout.axis)
    elif name == "k":
        check_targets(value, batch_shape, "k", float(n), f"n={n}")
    elif name == "q":
        check_targets(value, batch_shape, "q", 1.0, "1")
    elif name == "labels":
        check_labels(value, batch_shape, "labels", 0, n - 1)
    elif name == "target_ranks":
        check_target_ranks(value, batch_shape, n)
    elif name == "p_k":
        check_p_k(value, batch_shape, n)


def placeholder(name: str, shape: tuple, dtype, n: int) -> np.ndarray:
    """A valid stand-in for an argument whose values are not known yet (traced): its shape
    and dtype with a valid value, so that :func:`check_argument` checks the shape and the
    dtype's kind; a floating ``dtype`` should be given as float64.
    """
    shape = tuple(shape)
    if name == "target_ranks":  # a permutation where the shape allows it (else the shape speaks)
        fill = np.arange(1, n + 1) if shape[-1:] == (n,) else 1
    elif name == "p_k":
        fill = 1.0 / max(shape[-1], 1) if shape else 1.0
    else:
        fill = {"alpha": 1.0, "k": n / 2.0, "q": 0.5, "labels": 0}[name]
    return np.broadcast_to(np.asarray(fill).astype(dtype), shape)


def as_computed(value, compute) -> np.ndarray:
    """A real argument as the kernels see it in a call computing in ``compute`` (float32):
    rounded to it, subnormals flushed to zero (as XLA does), in ``compute``.
    """
    with np.errstate(over="ignore"):
        arr = np.asarray(value, dtype=np.float64).astype(compute)
    return np.where(np.abs(arr) < np.finfo(compute).tiny, np.zeros((), compute), arr)


def _rounding(name: str, host, rounded: np.ndarray, n: int, compute) -> str:
    """Which value the rounding to ``compute`` spoils, e.g. "alpha=1e-40 rounds to 0.0 in
    float32".
    """
    where = (
        f"in {np.dtype(compute).name}, the dtype this call computes in (the input's; JAX's "
        "default float32 without jax_enable_x64)"
    )
    original = np.broadcast_to(np.asarray(host, dtype=np.float64), rounded.shape)
    bounds = {"alpha": (0.0, np.inf), "k": (0.0, float(n)), "q": (0.0, 1.0)}
    if name in bounds:
        low, high = bounds[name]
        bad = np.flatnonzero(~((rounded > low) & (rounded < high)))
        if bad.size:
            i = bad[0]
            return (
                f"{name}={original.flat[i].item()!r} rounds to {rounded.flat[i].item()!r} {where}"
            )
    if name == "p_k":
        sums = rounded.astype(np.float64).sum(-1)
        i = int(np.argmax(np.abs(sums - 1.0)))
        return (
            f"p_k, which sums to {original.sum(-1).flat[i].item()!r}, sums to "
            f"{sums.flat[i].item()!r} once rounded {where}"
        )
    return f"{name} changes when rounded {where}"
