"""The JAX bridge's docstrings, generated from the NumPy API's (softorder._docs): in JAX's
words (``axis`` kept, ``jax.Array`` for arrays), one entry per parameter of each signature,
the bridge's own example and notes."""

import inspect
import re

import pytest

jax = pytest.importorskip("jax")

import softorder.bridges.jax as soj  # noqa: E402
from softorder import _docs, operations  # noqa: E402

PUBLIC = [getattr(soj, name) for name in soj.__all__]


def _parameter_names(doc: str) -> list[str]:
    section = doc.split("Parameters\n----------\n")[1].split("\n\n")[0]
    heads = [line for line in section.splitlines() if line and not line[0].isspace()]
    return [n.strip() for head in heads for n in head.split(" : ")[0].split(",")]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_docstrings_are_in_jax_words(fn):
    doc = fn.__doc__
    assert _parameter_names(doc) == list(inspect.signature(fn).parameters)
    assert not re.search(r"ndarray|array_like|\bTensor\b|\bdim\b", doc)
    first = doc.split("Parameters\n----------\n")[1].splitlines()[0]
    assert first.endswith(" : jax.Array") or first == "x, k, alpha, axis, largest"
    assert "Returns\n-------\njax.Array\n" in doc
    examples = doc.split("Examples\n--------\n")[1]
    assert "import softorder.bridges.jax as soj" in examples
    assert "softorder.soft_" not in examples and not re.search(r"\bnp\.array", examples)


@pytest.mark.parametrize("name", soj.__all__)
def test_functions_keep_the_numpy_description(name):
    # the shared text comes from the NumPy docstring, axis and all; the JAX notes are added
    numpy_doc = inspect.cleandoc(getattr(operations, name).__doc__)
    doc = getattr(soj, name).__doc__
    assert doc.splitlines()[0] == numpy_doc.splitlines()[0]
    assert f"The JAX version of :func:`softorder.{name}`" in doc
    numpy_axis = re.search(r"\naxis : int\n\s+(.*)\n", numpy_doc)
    # every operation with an axis describes it, except log_soft_topk ("As for soft_topk")
    has_axis = "axis" in inspect.signature(getattr(soj, name)).parameters
    assert bool(numpy_axis) == (has_axis and name != "log_soft_topk")
    if numpy_axis:
        assert f"\naxis : int\n    {numpy_axis.group(1)}\n" in doc
    assert "jax_enable_x64" in doc and "``NotImplementedError``" in doc
    assert ("FFI route" in doc) == (name in soj._FFI_OPS)
    assert ("reduction applies to each vmapped element" in doc) == name.endswith("entropy")


def test_differentiable_arguments_are_named():
    assert "(``jax.grad``, ``jax.vjp``, ``jax.jacrev``) in ``x``, ``k`` and ``alpha``" in (
        " ".join(soj.soft_topk.__doc__.split())
    )
    assert "in ``logits`` and ``alpha``" in " ".join(soj.topk_cross_entropy.__doc__.split())


def test_an_undocumented_parameter_is_an_error():
    def soft_rank(x, alpha=1.0, *, axis=-1, descending=False, extra=None):
        """
        Examples
        --------
        >>> 1
        1
        """

    with pytest.raises(ValueError, match="no description of parameter 'extra'"):
        _docs.documented(operations.soft_rank, soj._JAX)(soft_rank)


def test_shared_notes_come_after_the_own_ones():
    def soft_rank(x, alpha=1.0, *, axis=-1, descending=False):
        """
        Notes
        -----
        Own note.
        """

    doc = _docs.documented(operations.soft_rank, soj._JAX, notes="Shared note.")(soft_rank)
    notes = doc.__doc__.split("Notes\n-----\n")[1]
    assert notes.index("Own note.") < notes.index("Shared note.") < notes.index("JAX: results")
