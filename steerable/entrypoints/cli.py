"""Command line: ``steerable generate --model PATH_OR_NAME --prompt TEXT``."""

from __future__ import annotations

import argparse
import sys
import time

from steerable.models.loader import DEFAULT_MODEL

DEFAULT_PROMPT = "What is the capital of France?"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steerable", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"HF directory, .gguf file or demo name (default: {DEFAULT_MODEL})")
    gen.add_argument("--prompt", action="append", help="prompt text; repeat for several (default: a demo question)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    return parser


def generate(args: argparse.Namespace) -> int:
    from steerable import LLM, SamplingParams

    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prompts = args.prompt or [DEFAULT_PROMPT]
    tokenizer = llm.get_tokenizer()
    use_chat = not args.raw and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    start = time.perf_counter()
    if use_chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f">>> {prompt}\n{completion.text.strip()}\n")
    print(f"[{num_tokens} tokens in {elapsed:.2f}s, {num_tokens / elapsed:.1f} tok/s on "
          f"{llm.engine.device.type}, {str(llm.engine.dtype).removeprefix('torch.')}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return generate(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
