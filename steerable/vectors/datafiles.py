"""Reading contrast pairs and A/B items from JSON-lines files, and the data the package ships
(``steerable/vectors/data/``: sentiment pairs, held-out sentiment A/B items, neutral prompts)."""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

from steerable.errors import InvalidRequestError
from steerable.files import read_jsonl
from steerable.vectors.items import ABItem


def parse_pairs(records: list[Any], where: str = "pairs") -> tuple[list[str], list[str]]:
    """``[{"positive": str, "negative": str}, ...]`` -> (positives, negatives)."""
    positives, negatives = [], []
    for i, record in enumerate(records):
        if not (isinstance(record, dict) and isinstance(record.get("positive"), str)
                and isinstance(record.get("negative"), str) and record["positive"] and record["negative"]):
            raise InvalidRequestError(f"{where}[{i}]: expected {{'positive': str, 'negative': str}}, got {record!r}")
        positives.append(record["positive"])
        negatives.append(record["negative"])
    if not positives:
        raise InvalidRequestError(f"{where}: no pairs")
    return positives, negatives


def read_pairs(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    return parse_pairs(read_jsonl(path), str(path))


def read_items(path: str | os.PathLike) -> list[ABItem]:
    return [ABItem.parse(record, f"{path}[{i}]") for i, record in enumerate(read_jsonl(path))]


def _packaged(name: str) -> str:
    return str(resources.files("steerable.vectors") / "data" / name)


def demo_pairs() -> tuple[list[str], list[str]]:
    """72 sentiment contrast pairs (positive vs negative), the demo's training set."""
    return read_pairs(_packaged("sentiment_pairs.jsonl"))


def demo_items() -> list[ABItem]:
    """32 held-out sentiment items: a prompt and a positive (matching) vs a negative completion."""
    return read_items(_packaged("sentiment_items.jsonl"))


def neutral_prompts() -> list[str]:
    """Eight short factual prompts for the KL side-effect check."""
    with open(_packaged("neutral.txt"), encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]
