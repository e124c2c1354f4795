"""Each example runs end to end in its reduced setting (``--quick``) and writes sane results."""

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def run_example(name, out):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    png, table = out / f"{name}.png", out / f"{name}.md"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    text = table.read_text()
    assert text.strip() in result.stdout  # the table printed is the table written
    return text


def table_rows(text):
    """``{first cell: [numbers in the other cells]}`` for every data row of every table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= set("-:") and cells[0] != "method":
            rows.setdefault(cells[0], []).append(
                [float(v) for c in cells[1:] for v in re.findall(r"-?\d+\.?\d*(?:e-?\d+)?", c)]
            )
    return rows


def methods_in(rows):
    from softorder import baselines

    return [m for m in baselines.METHODS if any(m in name for name in rows)]


@pytest.fixture(scope="module")
def lapsum():
    try:
        import softorder.bridges.torch  # noqa: F401
    except ImportError:
        return False
    return True


def test_topk_classification(tmp_path, lapsum):
    rows = table_rows(run_example("topk_classification", tmp_path))
    from softorder import baselines

    assert set(methods_in(rows)) == set(baselines.METHODS)
    assert ("lapsum" in rows) == lapsum
    for entries in rows.values():
        for numbers in entries:
            top1, _sd, top5, ms = numbers[-4:]
            assert 0 <= top1 <= top5 <= 100 and ms > 0
    assert rows["softmax"][0][0] > 50  # even two epochs learn something


def test_knn_digits(tmp_path, lapsum):
    rows = table_rows(run_example("knn_digits", tmp_path))
    assert len(methods_in(rows)) == 6 and any("lapsum" in r for r in rows) == lapsum
    for [numbers] in rows.values():
        assert 0 <= numbers[0] <= 100
    assert rows["kNN on pixels"][0][0] > 90


def test_sort_digits(tmp_path, lapsum):
    rows = table_rows(run_example("sort_digits", tmp_path))
    from softorder import baselines

    assert set(methods_in(rows)) == set(baselines.PERMUTATION_METHODS)
    assert ("lapsum" in rows) == lapsum
    for [numbers] in rows.values():
        # n = 3 and n = 5: exact % (element %), then ms per step
        exact3, element3, exact5, element5, ms = numbers
        assert 0 <= exact3 <= element3 <= 100 and 0 <= exact5 <= element5 <= 100 and ms > 0
        assert element3 > 100 / 3 - 15  # at least about chance level


def test_relaxation_cost(tmp_path, lapsum):
    text = run_example("relaxation_cost", tmp_path)
    slopes = dict(re.findall(r"(\w+) (\d\.\d+)", text.splitlines()[0].split(":", 1)[1]))
    assert len(slopes) == 6 + lapsum
    for slope in slopes.values():
        assert float(slope) == pytest.approx(0.5, abs=1e-3)  # matched sharpness
    rows = table_rows(text)
    for name, tables in rows.items():
        if "(1000 it.)" in name:  # the converged Sinkhorn rows: error table only
            assert len(tables) == 1 and all(0 <= e <= 1 for e in tables[0])
            continue
        error_tau, error_n, cost = tables
        assert all(0 <= e <= 1 for e in error_tau + error_n)
        assert all(v >= 0 for v in cost) and len(cost) == 4  # two sizes: ms / MB each
