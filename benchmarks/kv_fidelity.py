"""Teacher-forced top-1 agreement of an fp8 KV cache with the model-dtype cache.

How closely an fp8 KV cache follows the model-dtype cache: a greedy generation of ``--length``
tokens per prompt with the model-dtype cache, then, for every prefix of it, the next token under
both caches (teacher forcing: each position is judged on the same input, so one early difference
does not decide the rest). Reports top-1 agreement per prompt and overall, and the KV bytes of
each cache. Default model: the packaged SmolLM2-135M (real weights; a random model says little).

    python -m benchmarks kv_fidelity [--model smollm2] [--length 512] [--num-requests 4]
"""

from __future__ import annotations

import numpy as np

from . import common
from .common import emit

PROMPTS = ["The history of the printing press begins", "def fibonacci(n):", "Photosynthesis is the process by which",
           "In 1969, the first humans", "A good recipe for bread needs", "The capital of France is"]


def main(argv: list[str] | None = None) -> None:
    from steerable import SamplingParams

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=None, help="tokens generated per prompt")
    args = p.parse_args(argv)
    if args.model is None and not args.smoke:
        args.model = "smollm2"
    path = common.setup("kv_fidelity", args, {"num_requests": (4, 2), "length": (512, 24)})
    engines = {}
    for kv in ("auto", "fp8"):
        args.kv_cache_dtype = kv
        engines[kv] = common.make_llm(args, path)
    reference, fp8 = engines["auto"], engines["fp8"]
    tok = reference.get_tokenizer()
    if tok is not None:
        prompts = [tok(text).input_ids for text in PROMPTS[:args.num_requests]]
    else:
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(0, common.prompt_vocab(reference), 16).tolist() for _ in range(args.num_requests)]
    greedy = SamplingParams(max_tokens=args.length, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0)
    agree = total = 0
    for i, prompt in enumerate(prompts):
        ids = prompt + reference.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        prefixes = [ids[:n] for n in range(len(prompt), len(ids))]
        a, b = (llm.generate(prefixes, one, use_tqdm=False) for llm in (reference, fp8))
        hits = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b))
        free = fp8.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        first_diff = next((j for j, (x, y) in enumerate(zip(free, ids[len(prompt):])) if x != y), len(free))
        emit({"record": "prompt", "index": i, "positions": len(prefixes), "top1_agreement": hits / len(prefixes),
              "free_run_identical_tokens": first_diff})
        agree, total = agree + hits, total + len(prefixes)
    emit({"record": "kv_fidelity", "prompts": len(prompts), "positions": total, "top1_agreement": agree / total,
          "kv_cache_bytes": {kv: llm.llm_engine.stats()["kv_cache_bytes"] for kv, llm in engines.items()}})

