"""The asv suite (``asv_bench/benchmarks``) imports, and every benchmark runs once.

Each benchmark class is set up and run on its smallest sizes (numeric parameters take their
smallest value; string parameters such as dtype, input kind and batch shape take every value),
so CI notices a benchmark broken by an API change in seconds, without asv. Benchmarks whose
framework, bridge or peer is not installed raise ``NotImplementedError`` in ``setup`` (asv's
way to skip); a class whose every combination is skipped is reported as skipped here.
When asv is installed, ``asv check --python=same`` also validates the suite as asv sees it.
"""

import importlib
import importlib.util
import inspect
import itertools
import pathlib
import pkgutil
import subprocess
import sys
import warnings

import pytest

ASV_DIR = pathlib.Path(__file__).resolve().parent.parent / "asv_bench"
PREFIXES = ("time_", "peakmem_", "mem_", "track_", "timeraw_")


def _package():
    """The ``benchmarks`` package of ``asv_bench`` (the name asv imports it under)."""
    loaded = sys.modules.get("benchmarks")
    if loaded is not None and pathlib.Path(loaded.__file__).parent != ASV_DIR / "benchmarks":
        pytest.fail(f"another 'benchmarks' package is already imported: {loaded.__file__}")
    sys.path.insert(0, str(ASV_DIR))
    try:
        return importlib.import_module("benchmarks")
    finally:
        sys.path.remove(str(ASV_DIR))


def _modules():
    package = _package()
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.ispkg)
    return [importlib.import_module(f"benchmarks.{name}") for name in names]


def _classes():
    """Every class asv would collect: public, defined in a benchmark module, with benchmarks."""
    found = []
    for module in _modules():
        for name, cls in vars(module).items():
            if name.startswith("_") or not inspect.isclass(cls):
                continue
            if any(attr.startswith(PREFIXES) for attr in dir(cls)):
                found.append(pytest.param(cls, id=f"{module.__name__.split('.')[-1]}.{name}"))
    return found


def _smallest_params(cls):
    params = getattr(cls, "params", ())
    if params and not isinstance(params[0], list | tuple):
        params = (params,)
    choices = []
    for values in params:
        numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        choices.append([min(numeric)] if len(numeric) == len(values) else list(values))
    return list(itertools.product(*choices))


def test_suite_is_found():
    names = {p.id.split(".")[0] for p in _classes()}
    assert {"rank", "topk", "sort", "permutation", "losses", "hard"} <= names


@pytest.mark.parametrize("cls", _classes())
@pytest.mark.filterwarnings("error")
def test_benchmark_runs_once(cls):
    methods = [m for m in dir(cls) if m.startswith(PREFIXES)]
    assert methods, cls
    ran, skipped = 0, []
    # Warnings raised by peers (their deprecated dependencies) are not ours to fix; those of
    # softorder and of the suite itself stay errors.
    warnings.filterwarnings("ignore", module=r"^(?!softorder|benchmarks)")
    for combo in _smallest_params(cls):
        bench = cls()
        try:
            if hasattr(bench, "setup"):
                bench.setup(*combo)
        except NotImplementedError as exc:
            skipped.append(f"{combo}: {exc}")
            continue
        for method in methods:
            getattr(bench, method)(*combo)
        if hasattr(bench, "teardown"):
            bench.teardown(*combo)
        ran += 1
    if not ran:
        pytest.skip("; ".join(skipped))


@pytest.mark.skipif(importlib.util.find_spec("asv") is None, reason="asv is not installed")
def test_asv_check():
    result = subprocess.run(
        [sys.executable, "-m", "asv", "check", "--python=same"],
        cwd=ASV_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_benchmark_script_runs_on_cpu_tensors():
    """benchmarks/bench_gpu.py is for a GPU machine; ``--device cpu`` runs its harness here."""
    import runpy

    module = runpy.run_path(str(ASV_DIR.parent / "benchmarks" / "bench_gpu.py"))
    rows = module["main"](["--device", "cpu", "--quick", "--repeats", "1"])
    assert [r["shape"] for r in rows] == ["64 x 100", "1 x 1e4"]
    assert all(t > 0 for r in rows for k, t in r.items() if k != "shape")


def test_convergence_script_quick(capsys):
    """benchmarks/bench_convergence.py (the convergence-cost table of examples/README.md) runs,
    and every baseline converges within its cap at the quick settings."""
    import re
    import runpy

    module = runpy.run_path(str(ASV_DIR.parent / "benchmarks" / "bench_convergence.py"))
    module["main"](["--quick"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [row.split("(")[0].strip("| ") for row in rows] == [
        "soft_topk_ot",
        "sorted_soft_topk_ot",
        "sinkhorn",
    ]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")[1:]]
        assert len(cells) == 2
        for text in cells:
            assert "not converged" not in text and "warned" not in text, row
            ours, milliseconds = re.fullmatch(r"(?:> )?\d+ / (\d+); ([\d.]+) ms", text).groups()
            assert 0 < int(ours) <= 1000 and float(milliseconds) > 0
