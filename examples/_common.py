"""What the examples share: the command line, the methods, the digits and the result files.

Imported by each example as ``_common`` (``python examples/<name>.py`` puts this folder first
on the module path).
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Iterable

import torch

RESULTS = pathlib.Path(__file__).parent / "results"


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with ``--quick`` and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run (seconds)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
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
