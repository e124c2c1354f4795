"""pytest set-up for the doctests of the docs pages (``--doctest-glob=*.rst``).

A page whose examples use PyTorch or JAX is skipped, with the reason, where that framework is
not installed, so that the pages themselves show only what a reader would type (no
``pytest.importorskip`` line as their first example).
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

#: An example line that imports a framework, directly or through its bridge.
_USES = re.compile(
    r"^\s*(?:>>>|\.\.\.) .*?\b(?:import|from)\s+(?:softorder\.bridges\.)?(torch|jax)\b", re.M
)


@functools.cache
def frameworks(path: pathlib.Path) -> tuple[str, ...]:
    """The frameworks whose import appears in the examples of the page at ``path``."""
    return tuple(sorted(set(_USES.findall(path.read_text(encoding="utf-8")))))


def pytest_runtest_setup(item):
    if item.path.suffix == ".rst":
        for name in frameworks(item.path):
            pytest.importorskip(name, reason=f"the examples of {item.path.name} need {name}")
