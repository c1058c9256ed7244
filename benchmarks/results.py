"""The results store: ``benchmarks/results/*.jsonl``, one file per (date, card, commit, benchmark).

A file is a sequence of runs. A run is one header record (``{"bench": NAME, "record": "header",
"time", "commit", "gpu", "gpus", "card", "torch", "triton", "python", "shape", "args", ...}``)
followed by the records that run printed, one JSON object a line, each with the header's
``bench``. Runs only ever get appended, so a record's file and line name it for good: the
report links every figure to them. Reading needs neither torch nor a GPU.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def card_slug(gpu: str | None, gpus: int) -> str:
    """A card's short name for file names: ``h200``, ``h100``, ``h200x2``, or ``cpu`` without a GPU."""
    if not gpu or not gpus:
        return "cpu"
    words = re.sub(r"^(NVIDIA|AMD)\s+", "", gpu, flags=re.I).split()
    name = re.sub(r"[^a-z0-9]+", "", words[0].lower()) if words else "gpu"
    return f"{name}x{gpus}" if gpus > 1 else name


def card_label(header: dict) -> str:
    """A card as the docs' tables name it: ``H200``, ``2× H200``, ``H100 80GB HBM3``, ``CPU`` or, where
    the header names the processor, ``CPU (AMD EPYC)`` (CPU figures of different machines differ)."""
    gpu, gpus = header.get("gpu"), header.get("gpus") or 0
    if not gpu or not gpus:
        cpu = re.sub(r"\((R|TM)\)|\s+Processor\b", "", header.get("cpu") or "").strip()
        return f"CPU ({cpu})" if cpu else "CPU"
    name = re.sub(r"^NVIDIA\s+", "", gpu)
    return f"{gpus}× {name}" if gpus > 1 else name


@dataclass
class Run:
    """One run of one benchmark: its header and its records with their line numbers."""

    file: str  # the file's name, relative to the store
    line: int  # the header's line
    header: dict
    records: list[tuple[int, dict]] = field(default_factory=list)

    @property
    def bench(self) -> str:
        return self.header["bench"]

    @property
    def card(self) -> str:
        return card_label(self.header)

    def arg(self, key: str) -> Any:
        """A header field (``shape``, ``commit``...) or, failing that, an argument of the run."""
        if key in self.header and key != "args":
            return self.header[key]
        return self.header.get("args", {}).get(key)

    def first(self, record: str, **where: Any) -> dict | None:
        """The run's first record of kind ``record`` whose fields equal ``where``."""
        for _, r in self.records:
            if r["record"] == record and all(r.get(k) == v for k, v in where.items()):
                return r
        return None


def parse(name: str, lines: list[str]) -> list[Run]:
    """The runs of one file; ``ValueError`` naming the line where the format is broken."""
    runs: list[Run] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{number}: not JSON ({e})") from None
        if not isinstance(record, dict) or "bench" not in record or "record" not in record:
            raise ValueError(f"{name}:{number}: a record needs 'bench' and 'record'")
        if record["record"] == "header":
            runs.append(Run(name, number, record))
        elif not runs or runs[-1].bench != record["bench"]:
            raise ValueError(f"{name}:{number}: a {record['bench']!r} record without its run's header before it")
        else:
            runs[-1].records.append((number, record))
    return runs


def load(directory: str = RESULTS_DIR) -> list[Run]:
    """Every run in the store, file by file in name order."""
    runs: list[Run] = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                runs.extend(parse(name, f.read().splitlines()))
    return runs
