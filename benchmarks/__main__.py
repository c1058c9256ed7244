"""``python -m benchmarks``: list, run or report the benchmarks (the package docstring says how)."""

from __future__ import annotations

import ast
import importlib
import os
import sys

from . import BENCHMARKS, PROBES, module_name

HERE = os.path.dirname(os.path.abspath(__file__))


def summary(name: str) -> str:
    """The first line of a benchmark's docstring, read without importing it (no torch, no GPU)."""
    relative = module_name(name).split(".")[1:]
    with open(os.path.join(HERE, *relative[:-1], relative[-1] + ".py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.splitlines()[0].replace("``", "") if doc else ""


def listing() -> str:
    width = max(map(len, BENCHMARKS + PROBES))
    lines = [f"{name:<{width}}  {summary(name)}" for name in BENCHMARKS]
    lines += ["", "probes (one question each; benchmarks/probes/):"]
    lines += [f"{name:<{width}}  {summary(name)}" for name in PROBES]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(sys.modules[__package__].__doc__)
        return 0
    if argv[0] == "--list":
        print(listing())
        return 0
    if argv[0] == "report":
        from . import report

        return report.main(argv[1:])
    try:
        module = module_name(argv[0])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    importlib.import_module(module).main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
