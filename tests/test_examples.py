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

    return [m for m in baselines.METHODS if any(name.split()[-1] == m for name in rows)]


@pytest.fixture(scope="module")
def lapsum():
    try:
        import softorder.bridges.torch  # noqa: F401
    except ImportError:
        return False
    return True


def protocol_stated(text):
    """The tables open with the one-line protocol (grid, validation, seeds, test once)."""
    first = text.splitlines()[0]
    assert first.startswith("Protocol: each method's temperature chosen from {0.3, 1}")
    assert "validation" in first and "test set" in first


def test_topk_classification(tmp_path, lapsum):
    text = run_example("topk_classification", tmp_path)
    protocol_stated(text)
    rows = table_rows(text)
    from softorder import baselines

    assert set(methods_in(rows)) == set(baselines.METHODS)
    assert ("lapsum" in rows) == lapsum
    for name, entries in rows.items():
        for numbers in entries:
            top1, _sd1, top5, _sd5, ms = numbers[-5:]
            assert 0 <= top1 <= top5 <= 100 and ms > 0
            if name != "softmax":
                assert numbers[-6] in (0.3, 1.0)  # the chosen temperature, from the grid
    assert rows["softmax"][0][0] > 50  # even two epochs learn something


def test_knn_digits(tmp_path, lapsum):
    text = run_example("knn_digits", tmp_path)
    protocol_stated(text)
    rows = table_rows(text)
    from softorder import baselines

    assert set(methods_in(rows)) == set(baselines.METHODS)
    assert any("lapsum" in r for r in rows) == lapsum
    for name, [numbers] in rows.items():
        if name.startswith("kNN + "):
            temperature, accuracy, _sd, ms = numbers
            assert temperature in (0.3, 1.0) and 0 <= accuracy <= 100 and ms > 0
    assert rows["kNN on pixels"][0][0] > 90


def test_sort_digits(tmp_path, lapsum):
    text = run_example("sort_digits", tmp_path)
    protocol_stated(text)
    rows = table_rows(text)
    from softorder import baselines

    assert set(methods_in(rows)) == set(baselines.PERMUTATION_METHODS)
    assert ("lapsum" in rows) == lapsum
    for [numbers] in rows.values():
        # temperature, then n = 3 and n = 5: exact % +- sd (element %), then ms per step
        temperature, exact3, _, element3, exact5, _, element5, ms = numbers
        assert temperature in (0.3, 1.0)
        assert 0 <= exact3 <= element3 <= 100 and 0 <= exact5 <= element5 <= 100 and ms > 0
        assert element3 > 100 / 3 - 15  # at least about chance level


def without_times(text):
    """The table with its last column (milliseconds, which vary run to run) blanked."""
    return "\n".join(
        line.rsplit("|", 2)[0] if line.startswith("|") else line for line in text.splitlines()
    )


def test_examples_reproduce_exactly(tmp_path):
    """Two runs of the same configuration print the same table, times aside."""
    command = [sys.executable, str(EXAMPLES / "knn_digits.py"), "--quick", "--out"]
    runs = [
        subprocess.Popen([*command, str(tmp_path / str(i))], stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outputs = [run.communicate(timeout=900)[0] for run in runs]
    assert all(run.returncode == 0 for run in runs)
    tables = [without_times((tmp_path / str(i) / "knn_digits.md").read_text()) for i in range(2)]
    assert tables[0] == tables[1]
    assert tables[0].strip() in without_times(outputs[0])
    assert "kNN + neuralsort" in tables[0]


def test_relaxation_cost(tmp_path, lapsum):
    text = run_example("relaxation_cost", tmp_path)
    slopes = dict(re.findall(r"(\w+) (\d\.\d+)", text.splitlines()[0].split(":", 1)[1]))
    assert len(slopes) == 7 + lapsum
    for slope in slopes.values():
        assert float(slope) == pytest.approx(0.5, abs=1e-3)  # matched sharpness
    rows = table_rows(text)
    for name, tables in rows.items():
        if name in ("sinkhorn", "soft_topk_ot", "sorted_soft_topk_ot"):
            # and a convergence table: per temperature, plain Sinkhorn's iterations (or its
            # cap), the default path's, ms
            error_tau, error_n, convergence, cost = tables
            assert len(convergence) == 3 * 2
            for plain, ours, ms in zip(*[iter(convergence)] * 3, strict=True):
                # the sorts' epsilon-scaling rungs may cost a few iterations where plain
                # Sinkhorn is quick (23 against 22 for sorted SOFT at 0.03 in the full run)
                assert 1 <= ours <= plain + 30 and ms > 0
        else:
            error_tau, error_n, cost = tables
        assert all(0 <= e <= 1 for e in error_tau + error_n)
        assert all(v >= 0 for v in cost) and len(cost) == 4  # two sizes: ms / MB each
