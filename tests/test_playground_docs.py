"""docs/playground.md's script, which took the committed screenshot on SmolLM2, runs against the
test server (the doc's address and keys are the test server's) in headless Chromium: it trains a
vector in the page, sweeps it, runs a chat prompt and saves a screenshot. Two lines change for the
tiny model: shorter waits, and A/B items its 384-token vocabulary tells apart."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from browser_harness import require_browser

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "playground.md"
TINY_ITEMS = "\n".join(json.dumps(item) for item in [
    {"prompt": "The quick brown", "matching": " fox", "other": " dog"},
    {"prompt": "Hello world! How are", "matching": " you", "other": " today"}])

pytestmark = pytest.mark.browser


def test_playground_doc_script_runs(server, tmp_path, monkeypatch, capsys):
    require_browser()
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    for old, new in {"http://127.0.0.1:8000": server.url, "WAIT = 300_000": "WAIT = 60_000",
                     'files("steerable.vectors").joinpath("data/sentiment_items.jsonl").read_text()':
                         repr(TINY_ITEMS)}.items():
        assert old in block, old
        block = block.replace(old, new)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "playground.md", "exec"), {"__name__": "doc_playground"})
    assert (tmp_path / "playground.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "unsteered: " in out and "steered:   " in out
    with capsys.disabled():
        print(f"\nplayground doc screenshot: {tmp_path / 'playground.png'}")
