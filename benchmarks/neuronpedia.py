"""The Neuronpedia API's steer calls against the same generations through /v1/completions.

C concurrent ``/neuronpedia/v1/steer/completion`` calls with ``types: [STEERED, DEFAULT]`` (a random
SAE's feature, SIMPLE_ADDITIVE), T tokens each, then the same 2C generations through
``/v1/completions`` (C with the same feature steering, C unsteered, same prompts and seeds), all
concurrent, on one server (``--no-prefix-caching``, so repeats and modes prefill alike). Every
mode's throughput counts its tokens on the word tokenizer's texts; modes alternate over the
repeats, medians reported.
On CPU in float32 the engine is batch-invariant and the texts must be identical too; on a GPU in
bfloat16 a different batch company moves logits by rounding, and sampled continuations of a random
model (a nearly flat distribution) part at such ties, so there the records give each mode's share
of texts identical to the first completions run next to completions' own repeat-to-repeat share
(the noise floor) instead of failing. Target: neuronpedia >=
0.9x completions (issue 50), Qwen3-0.6B shape, random weights, a random SAE of 16k features.

    python -m benchmarks neuronpedia [--calls 64] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import httpx
import numpy as np
import torch

from . import common
from .common import emit
from .serve import server_process

KEY = "bench-key"
SAE_NAME = "bench-res"
STRENGTH = 8.0
TEMPERATURE = 0.6


# ---------------------------------------------------------------- the model's tokenizer and the SAE

def with_word_tokenizer(path: str) -> str:
    """The random checkpoint beside a word-level tokenizer (``w<id>`` per id, its BOS and EOS at
    the config's ids): the Neuronpedia API takes text, and every id the model samples decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    out = f"{path}-words"
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        return out
    config = AutoConfig.from_pretrained(path)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    specials = {config.bos_token_id: "<bos>", config.eos_token_id: "<eos>"}
    for i, token in specials.items():
        vocab[token] = vocab.pop(f"w{i}")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="w0")
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for name in os.listdir(path):
        os.symlink(os.path.abspath(os.path.join(path, name)), os.path.join(tmp, name))
    fast.save_pretrained(tmp)
    os.rename(tmp, out)
    return out


def random_sae_dir(root: str, hidden: int, d_sae: int, layer: int, seed: int) -> str:
    """A ReLU SAE with unit decoder rows as a SAELens directory at ``post_mlp`` of ``layer``."""
    from safetensors.torch import save_file

    path = os.path.join(root, f"sae-{hidden}-{d_sae}-{layer}-{seed}")
    if os.path.exists(os.path.join(path, "cfg.json")):
        return path
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.nn.functional.normalize(torch.randn(d_sae, hidden, generator=g), dim=1)
    os.makedirs(path, exist_ok=True)
    save_file({"W_enc": W_dec.T.contiguous(), "b_enc": torch.full((d_sae,), -0.05), "W_dec": W_dec,
               "b_dec": torch.zeros(hidden)}, os.path.join(path, "sae_weights.safetensors"))
    with open(os.path.join(path, "cfg.json"), "w") as f:
        json.dump({"d_in": hidden, "d_sae": d_sae, "architecture": "standard", "apply_b_dec_to_input": False,
                   "normalize_activations": "none", "metadata": {"hook_name": f"blocks.{layer}.hook_resid_post"}}, f)
    return path


# ---------------------------------------------------------------- the load

def workload(args, path: str) -> list[dict[str, Any]]:
    """Per call: a prompt of random words (length uniform in [min_len, max_len]) and its token ids
    as the Neuronpedia API makes them (BOS first), a feature and a seed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rng = np.random.default_rng(args.seed)
    calls = []
    for i in range(args.calls):
        words = rng.integers(3, len(tok) - 3, int(rng.integers(args.min_len, args.max_len + 1)))
        words = words[(words != tok.bos_token_id) & (words != tok.eos_token_id)]
        prompt = " ".join(f"w{w}" for w in words)
        calls.append({"prompt": prompt, "ids": [tok.bos_token_id, *tok(prompt, add_special_tokens=False).input_ids],
                      "index": int(rng.integers(0, args.d_sae)), "seed": 1000 + i})
    return calls


async def neuronpedia(client: httpx.AsyncClient, call: dict, tokens: int, model: str, stream: bool) -> list[str]:
    body = {"prompt": call["prompt"], "model": model, "steer_method": "SIMPLE_ADDITIVE", "normalize_steering": False,
            "types": ["STEERED", "DEFAULT"], "n_completion_tokens": tokens, "temperature": TEMPERATURE,
            "strength_multiplier": 1.0, "freq_penalty": 0.0, "seed": call["seed"], "stream": stream,
            "features": [{"model": model, "source": SAE_NAME, "index": call["index"], "strength": STRENGTH}]}
    if not stream:
        r = await client.post("/neuronpedia/v1/steer/completion", json=body)
        r.raise_for_status()
        return [o["output"] for o in r.json()["outputs"]]
    last = None
    async with client.stream("POST", "/neuronpedia/v1/steer/completion", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line:
                last = line
    return [o["output"] for o in json.loads(last.removeprefix("data: "))["outputs"]]


async def completions(client: httpx.AsyncClient, call: dict, tokens: int, model: str) -> list[str]:
    """The call's two generations as plain requests: the feature through ``steering_vectors``, and none."""
    base = {"model": model, "prompt": call["ids"], "max_tokens": tokens, "temperature": TEMPERATURE,
            "seed": call["seed"]}
    steer = {"steering_vectors": {"features": [{"sae": SAE_NAME, "index": call["index"], "scale": STRENGTH}]}}
    answers = await asyncio.gather(client.post("/v1/completions", json={**base, **steer}),
                                   client.post("/v1/completions", json=base))
    for r in answers:
        r.raise_for_status()
    return [r.json()["choices"][0]["text"] for r in answers]


async def run_mode(url: str, mode: str, calls: list[dict], tokens: int, model: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=2 * len(calls), max_keepalive_connections=None)
    headers = {"X-SECRET-KEY": KEY, "Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=headers) as client:
        start = time.perf_counter()
        if mode == "completions":
            texts = await asyncio.gather(*[completions(client, c, tokens, model) for c in calls])
        else:
            texts = await asyncio.gather(*[neuronpedia(client, c, tokens, model, mode == "neuronpedia_stream")
                                           for c in calls])
        return {"seconds": time.perf_counter() - start, "texts": texts}


def words(texts: list[list[str]]) -> int:
    """Generated tokens: the word tokenizer decodes each id to one space-separated word."""
    return sum(len(text.split()) for pair in texts for text in pair)


def identical_share(texts: list[list[str]], reference: list[list[str]]) -> float:
    pairs = [(a, b) for ours, theirs in zip(texts, reference) for a, b in zip(ours, theirs)]
    return sum(a == b for a, b in pairs) / len(pairs)


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=None, help="concurrent steer calls (default 64; --smoke 4)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per generation (default 64; --smoke 8)")
    p.add_argument("--d-sae", type=int, default=None, help="SAE width (default 16384; --smoke 128)")
    p.add_argument("--layer", type=int, default=None, help="the SAE's layer (default 14; --smoke 1)")
    p.add_argument("--repeats", type=int, default=None, help="rounds of the modes, alternating (default 3; --smoke 1)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    defaults = {"calls": (64, 4), "tokens": (64, 8), "d_sae": (16384, 128), "layer": (14, 1), "repeats": (3, 1),
                "min_len": (16, 4), "max_len": (64, 12)}
    path = with_word_tokenizer(common.setup("neuronpedia", args, defaults))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    sae = random_sae_dir(args.cache_dir, config.hidden_size, args.d_sae, args.layer, args.seed)
    emit({"record": "setup", "calls": args.calls, "tokens": args.tokens, "d_sae": args.d_sae, "layer": args.layer})
    flags = ["--no-prefix-caching", "--api-key", KEY, "--served-model-name", "bench", "--neuronpedia",
             "--sae", f"{SAE_NAME}={sae}"]
    calls = workload(args, path)
    modes = ["completions", "neuronpedia", "neuronpedia_stream"]
    with server_process(args, path, flags) as server:
        start = time.perf_counter()
        for mode in modes:  # graphs, kernels and the router's SAE copy before timing
            asyncio.run(run_mode(server.url, mode, calls, min(args.tokens, 8), "bench"))
        emit({"record": "warmup", "seconds": time.perf_counter() - start})
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for r in range(args.repeats):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                runs[mode].append(asyncio.run(run_mode(server.url, mode, calls, args.tokens, "bench")))
    reference = runs["completions"][0]["texts"]
    strict = not torch.cuda.is_available() or args.device == "cpu"
    speed = {}
    for mode, results in runs.items():
        shares = [identical_share(run["texts"], reference) for run in results]
        rates = [words(run["texts"]) / run["seconds"] for run in results]
        speed[mode] = common.median(rates)
        emit({"record": "run", "mode": mode, "generations": 2 * args.calls,
              "output_tokens": [words(run["texts"]) for run in results],
              "seconds_all": [run["seconds"] for run in results], "output_tok_s": speed[mode],
              "identical_share": shares})
        if strict and min(shares) < 1.0:
            raise SystemExit(f"{mode}: the generations differ from /v1/completions' (same prompts, seeds, steering)")
    emit({"record": "ratio", "neuronpedia_over_completions": speed["neuronpedia"] / speed["completions"],
          "neuronpedia_stream_over_completions": speed["neuronpedia_stream"] / speed["completions"],
          "target": 0.9})

if __name__ == "__main__":
    main()
