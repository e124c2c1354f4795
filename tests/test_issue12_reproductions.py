"""Issue 12's reproductions that no other test runs as the issue wrote them.

The rest of the issue's reproductions are tests elsewhere: second derivatives in
``test_torch_second_order.py`` and ``test_jax_bridge.py``; fork, pools, DataLoader workers
and threads in ``test_fork_threads.py``; argument checks in ``test_torch_arguments.py``,
``test_edge_cases.py`` and ``test_jax_bridge.py``; derivatives under ``vmap`` in
``test_torch_vmap_derivatives.py``; the cache location in ``test_cache_location.py``; the
range of soft sorted values in ``docs/choosing-alpha.rst``; reproducible examples in
``test_examples.py``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np

import softorder as so
from tests import naive

PACKAGE = pathlib.Path(so.__file__).resolve().parent

# Makes the given copies the only places softorder can come from: ``site`` first on the path
# (an installed copy, or what pip left of one), and, with ``editable``, a finder after the path
# finder, as setuptools' editable installs add one (so a leftover directory in site-packages
# is found first, as a namespace package).
IMPORT = """
import importlib.abc, importlib.util, pathlib, sys

site, editable = {site!r}, {editable!r}
sys.path[:] = [site] + [
    p for p in sys.path if not (pathlib.Path(p or ".") / "softorder" / "__init__.py").exists()
]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]


class Editable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "softorder" and editable:
            source = pathlib.Path(editable) / "softorder"
            return importlib.util.spec_from_file_location(
                name, source / "__init__.py", submodule_search_locations=[str(source)]
            )
        return None


sys.meta_path.append(Editable())
import numpy as np
import softorder
"""

CALL = """
print(softorder.__file__)
ranks = softorder.soft_rank(np.array([[0.5, -1.0, 3.0]]), 0.01)
assert ranks.tolist() == [[2.0, 1.0, 3.0]], ranks
p, pullback = softorder.vjp(softorder.soft_topk, np.array([[0.5, -1.0, 3.0]]), 1.5, 0.5)
pullback(np.ones_like(p))
"""


def _python(tmp_path, site, editable, body):
    script = textwrap.dedent(IMPORT.format(site=str(site), editable=editable)) + body
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ),  # NUMBA_CACHE_DIR from the conftest: kernels load from its cache
    )


def _pip_uninstall(site, record):
    """Remove what pip removes of an installed copy: its recorded files, their bytecode and
    the directories left empty. Anything else (files written at run time) stays, as with pip.
    """
    for rel in record:
        path = site / rel
        path.unlink()
        if path.suffix == ".py":
            for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
                pyc.unlink()
    root = site / "softorder"
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    if not any(root.iterdir()):
        root.rmdir()


def test_reinstalling_as_editable_after_an_installed_copy_ran(tmp_path):
    """Issue 12, section 4: ``pip install .``, call an operation from outside the repository,
    then ``pip install -e .``; ``softorder.soft_rank`` must still be there."""
    site = tmp_path / "site-packages"
    shutil.copytree(  # 1. pip install . (pip's bytecode aside: uninstall removes it anyway)
        PACKAGE, site / "softorder", ignore=shutil.ignore_patterns("__pycache__", "*.nb?")
    )
    record = [p.relative_to(site) for p in (site / "softorder").rglob("*") if p.is_file()]
    done = _python(tmp_path, site, None, CALL)  # ... and call it from elsewhere
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == str(site / "softorder" / "__init__.py")

    _pip_uninstall(site, record)  # 2. pip install -e . removes the installed copy
    leftovers = sorted(str(p.relative_to(site)) for p in site.rglob("*"))
    assert leftovers == [], f"left in site-packages after the installed copy ran: {leftovers}"

    done = _python(tmp_path, site, str(PACKAGE.parent), CALL)  # 3. the editable install
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == str(PACKAGE / "__init__.py")


def test_a_leftover_cache_directory_would_shadow_the_package(tmp_path):
    """The failure the test above guards against, as the issue saw it: one numba index file
    left in ``site-packages/softorder/core/__pycache__`` hides the editable install."""
    leftover = tmp_path / "site-packages" / "softorder" / "core" / "__pycache__"
    leftover.mkdir(parents=True)
    (leftover / "rank.rank_forward-1.py311.nbi").write_bytes(b"")
    done = _python(tmp_path, leftover.parents[2], str(PACKAGE.parent), "softorder.soft_rank")
    assert done.returncode != 0
    assert "AttributeError: module 'softorder' has no attribute 'soft_rank'" in done.stderr


def test_keepdims_alpha_as_the_issue_wrote_it(rng):
    """Issue 12, section 4: ``alpha`` of shape (5, 1) for a (5, 4) input, e.g.
    ``x.std(axis=-1, keepdims=True)``: one temperature per row, gradient in that shape."""
    x = rng.normal(size=(5, 4))
    alpha = x.std(axis=-1, keepdims=True)
    ranks, pullback = so.vjp(so.soft_rank, x, alpha)
    np.testing.assert_array_equal(ranks, so.soft_rank(x, alpha[:, 0]))
    for i in range(5):
        np.testing.assert_allclose(ranks[i], naive.soft_rank(x[i], alpha[i, 0]), rtol=1e-10)
    cotangent = rng.normal(size=ranks.shape)
    alpha_bar = pullback(cotangent)[1]
    assert alpha_bar.shape == (5, 1)
    direction = rng.normal(size=(5, 1))
    expected = naive.central_difference(
        lambda a: float(np.sum(so.soft_rank(x, a) * cotangent)), alpha, direction
    )
    np.testing.assert_allclose(np.sum(alpha_bar * direction), expected, rtol=1e-6, atol=1e-10)
