"""A rule's restore rebuilds, from the arguments of a forward pass and the residuals it handed
out, a context whose gradients (VJP and JVP) are the forward context's to the bit, without
checking the arguments again; the checks' twins for arguments already checked
(``alpha_rows``, ``target_rows``, ``label_rows``, ``p_k_rows``) give what the checks give.
"""

from __future__ import annotations

import numpy as np
import pytest

import softorder
from softorder._engine import checks
from softorder._engine import rules as rules_module
from softorder._engine.autodiff import Rule, bind

RNG = np.random.default_rng(20260101)
X = RNG.standard_normal((4, 9))
X[1, 3] = X[1, 5]  # a tie
PERMUTATIONS = np.stack([RNG.permutation(9) + 1 for _ in range(4)])

#: (operation, its arguments after x), every restore that is not the generic one and the
#: argument forms that take each of their paths
CASES = [
    ("soft_quantile", (0.3,), {"alpha": 0.4}),
    ("soft_quantile", (np.float32(0.3),), {"alpha": np.array(0.4, np.float32)}),
    ("soft_quantile", (np.array([[0.2, 0.7]]),), {"alpha": np.linspace(0.2, 1.0, 4)}),
    ("soft_quantile", (np.array([0.1, 0.5, 0.9, 0.3]),), {"alpha": [[0.3], [0.4], [0.5], [0.6]]}),
    ("soft_quantile", (np.array([[0.2, 0.4, 0.6]]),), {"alpha": 0.5, "axis": 0}),
    ("soft_topk", (3,), {"alpha": 0.4}),
    ("soft_topk", (2.5,), {"alpha": 0.4, "largest": False}),
    ("soft_topk", (np.array([[2.0, 5.0]]),), {"alpha": np.full((4, 1), 0.3)}),
    ("log_soft_topk", (np.array([1.5, 2.0, 3.0, 4.0]),), {"alpha": 0.7}),
    ("soft_permutation", (), {"alpha": 0.4}),
    ("soft_permutation", (), {"alpha": np.linspace(0.2, 1.0, 4), "descending": True}),
    ("soft_rank", (), {"alpha": 0.4, "descending": True}),
    ("soft_sort", (), {"alpha": 0.4}),
    (
        "topk_cross_entropy",
        (np.array([0, 4, 2, 8]), [0.5, 0.3, 0.2]),
        {"alpha": 0.4, "reduction": "none"},
    ),
    (
        "topk_cross_entropy",
        (np.array([1, 1, 7, 0]), np.array([[0.6, 0.4], [1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])),
        {"alpha": np.linspace(0.2, 1.0, 4), "reduction": "mean", "split_top1": True},
    ),
    ("permutation_cross_entropy", (PERMUTATIONS,), {"alpha": 0.4, "reduction": "none"}),
    (
        "permutation_cross_entropy",
        (PERMUTATIONS.astype(np.int32),),
        {"alpha": np.linspace(0.2, 1.0, 4), "reduction": "sum", "descending": True},
    ),
]


def _forward(name, args, kwargs, dtype):
    fn = getattr(softorder, name)
    x = X.astype(dtype)
    if kwargs.get("axis") == 0:
        x = np.ascontiguousarray(x.T)
    arguments = bind(fn.signature, (x, *args), kwargs)
    rule = fn.rule
    ctx = rule.prepare(**arguments)
    out = rule.forward(ctx)
    # what a bridge keeps: copies, no longer tied to the context
    residuals = {key: np.array(value) for key, value in rule.residuals(ctx).items()}
    return rule, arguments, ctx, out, residuals


def _assert_same(got, expected):
    for a, b in zip(got, expected, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{i}")
def test_restored_context_gives_the_forward_contexts_gradients(case, dtype):
    name, args, kwargs = CASES[case]
    rule, arguments, ctx, out, residuals = _forward(name, args, kwargs, dtype)
    cotangent = RNG.standard_normal(np.shape(out))
    restored = rule.restore(arguments, residuals)
    checked = Rule.restore(rule, arguments, residuals)  # through prepare, every check again
    expected = rule.vjp(ctx, cotangent)
    _assert_same(rule.vjp(restored, cotangent), expected)
    _assert_same(rule.vjp(checked, cotangent), expected)
    tangents = {"alpha": RNG.standard_normal(np.shape(arguments["alpha"]))}
    tangents[rule.input_name] = RNG.standard_normal(np.shape(arguments[rule.input_name]))
    _assert_same([rule.jvp(restored, tangents)], [rule.jvp(ctx, tangents)])


def test_restore_checks_nothing_again(monkeypatch):
    """The arguments were checked by the forward pass: the loss rules' restore, which would
    check labels, p_k and target ranks again through prepare, calls none of the checks.
    """
    prepared = [_forward(*case, "float64") for case in CASES if "cross_entropy" in case[0]]

    def refuse(*args, **kwargs):
        raise AssertionError("checked again")

    for name in ("check_alpha", "check_labels", "check_p_k", "check_target_ranks"):
        monkeypatch.setattr(rules_module, name, refuse)
    for rule, arguments, ctx, out, residuals in prepared:
        cotangent = np.ones(np.shape(out))
        _assert_same(
            rule.vjp(rule.restore(arguments, residuals), cotangent), rule.vjp(ctx, cotangent)
        )


BATCH = (2, 3)
ALPHAS = [
    0.5,
    2,
    np.float32(0.3),
    np.array(0.25),
    np.array(0.25, np.float32),
    [0.5, 1.0, 2.0],
    np.full(BATCH, 0.4, np.float32),
    np.full(BATCH, 0.4),
    np.full((2, 1), 0.7),
    np.full((2, 1, 3), 0.7),  # keepdims along axis 1 of x (2, n, 3)
]


def _assert_same_array(a, b):
    assert type(a) is type(b) is np.ndarray
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)
    assert a.flags.writeable and a.flags.c_contiguous


@pytest.mark.parametrize("alpha", range(len(ALPHAS)))
def test_alpha_rows_gives_what_check_alpha_gives(alpha):
    value = ALPHAS[alpha]
    per_row, shape = checks.alpha_rows(value, BATCH, 1)
    expected, expected_shape = checks.check_alpha(value, BATCH, 1)
    _assert_same_array(per_row, expected)
    assert shape == expected_shape
    assert not np.shares_memory(per_row, np.asarray(value))


TARGETS = [
    0.3,
    np.float32(0.3),
    np.array(0.3, np.float32),
    np.array([0.3, 0.6, 0.9]),  # one per row of the last batch axis
    np.full(BATCH, 0.25),
    np.full(BATCH + (2,), 0.5, np.float32),  # two per row
    np.array([[[0.1, 0.2]]]),  # two per row, broadcast over the batch
    [[0.4], [0.6]],
]


@pytest.mark.parametrize("target", range(len(TARGETS)))
def test_target_rows_gives_what_check_targets_gives(target):
    value = TARGETS[target]
    values, multi, shape = checks.target_rows(value, BATCH)
    expected, expected_multi, expected_shape = checks.check_targets(value, BATCH, "q", 1.0, "1")
    _assert_same_array(values, np.ascontiguousarray(expected))
    assert (multi, shape) == (expected_multi, expected_shape)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_label_rows_gives_what_check_labels_gives(dtype):
    labels = RNG.integers(0, 5, BATCH).astype(dtype)
    _assert_same_array(
        checks.label_rows(labels, BATCH), checks.check_labels(labels, BATCH, "labels", 0, 4)
    )
    ranks = np.stack([RNG.permutation(5) + 1 for _ in range(6)]).reshape(BATCH + (5,))
    ranks = ranks.astype(dtype)
    _assert_same_array(
        checks.label_rows(ranks, BATCH, (5,)), checks.check_target_ranks(ranks, BATCH, 5)
    )


P_KS = [
    [0.5, 0.5],
    np.array([0.2, 0.3, 0.5], np.float32),
    np.tile([0.25, 0.75], BATCH + (1,)),
    np.tile(np.array([0.25, 0.75], np.float32), (3, 1)),
]


@pytest.mark.parametrize("p_k", range(len(P_KS)))
def test_p_k_rows_gives_what_check_p_k_gives(p_k):
    value = P_KS[p_k]
    got, expected = checks.p_k_rows(value, BATCH), checks.check_p_k(value, BATCH, 6)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
