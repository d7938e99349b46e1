"""The one report writer: a study's markdown built section by section, and its files.

Every study writes ``<stem>.json`` (every figure, the machine, the command) and
``<stem>.md`` (what a reader looks at) through ``write``; the markdown is a ``Markdown``
made of the same few parts everywhere: a title, paragraphs, tables, bullet lists, plots,
goals with their verdicts, the machine line and the command.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from loramux.benchmarks.common.files import write_atomic
from loramux.benchmarks.common.machine import busy_warning, machine_text

DASH = "–"


def num(value, digits: int = 1, *, scale: float = 1.0, suffix: str = "") -> str:
    """``value`` (times ``scale``) with thousands separators and ``digits`` decimals; a dash
    for None."""
    return DASH if value is None else f"{value * scale:,.{digits}f}{suffix}"


def ms(seconds, digits: int = 0) -> str:
    """Seconds as milliseconds; a dash for None."""
    return num(seconds, digits, scale=1000.0)


def pct(fraction, digits: int = 0) -> str:
    return DASH if fraction is None else f"{fraction:.{digits}%}"


def mark(ok: bool | None) -> str:
    """A check's verdict as the tables show it."""
    return {True: "ok", False: "**FAILED**", None: "not judged"}[ok]


def table_lines(columns: Sequence[str], rows: Iterable[Sequence], align: str = "") -> list[str]:
    """A markdown table. ``align`` has one letter per column, ``l`` or ``r``; columns it
    does not cover are left-aligned first, right-aligned after (names, then numbers)."""
    align = align or "l" + "r" * (len(columns) - 1)
    rule = "".join("---|" if a == "l" else "---:|" for a in align.ljust(len(columns), "r"))
    return [
        "| " + " | ".join(columns) + " |",
        "|" + rule,
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


class Markdown:
    """A report's markdown, appended to part by part; ``render()`` is the document."""

    def __init__(self, title: str) -> None:
        self._lines = [f"# {title}", ""]

    def section(self, title: str, level: int = 2) -> Markdown:
        return self.lines(f"{'#' * level} {title}", "")

    def text(self, *paragraphs: str | None) -> Markdown:
        """Each paragraph followed by a blank line; None and empty ones are skipped."""
        for paragraph in paragraphs:
            if paragraph:
                self.lines(paragraph, "")
        return self

    def bullets(self, items: Iterable[str]) -> Markdown:
        return self.lines(*(f"- {item}" for item in items), "")

    def table(self, columns: Sequence[str], rows: Iterable[Sequence], align: str = "") -> Markdown:
        return self.lines(*table_lines(columns, rows, align), "")

    def plots(self, paths: Sequence[Path], alt: str | None = None) -> Markdown:
        """Each plot as an image; says so when none was drawn (no matplotlib)."""
        if not paths:
            return self.text("Plots: none (matplotlib is not installed).")
        return self.lines(*(f"![{alt or Path(p).stem}]({Path(p).name})" for p in paths), "")

    def goals(self, judged: Sequence[dict], label: str = "goal") -> Markdown:
        """``bench_presets.judge_goals``' verdicts as a table."""
        rows = [
            (
                f"{g['metric']} {g['relation']} {g['value']:g}",
                num(g["measured"], 3),
                f"**{g['verdict']}**",
                g.get("why") or "",
            )
            for g in judged
        ]
        return self.table((label, "measured", "verdict", "why"), rows, "lrll")

    def busy(self, contention: dict, machine: dict) -> Markdown:
        """The busy-machine warning, when the runs were contended."""
        return self.text(*busy_warning(contention, machine))

    def machine(
        self, machine: dict, libraries: tuple[str, ...] = ("torch",), note: str = ""
    ) -> Markdown:
        return self.text(machine_text(machine, libraries) + (f" {note}" if note else ""))

    def command(self, command: str) -> Markdown:
        return self.text(f"Command: `{command}`")

    def lines(self, *lines: str) -> Markdown:
        self._lines.extend(lines)
        return self

    def render(self) -> str:
        while len(self._lines) > 1 and not self._lines[-1]:
            self._lines.pop()
        return "\n".join(self._lines) + "\n"


def write(stem: Path, report: dict, markdown: Markdown | str, *, echo: bool = True) -> None:
    """``<stem>.json`` and ``<stem>.md``, neither ever half-written, then (``echo``) the
    markdown on stdout."""
    text = markdown.render() if isinstance(markdown, Markdown) else markdown
    write_atomic(stem.with_suffix(".json"), json.dumps(report, indent=2, default=float) + "\n")
    write_atomic(stem.with_suffix(".md"), text)
    if echo:
        print(text)
