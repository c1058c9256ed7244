"""A CPU engine keeps freed activations in the heap (``steerable.cpu_memory``): a second prefill of
2,048 tokens faults almost no pages in, where glibc's defaults map its
multi-megabyte blocks afresh and fault every page of them in again; its shutdown hands the kept
memory back. Opt-in (``STEERABLE_CPU_MALLOC=1``). Each engine runs in a process of its own (the setting is process-wide)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tests.conftest import build_model

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc thresholds")

PROBE = """
import json, resource, sys
from steerable import LLM, SamplingParams, cpu_memory
llm = LLM(sys.argv[1], device="cpu", cpu_threads=1, max_num_batched_tokens=2048, max_model_len=4096,
          enable_prefix_caching=False)
prompt = [(7 * i) % 500 + 3 for i in range(2000)]
params = SamplingParams(max_tokens=1, temperature=0.0)
llm.generate([prompt], params, use_tqdm=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate([prompt], params, use_tqdm=False)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
running = rss_mb()
llm.shutdown()
print(json.dumps({"applied": cpu_memory._applied, "faults": faults, "rss_running_mb": running,
                  "rss_after_mb": rss_mb()}))
"""


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """Blocks of a few megabytes at 2,048 tokens (the gate/up product: 2,048 x 3,072 floats, 25 MB)."""
    path = str(tmp_path_factory.mktemp("wide") / "llama")
    build_model("llama", path, 512, spec=dict(cls="LlamaConfig", extra=dict(
        hidden_size=256, intermediate_size=1536, num_hidden_layers=2, max_position_embeddings=4096,
        tie_word_embeddings=False)))
    return path


def prefill_faults(path: str, **env: str) -> dict:
    """The probe's figures, in a process whose environment is this one's with ``env`` (the setting
    itself only where ``env`` gives it: a shell that exported it must not turn the default run on)."""
    inherited = {k: v for k, v in os.environ.items() if k != "STEERABLE_CPU_MALLOC"}
    out = subprocess.run([sys.executable, "-c", PROBE, path], capture_output=True, text=True,
                         env={**inherited, **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# glibc's initial mmap threshold, pinned: its dynamic one depends on what the process freed before.
GLIBC_DEFAULT = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}


def test_a_second_prefill_reuses_the_heap(wide_model):
    kept = prefill_faults(wide_model, STEERABLE_CPU_MALLOC="1", **GLIBC_DEFAULT)
    default = prefill_faults(wide_model, **GLIBC_DEFAULT)  # off unless asked for
    assert kept["applied"] is True and default["applied"] is False
    block_pages = 2048 * 3072 * 4 // 4096
    assert default["faults"] >= 2 * block_pages, default  # the gate/up blocks of both layers mapped afresh
    assert kept["faults"] < block_pages // 2, kept
    # After shutdown the kept heap goes back to the system: the process holds no more than glibc's defaults leave.
    assert kept["rss_after_mb"] < kept["rss_running_mb"] - 500 and kept["rss_after_mb"] <= default["rss_after_mb"] + 32
