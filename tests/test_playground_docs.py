"""docs/playground.md's scripts run against the test server (the doc's address and keys are the
test server's) in headless Chromium. The first, which took the committed screenshot on SmolLM2,
trains a vector in the page, sweeps it, runs a chat prompt and saves a screenshot; two lines change
for the tiny model: shorter waits, and A/B items its 384-token vocabulary tells apart. The second
registers a random SAE and drives the feature and attention views; only its wait changes."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from browser_harness import require_browser
from server_harness import USER

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "playground.md"
TINY_ITEMS = "\n".join(json.dumps(item) for item in [
    {"prompt": "The quick brown", "matching": " fox", "other": " dog"},
    {"prompt": "Hello world! How are", "matching": " you", "other": " today"}])

pytestmark = pytest.mark.browser


def doc_blocks(server_url: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 2
    edits = [{'files("steerable.vectors").joinpath("data/sentiment_items.jsonl").read_text()': repr(TINY_ITEMS)}, {}]
    out = []
    for block, extra in zip(blocks, edits):
        for old, new in {"http://127.0.0.1:8000": server_url, "WAIT = 300_000": "WAIT = 60_000", **extra}.items():
            assert old in block, old
            block = block.replace(old, new)
        out.append(block)
    return out


def test_playground_doc_scripts_run(server, http, tmp_path, monkeypatch, capsys):
    require_browser()
    monkeypatch.chdir(tmp_path)
    for i, block in enumerate(doc_blocks(server.url)):
        exec(compile(block, f"playground.md block {i}", "exec"), {"__name__": "doc_playground"})
    for shot in ("playground.png", "playground-views.png"):
        assert (tmp_path / shot).stat().st_size > 10_000
    out = capsys.readouterr().out
    assert out.count("unsteered: ") == out.count("steered:   ") == 2
    assert re.search(r'at position 7 attends most to ".*" \d\.\d{4}', out)
    assert "demo-sae" not in http.get("/v1/saes", headers=USER).json()["saes"]
    with capsys.disabled():
        print(f"\nplayground doc screenshots: {tmp_path}")
