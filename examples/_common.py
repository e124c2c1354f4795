"""What the examples share: the command line, the methods, the digits and the result files.

Imported by each example as ``_common`` (``python examples/<name>.py`` puts this folder first
on the module path).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

RESULTS = pathlib.Path(__file__).parent / "results"
#: Every method's temperature (LapSum's alpha, the others' tau or epsilon) is chosen from this
#: grid, on a validation split of the training data, with the same training budget.
GRID = (0.03, 0.1, 0.3, 1.0, 3.0)
QUICK_GRID = (0.3, 1.0)


def deterministic() -> None:
    """One thread for torch and numba, deterministic torch kernels.

    Results then depend only on the seeds (and the library versions): torch's CPU kernels are
    deterministic on one thread, and LapSum's numba kernels are deterministic per row. One
    thread also avoids torch's and numba's thread pools contending on small problems, and
    makes the times per step comparable across methods.
    """
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        import numba

        numba.set_num_threads(1)
    except ImportError:  # the baselines alone need no numba
        pass


def protocol_line(grid: Sequence[float], seeds: int, criterion: str) -> str:
    """The one-line statement of the protocol that heads each table."""
    return (
        f"Protocol: each method's temperature chosen from {{{', '.join(f'{t:g}' for t in grid)}}}"
        f" by {criterion} on a validation split of the training data (seed 0, same budget); "
        f"then {seeds} seed(s) trained with it and evaluated once on the held-out test set "
        "(mean +- sd)."
    )


def choose(grid: Sequence[float], score: Callable[[float], float]) -> tuple[float, dict]:
    """The grid value with the highest ``score`` (the first on ties), and every score."""
    scores = {t: score(t) for t in grid}
    best = max(scores.values())
    return next(t for t in grid if scores[t] == best), scores


def tuned_runs(
    grid: Sequence[float] | None,
    seeds: int,
    train: Callable[[float | None, int], T],
    score: Callable[[T], float],
    progress: Callable[[], object],
) -> tuple[float | None, list[T]]:
    """The protocol: a temperature chosen on validation, then ``seeds`` runs with it.

    ``train(temperature, seed)`` trains one run and ``score(run)`` is its validation score. The
    temperature is the grid value whose seed-0 run scores best (:func:`choose`), and that run
    is reused as seed 0; ``grid=None`` (a method without a temperature) trains at ``None``.
    ``progress()`` is called after each training run. Returns the temperature and the runs of
    seeds ``0, ..., seeds - 1``.
    """
    if grid is None:
        best, runs = None, [train(None, 0)]
        progress()
    else:
        first: dict[float, T] = {}

        def validation_score(t: float) -> float:
            first[t] = train(t, 0)
            progress()
            return score(first[t])

        best, _ = choose(grid, validation_score)
        runs = [first[best]]
    for seed in range(1, seeds):
        runs.append(train(best, seed))
        progress()
    return best, runs


def mean_sd(values: Sequence[float], digits: int = 2) -> str:
    """``"mean +- sd"`` (population sd; 0 for one value)."""
    return f"{statistics.mean(values):.{digits}f} +- {statistics.pstdev(values):.{digits}f}"


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with ``--quick`` and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run (seconds)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument(
        "--grid",
        type=float,
        nargs="+",
        default=None,
        help=f"temperatures to choose from (default {GRID}; {QUICK_GRID} with --quick)",
    )
    return parser


def lapsum_available() -> bool:
    """Whether the PyTorch bridge (LapSum for torch) is installed."""
    try:
        import softorder.bridges.torch  # noqa: F401
    except ImportError:
        return False
    return True


def with_lapsum(methods: Iterable[str]) -> list[str]:
    """``"lapsum"`` (when the PyTorch bridge is installed, else a note) and ``methods``."""
    if lapsum_available():
        return ["lapsum", *methods]
    print("softorder.bridges.torch not found: LapSum is left out of this run")
    return list(methods)


def digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits: pixels scaled to [0, 1] (float32, 64 per image), labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def write_table(table: str, out: pathlib.Path, name: str) -> None:
    """Print the Markdown ``table`` and write it to ``out / <name>.md``."""
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(table + "\n")


def save_figure(fig, out: pathlib.Path, name: str, dpi: int) -> None:
    """Lay out ``fig``, save it to ``out / <name>.png`` and say so."""
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=dpi)
    print(f"wrote {out / f'{name}.png'}")
