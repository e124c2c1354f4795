"""The engine's checks for a bridge that checks a call before its data exists (JAX at trace
time): the split of the arguments, the input's dtype policy, and each argument from its value,
or from its shape and dtype alone.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import softorder
from softorder._engine import checks
from softorder._engine.autodiff import RULES
from softorder._engine.call import input_dtypes
from softorder._engine.layout import Layout

#: every public operation (the engine's registry, filled when softorder is imported)
OPERATIONS = sorted(RULES)


@pytest.mark.parametrize("name", OPERATIONS)
def test_split_arguments_follows_the_signature(name):
    op = getattr(softorder, name)
    parameters = op.signature.parameters
    arguments = {p: parameter.default for p, parameter in parameters.items()}
    names, statics = checks.split_arguments(parameters, arguments)
    positional = [
        p.name for p in inspect.signature(op).parameters.values() if p.kind is not p.KEYWORD_ONLY
    ]
    assert list(names) == positional
    assert set(statics) == set(parameters) - set(names)
    assert all(type(statics[flag]) is bool for flag in checks.FLAGS if flag in statics)


def test_split_arguments_checks_flags_and_reduction():
    parameters = softorder.topk_cross_entropy.signature.parameters
    arguments = {"logits": 0, "labels": 0, "p_k": 0, "alpha": 1.0, "reduction": "sum"}
    _, statics = checks.split_arguments(parameters, {**arguments, "split_top1": np.True_})
    assert statics == {"reduction": "sum", "split_top1": True}
    assert type(statics["split_top1"]) is bool
    with pytest.raises(TypeError, match="split_top1 must be a bool"):
        checks.split_arguments(parameters, {**arguments, "split_top1": "False"})
    with pytest.raises(ValueError, match="reduction must be one of"):
        checks.split_arguments(parameters, {**arguments, "reduction": "avg", "split_top1": 1})


def test_input_dtypes():
    assert input_dtypes(np.float64, "x", np.float32) == (np.float64, np.float64)
    assert input_dtypes(np.float32, "x", np.float64) == (np.float32, np.float32)
    assert input_dtypes(np.float16, "x", np.float64) == (np.float32, np.float16)
    assert input_dtypes(np.int8, "x", np.float64) == (np.float64, np.float64)
    assert input_dtypes(np.bool_, "x", np.float32) == (np.float32, np.float32)
    with pytest.raises(TypeError, match="logits must be real; got a complex array"):
        input_dtypes(np.complex64, "logits", np.float64)
    with pytest.raises(TypeError, match="x must be a numeric array; got dtype <U1"):
        input_dtypes(np.dtype("U1"), "x", np.float64)


def test_narrow_floats_of_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float16, np.longdouble):
        assert checks.is_floating(dtype)
    for dtype in (ml_dtypes.int4, np.int64, np.bool_, np.complex64, np.void):
        assert not checks.is_floating(dtype)
    assert input_dtypes(ml_dtypes.bfloat16, "x", np.float64) == (
        np.float32,
        np.dtype(ml_dtypes.bfloat16),
    )
    value = checks.host_value(np.array([0.1, 2.0], ml_dtypes.bfloat16))
    assert value.dtype == np.float32
    np.testing.assert_array_equal(
        value, np.array([0.1, 2.0], ml_dtypes.bfloat16).astype(np.float32)
    )


def test_host_value():
    assert checks.host_value(0.5) == 0.5 and type(checks.host_value(3)) is int
    assert checks.host_value(np.float16([1.5])).dtype == np.float32
    assert checks.host_value([1.0, 2.0]).dtype == np.float64
    assert checks.host_value(np.int32([1])).dtype == np.int32


LAYOUT = Layout.of((2, 5), -1, "x")


@pytest.mark.parametrize(
    "name, shape, dtype",
    [
        ("alpha", (3,), np.float32),
        ("k", (2, 1, 1), np.float32),
        ("q", (4,), np.float64),
        ("labels", (2,), np.float32),
        ("labels", (3,), np.int32),
        ("target_ranks", (2, 4), np.int32),
        ("p_k", (5,), np.float32),
    ],
)
def test_a_traced_argument_raises_as_a_concrete_one_of_its_shape_and_dtype(name, shape, dtype):
    # (a floating traced value is checked as float64: its values, and so its rounding, are
    # not known yet)
    kind = np.float64 if np.dtype(dtype).kind == "f" else dtype
    concrete = np.ones(shape, kind)
    with pytest.raises((TypeError, ValueError)) as expected:
        checks.check_concrete(name, concrete, LAYOUT, np.float64)
    with pytest.raises(type(expected.value)) as traced:
        checks.check_traced(name, shape, dtype, LAYOUT)
    assert str(traced.value) == str(expected.value)


@pytest.mark.parametrize(
    "name, shape, dtype",
    [("alpha", (2, 1), np.float32), ("k", (2,), np.int32), ("labels", (2,), np.int64)],
)
def test_a_valid_traced_argument_passes(name, shape, dtype):
    checks.check_traced(name, shape, dtype, LAYOUT)


def test_a_concrete_argument_is_checked_as_rounded_and_its_mask_refused():
    checks.check_concrete("alpha", 1e-40, LAYOUT, np.float64)
    with pytest.raises(ValueError, match=r"alpha=1e-40 rounds to 0.0 in float32"):
        checks.check_concrete("alpha", 1e-40, LAYOUT, np.float32)
    with pytest.raises(TypeError, match="k is a numpy.ma.MaskedArray"):
        checks.check_concrete("k", np.ma.masked_array([1.0, 2.0]), LAYOUT, np.float64)


def test_row_values():
    alpha = checks.row_values("alpha", 0.1, LAYOUT, np.float32)
    assert alpha.dtype == np.float32 and alpha.shape == (2,)
    np.testing.assert_array_equal(alpha, np.float32(0.1))
    alpha = checks.row_values("alpha", np.array([[0.5], [2.0]]), LAYOUT, np.float64)
    np.testing.assert_array_equal(alpha, [0.5, 2.0])
    k = checks.row_values("k", np.float16(2.5), LAYOUT, np.float64)
    assert k.shape == (2, 1) and k.dtype == np.float64
    np.testing.assert_array_equal(k, 2.5)
    assert checks.row_values("k", [[1.0, 2.0], [3.0, 4.0]], LAYOUT, np.float64) is None


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda x: softorder.soft_rank([[1.0], [1.0, 2.0]]), "x"),
        (lambda x: softorder.soft_topk(x, [[1.0], [1.0, 2.0], [2.0]]), "k"),
        (lambda x: softorder.topk_cross_entropy(x, np.zeros(3, int), [[0.5], [0.5, 0.5]]), "p_k"),
        (lambda x: softorder.soft_rank(x, [[0.5], [0.5, 1.0], [1.0]]), "alpha"),
        (lambda x: softorder.topk_cross_entropy(x, [[1], [1, 2], [0]], [0.5, 0.5]), "labels"),
        (
            lambda x: softorder.permutation_cross_entropy(x, [list(range(1, 7)), [1, 2]]),
            "target_ranks",
        ),
    ],
)
def test_a_ragged_sequence_raises_naming_its_argument(call, name):
    """NumPy refuses a ragged nested sequence in words that name no argument; softorder's
    error names it."""
    x = np.random.default_rng(0).standard_normal((3, 6))
    with pytest.raises(ValueError, match=f"^{name} must be a rectangular array of numbers"):
        call(x)
