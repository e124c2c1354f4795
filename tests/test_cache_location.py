"""numba's compiled kernels are cached outside the package (issue 12, "a stale numba cache can
shadow the package").

numba's default for ``cache=True`` writes ``__pycache__/*.nbi|*.nbc`` next to the sources
when it can. In an installed package pip does not remove them, and after ``pip install -e .``
the leftover ``site-packages/softorder/core`` directory became a namespace package that hid
the real one (``softorder.soft_rank`` raised ``AttributeError``).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import softorder
from softorder import core

PACKAGE = pathlib.Path(softorder.__file__).resolve().parent


def test_cache_dir_is_outside_the_package_and_under_numba_cache_dir():
    import numba

    path = pathlib.Path(core.cache_dir()).resolve()
    assert PACKAGE not in path.parents
    if numba.config.CACHE_DIR:  # the test suite sets it (conftest.py)
        assert pathlib.Path(numba.config.CACHE_DIR).resolve() in path.parents
    assert path.name.startswith("softorder-")


def test_an_installed_copy_writes_nothing_inside_itself(tmp_path):
    """An installed copy (the package's files, as pip lays them out in site-packages), run from
    elsewhere with no ``NUMBA_CACHE_DIR``: the kernels compile into the user's cache directory
    (``XDG_CACHE_HOME`` here) and the package directory gets no numba files."""
    site = tmp_path / "site-packages"
    shutil.copytree(
        PACKAGE,
        site / "softorder",
        ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp_path / "user-cache"))
    script = (
        "import numpy as np, softorder, softorder.core as c; "
        f"assert softorder.__file__.startswith({str(site)!r}), softorder.__file__; "
        "r = softorder.soft_rank(np.array([[0.5, -1.0, 3.0]]), 0.01); "
        "assert r.tolist() == [[2.0, 1.0, 3.0]], r; print(c.cache_dir())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    used = pathlib.Path(done.stdout.strip().splitlines()[-1])
    assert (tmp_path / "user-cache" / "softorder") in used.parents
    assert list(used.rglob("*.nbi")), "nothing was cached"
    written = [p for p in (site / "softorder").rglob("*") if p.suffix in (".nbi", ".nbc")]
    assert written == []
    # the user was told once why the first call takes seconds, and where the cache is
    assert done.stderr.count("softorder: compiling numba kernels") == 1, done.stderr
