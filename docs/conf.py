"""Sphinx configuration of the softorder documentation.

Build (warnings are errors, as in CI)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Generated at build time (into ``docs/_generated/``, not committed): the figure of soft top-k
memberships for several alpha (``docs/figures.py``), the API sections of the bridges, and the
examples' result tables (``docs/results_tables.py``). A framework that is not installed (a
build with only the ``docs`` extra) is mocked while autodoc imports its bridge, so both
bridges are documented in every build.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS))

import softorder  # noqa: E402

project = "softorder"
author = "softorder developers"
copyright = "softorder developers"  # noqa: A001
release = softorder.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
exclude_patterns = ["_build", "_generated/*.inc", "**/.ipynb_checkpoints"]
templates_path: list = []
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures show them; the docstrings describe them
autodoc_default_options = {"members": False}


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


#: The bridges' frameworks that cannot be imported here: autodoc imports mocks instead.
autodoc_mock_imports = [name for name in ("torch", "jax") if not _importable(name)]

napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

try:
    import furo  # noqa: F401

    html_theme = "furo"
except ImportError:  # the docs still build with Sphinx's bundled theme
    html_theme = "alabaster"
html_title = f"softorder {release}"
html_static_path = ["_static"]


#: The functions each bridge documents (both bridges offer the same ones).
BRIDGE_FUNCTIONS = (
    "soft_topk",
    "log_soft_topk",
    "soft_rank",
    "soft_sort",
    "soft_quantile",
    "soft_permutation",
    "topk_cross_entropy",
    "permutation_cross_entropy",
)
BRIDGES = {
    "torch": (
        "PyTorch bridge",
        "softorder.bridges.torch",
        BRIDGE_FUNCTIONS,
        ["TopKCrossEntropyLoss", "PermutationCrossEntropyLoss"],
    ),
    "jax": (
        "JAX bridge",
        "softorder.bridges.jax",
        BRIDGE_FUNCTIONS,
        [],
    ),
}


def _bridge_page(key: str) -> str:
    title, module, functions, classes = BRIDGES[key]
    lines = [title, "-" * len(title), ""]
    from sphinx.ext.autodoc.mock import mock

    with mock(autodoc_mock_imports):
        mod = importlib.import_module(module)
    lines += [f".. automodule:: {module}", "   :no-members:", ""]
    for name in functions:
        if hasattr(mod, name):
            lines += [f".. autofunction:: {module}.{name}", ""]
    for name in classes:
        if hasattr(mod, name):
            signature = _init_signature(getattr(mod, name))
            lines += [f".. autoclass:: {module}.{name}{signature}", "   :members: forward", ""]
    return "\n".join(lines)


def _init_signature(cls) -> str:
    """The arguments of the class's own ``__init__``, without annotations: autodoc would read
    ``(*args, **kwargs)`` from a mocked base class (``torch.nn.Module`` when torch is missing).
    """
    if "__init__" not in vars(cls):
        return ""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in parameters]
    return str(inspect.Signature(plain))


def _generate(app) -> None:
    out = DOCS / "_generated"
    out.mkdir(exist_ok=True)
    for key in BRIDGES:
        text = _bridge_page(key)
        path = out / f"api_{key}.inc"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    import figures
    import results_tables

    figures.alpha_figure(out / "alpha.png")
    results_tables.write_tables(out)


def setup(app):
    app.connect("builder-inited", _generate)
