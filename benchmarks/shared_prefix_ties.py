"""Shared-prefix attention against the unshared kernel on real weights, token by token: whether
greedy tokens and logprobs part, where, and whether the parting is a rounding tie; and how far the
unshared path's own tokens move when only the batch around the same chats changes.

Forty-eight chats (twelve questions, then ``--crowd`` more) share a system prompt of over 256
tokens (SmolLM2-135M-Instruct, the demo model, unless ``--model`` names another). Forty-eight rows
of SmolLM2's 3 KV heads are past ``CONFIG.split_kv_max_programs`` (128), where the unshared decode
kernel is the unified one and shared-prefix attention engages. One engine per dtype; each run is
compared with the first, ``unshared`` (prefix caching on, shared-prefix attention off), chat by chat:

* ``shared``: shared-prefix attention on (a shared pass over the prefix, the unified kernel resumed);
* ``unshared_again``: the first run repeated (the engine is deterministic: nothing may differ);
* ``unshared_alone``: unshared, the twelve without the crowd: the GEMMs see another row count and
  the decode kernel is split-KV, not unified. No shared-prefix attention is involved: this is how
  far the engine's own greedy tokens move with their batch company in that dtype.

Each run has its own ``cache_salt``: it caches the system prompt alone first, as a chat service
would, so every run prefills the same way. Per run: a ``divergence`` record per chat that parted
(position, each run's top logprobs there and their top-two gaps) and a ``summary`` (chats that
parted, tokens compared before partings, the largest logprob drift before them). ``compare`` is
what ``tests/test_shared_prefix_gpu.py`` asserts on.

    PYTHONPATH=. python benchmarks/shared_prefix_ties.py [--dtypes bfloat16 float32] [--tokens 64] [--crowd 36]
"""

from __future__ import annotations

import common
from common import emit

SYSTEM = ("You are a careful assistant. Answer briefly, cite the rule you used, and never invent facts. " * 14)
QUESTIONS = ["What is the capital of France?", "Name a prime number above 50.", "Why is the sky blue?",
             "Give me a synonym for quick.", "What does a compiler do?", "How many legs has a spider?",
             "Translate 'cat' into German.", "What is 12 times 12?", "Who wrote Hamlet?", "What is rust?",
             "Describe a cloud in five words.", "Is zero even?"]
MODES = ("shared", "unshared_again", "unshared_alone")


def chat_prompts(tokenizer, crowd: int = 36) -> list[list[int]]:
    """The twelve questions' chats, then ``crowd`` more on the same system prompt (token ids)."""
    system = tokenizer(SYSTEM).input_ids
    extra = [f"Tell me one fact about the number {i}." for i in range(crowd)]
    return [system + tokenizer(q).input_ids for q in QUESTIONS + extra]


def generate(llm, prompts: list[list[int]], tokens: int, shared: bool, salt: str) -> tuple[list, dict]:
    """Greedy outputs (with top-2 logprobs) and the engine's counters over this call, after the
    system prompt alone is cached under ``salt``. ``shared`` switches the step builder's detector
    as ``benchmarks/shared_prefix.py`` does: one engine, so weights, graphs and kernels are the
    same in every run."""
    from steerable import SamplingParams

    engine = llm.llm_engine
    detector = engine.builder.shared_prefix
    engine.builder.shared_prefix = detector if shared else None
    before = engine.stats()
    try:
        system = llm.get_tokenizer()(SYSTEM).input_ids
        llm.generate([system], SamplingParams(max_tokens=1, cache_salt=salt), use_tqdm=False)
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=2, cache_salt=salt)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.builder.shared_prefix = detector
    after = engine.stats()
    counters = {k: after[k] - before[k] for k in ("shared_prefix_steps", "graph_replays", "prefix_cache_hit_tokens")}
    return [o.outputs[0] for o in outs], counters


def top_two_gap(logprobs: dict) -> float:
    best = sorted((entry.logprob for entry in logprobs.values()), reverse=True)
    return best[0] - best[1]


def _top(logprobs: dict) -> list[list]:
    return sorted(([tid, entry.logprob] for tid, entry in logprobs.items()), key=lambda e: -e[1])


def compare(reference: list, other: list) -> dict:
    """Per chat, identical tokens up to its first parting; the parting's top logprobs and gaps in
    both runs; over all chats the tokens compared and the largest logprob drift before partings."""
    divergences, compared, drift = [], 0, 0.0
    for chat, (a, b) in enumerate(zip(reference, other)):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        compared += first
        for i in range(first):
            drift = max(drift, abs(a.logprobs[i][a.token_ids[i]].logprob - b.logprobs[i][b.token_ids[i]].logprob))
        if first < len(a.token_ids):
            divergences.append({"chat": chat, "at": first,
                                "gaps": [top_two_gap(a.logprobs[first]), top_two_gap(b.logprobs[first])],
                                "reference_top": _top(a.logprobs[first]), "other_top": _top(b.logprobs[first])})
    return {"chats": len(reference), "chats_diverged": len(divergences), "tokens_compared": compared,
            "tokens": sum(len(a.token_ids) for a in reference), "max_logprob_drift": drift,
            "divergences": divergences}


def main() -> None:
    from steerable.layers.attention_backends.triton_paged import CONFIG

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=None, help="default: bfloat16 float32 (--smoke: float32)")
    p.add_argument("--tokens", type=int, default=None, help="greedy tokens per chat (default 64; --smoke 4)")
    p.add_argument("--crowd", type=int, default=None, help="chats beside the twelve questions' (36; --smoke 2)")
    args = p.parse_args()
    args.model = args.model or "smollm2"
    path = common.setup("shared_prefix_ties", args, {"dtypes": (["bfloat16", "float32"], ["float32"]),
                                                     "tokens": (64, 4), "crowd": (36, 2)})
    for dtype in args.dtypes:
        llm = common.make_llm(args, path, dtype=dtype, enable_shared_prefix_attention=True)
        prompts = chat_prompts(llm.get_tokenizer(), args.crowd)
        num_kv_heads = llm.engine.model_config.num_kv_heads
        reference, counters = generate(llm, prompts, args.tokens, False, f"{dtype}-unshared")
        emit({"record": "run", "dtype": dtype, "mode": "unshared", "decode_rows": len(prompts), **counters})
        for mode in MODES:
            rows = prompts[:len(QUESTIONS)] if mode == "unshared_alone" else prompts
            outs, counters = generate(llm, rows, args.tokens, mode == "shared", f"{dtype}-{mode}")
            result = compare(reference[:len(rows)], outs)
            for d in result.pop("divergences"):
                emit({"record": "divergence", "dtype": dtype, "mode": mode, **d})
            emit({"record": "summary", "dtype": dtype, "mode": mode, "decode_rows": len(rows),
                  "split_kv": len(rows) * num_kv_heads <= CONFIG.split_kv_max_programs, **counters, **result})
        llm.shutdown()
        common.free_cuda()


if __name__ == "__main__":
    main()
