"""The PyTorch bridge's docstrings, generated from the NumPy API's (softorder._docs): in
PyTorch's words, one entry per parameter of each signature, the bridge's own example, and a
parameter left undocumented is an error at import time."""

import inspect
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import softorder.bridges.torch as sot  # noqa: E402
from softorder import _docs, operations  # noqa: E402

PUBLIC = [getattr(sot, name) for name in sot.__all__]


def _parameter_names(doc: str) -> list[str]:
    section = doc.split("Parameters\n----------\n")[1].split("\n\n")[0]
    heads = [line for line in section.splitlines() if line and not line[0].isspace()]
    return [n.strip() for head in heads for n in head.split(" : ")[0].split(",")]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: o.__name__)
def test_docstrings_are_in_pytorch_words(obj):
    doc = obj.__doc__
    signature = inspect.signature(obj.__init__ if isinstance(obj, type) else obj)
    assert _parameter_names(doc) == [n for n in signature.parameters if n != "self"]
    assert not re.search(r"\baxis\b|ndarray|array_like|np\.ndarray", doc)
    examples = doc.split("Examples\n--------\n")[1]
    assert "import torch, softorder.bridges.torch as sot" in examples
    assert "softorder.soft_" not in examples and "np.array" not in examples


@pytest.mark.parametrize("name", [n for n in sot.__all__ if n.islower()])
def test_functions_keep_the_numpy_description(name):
    # the shared text comes from the NumPy docstring: its summary line, and the gradient note
    numpy_summary = getattr(operations, name).__doc__.splitlines()[0]
    doc = getattr(sot, name).__doc__
    assert doc.splitlines()[0] == numpy_summary.replace("``axis``", "``dim``")
    assert f":func:`softorder.{name}`" in doc
    assert (
        "Second derivatives, and derivatives in other arguments, raise ``NotImplementedError``"
        in " ".join(doc.split())
    )


def test_an_undocumented_parameter_is_an_error():
    def soft_rank(x, alpha=1.0, *, dim=-1, descending=False, extra=None):
        """
        Examples
        --------
        >>> 1
        1
        """

    with pytest.raises(ValueError, match="no description of parameter 'extra'"):
        _docs.documented(operations.soft_rank, sot._TORCH)(soft_rank)


def test_own_entries_replace_the_numpy_ones():
    def soft_rank(x, alpha=1.0, *, dim=-1, descending=False):
        """Own summary.

        Parameters
        ----------
        alpha : float
            Own alpha.
        """

    doc = _docs.documented(operations.soft_rank, sot._TORCH)(soft_rank).__doc__
    assert doc.startswith("Own summary.\n")
    assert "alpha : float\n    Own alpha.\n" in doc
    assert "dim : int\n    Dimension along which to rank.\n" in doc


def test_the_docstring_generator_imports_no_framework():
    # the JAX bridge reuses softorder._docs: it must stay framework-neutral
    script = "import sys, softorder._docs; print(sorted({'torch', 'jax'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
