"""The examples' result tables (``examples/results/*.md``) as reStructuredText, for the docs.

The examples write their tables in markdown (the form the examples' README and a terminal
show); the comparisons page includes the same files, converted here at build time, so the
docs never hold a second, hand-copied version of a result.
"""

from __future__ import annotations

import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "results"
EXAMPLES = ("topk_classification", "knn_digits", "sort_digits", "relaxation_cost")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _inline(text: str) -> str:
    """Markdown's inline code (single backticks) as reStructuredText's (double); ``*`` and
    ``**`` mean the same in both. A ``|`` is escaped (reStructuredText's substitution mark)."""
    text = re.sub(r"(?<!`)`([^`]+)`(?!`)", r"``\1``", text)
    return text.replace("|", r"\|")


def markdown_to_rst(text: str) -> str:
    """Paragraphs pass through; each pipe table becomes a ``list-table`` with one header row.

    >>> print(markdown_to_rst("Note `x`.\\n\\n| a | b |\\n|---|---:|\\n| 1 | 2 |"))
    Note ``x``.
    <BLANKLINE>
    .. list-table::
       :header-rows: 1
    <BLANKLINE>
       * - a
         - b
       * - 1
         - 2
    <BLANKLINE>
    """
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                cells = _cells(lines[i])
                if not all(set(c) <= set("-:") and c for c in cells):  # not the rule line
                    rows.append(cells)
                i += 1
            out += [".. list-table::", "   :header-rows: 1", ""]
            for row in rows:
                first, *rest = [_inline(c) if c else r"\ " for c in row]
                out.append(f"   * - {first}")
                out += [f"     - {cell}" for cell in rest]
            out.append("")
            continue
        out.append(_inline(line))
        i += 1
    return "\n".join(out).rstrip("\n") + "\n"


def write_tables(out: pathlib.Path) -> None:
    """``results_<example>.inc`` in ``out`` for each example whose table is committed."""
    for name in EXAMPLES:
        text = markdown_to_rst((RESULTS / f"{name}.md").read_text(encoding="utf-8"))
        path = out / f"results_{name}.inc"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
