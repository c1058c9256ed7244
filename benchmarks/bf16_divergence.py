"""Where steerable's bfloat16 greedy tokens and HF's bfloat16 ``generate`` part ways on the test
suite's tiny random models, and who is nearer the truth there: at the first differing position,
the logit margin between the two tokens in HF bfloat16 and in an fp32 forward of the same
(bf16-rounded) weights. A margin near zero in fp32 is a near tie that rounding decides; a large
one points at a real difference. One JSON line per divergence and per family.

    PYTHONPATH=.:tests python benchmarks/bf16_divergence.py [--families gemma2 gpt2 qwen3]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import torch


def first_divergence(llm, hf, hf32, prompt_ids: list[int], tokens: int) -> dict | None:
    from steerable import SamplingParams

    ours = llm.generate([prompt_ids], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    t = torch.tensor([prompt_ids], device="cuda")
    with torch.no_grad():
        ref = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
    if ours == ref:
        return None
    d = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    context = torch.tensor([prompt_ids + ours[:d]], device="cuda")
    with torch.no_grad():
        bf16, fp32 = hf(context).logits[0, -1].float(), hf32(context).logits[0, -1].float()
    a, b = ours[d], ref[d]
    return {"position": d, "ours": a, "hf": b, "hf_bf16_margin": (bf16[b] - bf16[a]).item(),
            "fp32_margin_hf_minus_ours": (fp32[b] - fp32[a]).item(), "fp32_argmax": int(fp32.argmax()),
            "logit_absmax": fp32.abs().max().item()}


def main() -> None:
    from conftest import PROMPTS, build_family_dirs
    from transformers import AutoModelForCausalLM

    from steerable import LLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["gemma2", "gpt2", "gemma3", "qwen3", "llama"])
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    dirs = build_family_dirs(pathlib.Path(tempfile.mkdtemp(prefix="bf16-div-")), init=0.15, seed=0)  # test_gpu's
    for family in args.families:
        path = dirs[family]
        llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=8192)
        prompts = [llm.get_tokenizer()(p).input_ids for p in PROMPTS]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
        hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                    attn_implementation="eager").float().cuda().eval()
        diverged = 0
        for i, ids in enumerate(prompts):
            found = first_divergence(llm, hf, hf32, ids, args.tokens)
            if found is not None:
                diverged += 1
                print(json.dumps({"record": "divergence", "family": family, "prompt": i, **found}), flush=True)
        print(json.dumps({"record": "family", "family": family, "prompts": len(prompts), "diverged": diverged}),
              flush=True)
        llm.shutdown()
        del hf, hf32
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
