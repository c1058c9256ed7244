"""``python -m benchmarks report``: the tables of docs/benchmarks.md, regenerated from the results store.

Each table of ``benchmarks/tables.py`` is a list of ``Figure``s; a figure names a record (benchmark,
record kind, the field that holds the number, and the header fields, arguments or record fields
that must match). The report shows, for every card that has one, the newest such record (by the
run's header time), with its card, commit and a link to its file and line, so every figure in the
docs points to the record it came from. In docs/benchmarks.md a table sits between
``<!-- report: NAME -->`` and ``<!-- /report -->``; ``report`` rewrites what is between them and
nothing else, ``report --check`` fails when that would change the file (a test runs it).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from dataclasses import dataclass

from . import results
from .results import Run
from .tables import TABLES, Figure, Table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
BLOCK = re.compile(r"<!-- report: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /report -->", re.S)


@dataclass(frozen=True)
class Found:
    run: Run
    line: int
    record: dict


def _matches(figure: Figure, run: Run, record: dict) -> bool:
    if record["record"] != figure.record or not isinstance(record.get(figure.value), (int, float)):
        return False
    for key, wanted in figure.where.items():
        actual = record[key] if key in record else run.arg(key)
        if not (wanted(actual) if callable(wanted) else actual == wanted):
            return False
    return True


def _on_card(run: Run, card: str) -> bool:
    """Whether a run is on a figure's card: ``CPU`` takes every processor (``CPU (AMD EPYC)``...)."""
    return run.card == card or run.card.startswith(f"{card} (")


def newest(figure: Figure, runs: list[Run]) -> list[Found]:
    """The newest matching record of each card, cards in name order. Smoke runs never count, nor
    runs with tuning variables set (``env`` in the header): a table shows the defaults."""
    best: dict[str, Found] = {}
    for run in runs:
        if (run.bench != figure.bench or run.header.get("smoke") or run.header.get("env")
                or (figure.card and not _on_card(run, figure.card))):
            continue
        for line, record in run.records:
            if _matches(figure, run, record):
                found, current = Found(run, line, record), best.get(run.card)
                if current is None or _order(found) > _order(current):
                    best[run.card] = found
    return [best[card] for card in sorted(best)]


def _order(found: Found) -> tuple:
    return found.run.header.get("time") or "", found.run.file, found.line


def _commit(run: Run) -> str:
    commit = run.header.get("commit") or "unknown"
    return f"{commit} (uncommitted changes)" if run.header.get("dirty") else commit


def _cells(figure: Figure, found: Found | None, goals: bool) -> list[str]:
    if found is None:
        figure_text, card, commit, link = "no record yet", "", "", ""
        met = "" if figure.goal is None else "—"
    else:
        value = found.record[figure.value]
        figure_text = figure.fmt(value)
        extra = figure.detail(found.run, found.record) if figure.detail else None
        if extra:
            figure_text += f" ({extra})"
        card, commit = found.run.card, _commit(found.run)
        link = f"[{found.run.file}:{found.line}](../benchmarks/results/{found.run.file}#L{found.line})"
        met = "" if figure.goal is None else ("yes" if figure.goal.met(value) else "**no**")
    cells = [figure.what, figure_text]
    if goals:
        cells += [figure.goal.text if figure.goal else "", met]
    return cells + [card, commit, link]


def render(table: Table, runs: list[Run]) -> str:
    """The markdown of one table: a line per figure and card (a figure without records says so)."""
    goals = any(f.goal for f in table.figures)
    head = ["figure", "value", *(["goal", "met"] if goals else []), "card", "commit", "record"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for figure in table.figures:
        for found in newest(figure, runs) or [None]:
            lines.append("| " + " | ".join(_cells(figure, found, goals)) + " |")
    return "\n".join(lines) + "\n"


def update(text: str, tables: tuple[Table, ...], runs: list[Run]) -> str:
    """``text`` with every report block regenerated; ``ValueError`` for a block naming no table or
    a table without a block."""
    by_name = {t.name: t for t in tables}
    seen: set[str] = set()

    def block(m: re.Match) -> str:
        name = m["name"]
        if name not in by_name:
            raise ValueError(f"docs block 'report: {name}' names no table of benchmarks/tables.py")
        seen.add(name)
        return f"<!-- report: {name} -->\n{render(by_name[name], runs)}<!-- /report -->"

    new = BLOCK.sub(block, text)
    missing = [name for name in by_name if name not in seen]
    if missing:
        raise ValueError(f"tables without a '<!-- report: NAME -->' block in the docs: {missing}")
    return new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 (and show the difference) if the docs are stale")
    p.add_argument("--print", action="store_true", help="print the tables instead of writing the docs")
    p.add_argument("--results", default=results.RESULTS_DIR, help="the results store (default: benchmarks/results)")
    p.add_argument("--docs", default=DOCS, help="the page holding the tables (default: docs/benchmarks.md)")
    args = p.parse_args(argv)
    runs = results.load(args.results)
    if args.print:
        for table in TABLES:
            print(f"<!-- report: {table.name} -->\n{render(table, runs)}")
        return 0
    with open(args.docs) as f:
        text = f.read()
    new = update(text, TABLES, runs)
    if args.check:
        if new != text:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), args.docs,
                                                       "python -m benchmarks report"))
            return 1
        return 0
    if new != text:
        with open(args.docs, "w") as f:
            f.write(new)
    print(f"{os.path.relpath(args.docs)}: {len(TABLES)} tables from {len(runs)} runs, "
          f"{'updated' if new != text else 'unchanged'}")
    return 0
