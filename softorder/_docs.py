"""Docstrings of the framework bridges, generated from the NumPy API's docstrings.

The NumPy API (:mod:`softorder.operations`) documents each operation once, in numpydoc format.
A bridge function keeps only its differences in its own docstring (its runnable example, and
any parameter it describes differently); :func:`documented` merges the two, translating the
NumPy docstring into the framework's words through a :class:`Dialect` (``axis`` -> ``dim``,
``ndarray`` -> ``Tensor``...). Framework-neutral: this module imports no framework.

Merging, section by section:

- summary: the bridge's own, if it has one, else the NumPy summary line; then the NumPy
  extended summary and the dialect's paragraph on the bridge;
- Parameters: one entry per parameter of the bridge function's signature, in its order: the
  bridge's own entry if it has one, else the NumPy entry (names renamed, types and text
  translated); a parameter documented by neither raises ``ValueError`` at import, so the
  docstrings cannot drift from the signatures;
- Returns, Raises: the bridge's own if it has the section, else the NumPy one, translated;
- Notes: the NumPy notes, translated, then the bridge's own notes, the note shared by some of
  its functions (``notes``) and the dialect's note;
- Examples: the bridge's own only (the NumPy examples call NumPy).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from collections.abc import Callable

#: sections in the order they are written
_ORDER = ("Parameters", "Returns", "Raises", "Notes", "Examples")


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How one framework's docstrings differ from the NumPy API's.

    Parameters
    ----------
    names : dict
        Parameter renames, NumPy name to bridge name (e.g. ``{"axis": "dim"}``).
    words : tuple of (str, str)
        ``(pattern, replacement)`` regular expressions applied, in order, to the text of the
        summary, the descriptions, the returns and the notes.
    types : tuple of (str, str)
        The same for the types of parameters and results.
    kinds : dict
        Types of particular parameters (bridge names), instead of the translated NumPy ones.
    about : str
        A paragraph after the summary, formatted with ``name`` (the operation's name) and
        ``differentiable`` (its differentiable arguments, e.g. "``x`` and ``alpha``").
    note : str
        A paragraph appended to the Notes, formatted likewise.

    Examples
    --------
    >>> d = Dialect(names={"axis": "dim"}, words=((r"``axis``", "``dim``"),))
    >>> d.text("Along ``axis``.")
    'Along ``dim``.'
    """

    names: dict = dataclasses.field(default_factory=dict)
    words: tuple = ()
    types: tuple = ()
    kinds: dict = dataclasses.field(default_factory=dict)
    about: str = ""
    note: str = ""

    def text(self, text: str) -> str:
        """``text`` in the framework's words."""
        for pattern, replacement in self.words:
            text = re.sub(pattern, replacement, text)
        return text

    def type(self, text: str) -> str:
        """A parameter's or result's type in the framework's terms."""
        for pattern, replacement in self.types:
            text = re.sub(pattern, replacement, text)
        return text


def _sections(doc: str) -> tuple[list[str], dict[str, list[str]]]:
    """The summary lines and the sections (title -> body lines) of a numpydoc docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    sections: dict[str, list[str]] = {}
    body = summary
    i = 0
    while i < len(lines):
        line = lines[i]
        underline = lines[i + 1] if i + 1 < len(lines) else ""
        if line and underline.strip() and set(underline.strip()) == {"-"}:
            body = sections.setdefault(line.strip(), [])
            i += 2
            continue
        body.append(line)
        i += 1
    strip = _strip_blank
    return strip(summary), {title: strip(lines) for title, lines in sections.items()}


def _strip_blank(lines: list[str]) -> list[str]:
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return lines[start:end]


def _entries(lines: list[str]) -> list[tuple[list[str], str, list[str]]]:
    """The entries of a Parameters/Returns/Raises section: (names, type, description lines)."""
    entries: list[tuple[list[str], str, list[str]]] = []
    for line in lines:
        if line and not line[0].isspace():
            head, _, kind = line.partition(" : ")
            entries.append(([n.strip() for n in head.split(",")], kind.strip(), []))
        elif entries:
            entries[-1][2].append(line)
    return [(names, kind, _strip_blank(text)) for names, kind, text in entries]


def _entry(names: list[str], kind: str, text: list[str]) -> list[str]:
    head = ", ".join(names) + (f" : {kind}" if kind else "")
    return [head, *text]


def _translated(entry, dialect: Dialect, typed: bool = False):
    """An entry in the framework's words; ``typed``: a Returns entry without a name, whose
    one field is its type.
    """
    names, kind, text = entry
    if typed and not kind:
        return [dialect.type(n) for n in names], kind, [dialect.text(line) for line in text]
    names = [dialect.names.get(n, n) for n in names]
    kind = dialect.kinds.get(names[0], dialect.type(kind)) if len(names) == 1 else kind
    return names, kind, [dialect.text(line) for line in text]


def _parameters(source, own, signature: list[str], dialect: Dialect, where: str) -> list[str]:
    """The Parameters section: one entry per name of ``signature``, own entries first."""
    pool = [*_entries(own), *(_translated(e, dialect) for e in _entries(source))]
    out: list[str] = []
    done: set[str] = set()
    for name in signature:
        if name in done:
            continue
        entry = next((e for e in pool if name in e[0]), None)
        if entry is None:
            raise ValueError(f"softorder docs: {where} has no description of parameter {name!r}")
        names = [n for n in entry[0] if n in signature]
        done.update(names)
        out += _entry(names, entry[1], entry[2])
    return out


def merge(
    source: str,
    own: str,
    signature: list[str],
    dialect: Dialect,
    name: str,
    differentiable: tuple = (),
    drop: tuple = (),
    notes: str = "",
) -> str:
    """The docstring of a bridge's ``name``: the NumPy docstring ``source`` merged with the
    bridge function's ``own`` docstring (see the module docstring), for the parameter names
    ``signature``, without the sections in ``drop``; ``notes``, a paragraph added to the Notes
    after the bridge's own (a note several functions of a bridge share).

    Examples
    --------
    >>> numpy_doc = '''Sum along an axis.
    ...
    ... Parameters
    ... ----------
    ... x : array_like
    ...     Values.
    ... axis : int
    ...     Axis to sum along.
    ...
    ... Examples
    ... --------
    ... >>> 1
    ... 1
    ... '''
    >>> d = Dialect(names={"axis": "dim"}, words=((r"Axis", "Dimension"),),
    ...             types=((r"array_like", "Tensor"),))
    >>> merge(numpy_doc, "", ["x", "dim"], d, "total").splitlines()[4:]
    ['x : Tensor', '    Values.', 'dim : int', '    Dimension to sum along.']
    """
    source_summary, source_sections = _sections(source)
    own_summary, own_sections = _sections(own)
    first, *rest = source_summary or [""]
    summary = own_summary or [dialect.text(first)]
    extended = [dialect.text(line) for line in _strip_blank(rest)]
    paragraphs = [summary]
    if extended:
        paragraphs.append(extended)
    names = [f"``{dialect.names.get(n, n)}``" for n in differentiable]
    fields = {
        "name": name,
        "differentiable": " and ".join(
            [", ".join(names[:-1]), *names[-1:]] if names[:-1] else names
        ),
    }
    if dialect.about:
        paragraphs.append(_wrapped(dialect.about.format(**fields)))
    sections: dict[str, list[str]] = {
        "Parameters": _parameters(
            source_sections.get("Parameters", []),
            own_sections.get("Parameters", []),
            signature,
            dialect,
            name,
        )
    }
    for title in ("Returns", "Raises"):
        if title in own_sections:
            sections[title] = own_sections[title]
        elif title in source_sections:
            entries = [
                _translated(e, dialect, typed=title == "Returns")
                for e in _entries(source_sections[title])
            ]
            sections[title] = [line for e in entries for line in _entry(*e)]
    noted = [dialect.text(line) for line in source_sections.get("Notes", [])]
    shared = (_wrapped(notes), _wrapped(dialect.note.format(**fields)))
    for extra in (own_sections.get("Notes", []), *shared):
        if extra and extra != [""]:
            noted += [""] * bool(noted) + extra
    if noted:
        sections["Notes"] = noted
    if "Examples" in own_sections:
        sections["Examples"] = own_sections["Examples"]
    unknown = set(own_sections) - set(_ORDER)
    if unknown:
        raise ValueError(f"softorder docs: {name} has sections merge() does not know: {unknown}")
    out = [line for paragraph in paragraphs for line in [*paragraph, ""]]
    for title in _ORDER:
        if sections.get(title) and title not in drop:
            out += [title, "-" * len(title), *sections[title], ""]
    return "\n".join(out).rstrip() + "\n"


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, 92, break_on_hyphens=False) if text else []


def documented(source: Callable, dialect: Dialect, drop: tuple = (), notes: str = ""):
    """Decorator: give a bridge function (or class) the docstring :func:`merge` makes from
    ``source``'s and its own, for the decorated function's parameters (a class's
    ``__init__``'s, without ``self``), with the paragraph ``notes`` added to the Notes.
    ``source.rule.differentiable``, when there is one, names the differentiable arguments.
    """

    def decorate(fn):
        signature = inspect.signature(fn.__init__ if isinstance(fn, type) else fn)
        names = [n for n in signature.parameters if n != "self"]
        differentiable = getattr(getattr(source, "rule", None), "differentiable", ())
        fn.__doc__ = merge(
            source.__doc__,
            fn.__doc__,
            names,
            dialect,
            source.__name__,
            differentiable,
            drop,
            notes,
        )
        return fn

    return decorate
