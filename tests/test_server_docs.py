"""Every ``python`` and ``bash`` block of docs/server.md runs, in order, against the test server
(the doc's address and keys are the test server's; ``shell`` blocks, which start a server, are
not run). Python blocks share one namespace; bash blocks share the working directory."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "server.md"
DOC_URL = "http://127.0.0.1:8000"


def test_server_doc_examples_run(server, model_dirs, tmp_path, monkeypatch):
    text = DOC.read_text().replace(DOC_URL, server.url)
    text = text.replace('AsyncLLM("smollm2"', f'AsyncLLM({model_dirs["qwen3"]!r}')
    blocks = re.findall(r"```(python|bash)\n(.*?)```", text, flags=re.S)
    assert {kind for kind, _ in blocks} == {"python", "bash"}
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    namespace = {"__name__": "doc_server"}
    for i, (kind, block) in enumerate(blocks):
        if kind == "python":
            exec(compile(block, f"server.md[block {i}]", "exec"), namespace)
        else:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 0, f"server.md[block {i}]:\n{block}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
