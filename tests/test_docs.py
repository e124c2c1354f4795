"""The documentation builds with Sphinx, warnings as errors (its pages' examples run as
doctests through pytest's ``--doctest-glob=*.rst``; see pyproject.toml).
"""

import pathlib
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("matplotlib")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    command += ["-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert (tmp_path / "html" / "api.html").exists()
