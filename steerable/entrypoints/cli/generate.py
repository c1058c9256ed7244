"""``steerable generate``: complete prompts (through the chat template when the model has one)."""

from __future__ import annotations

import argparse
import sys
import time

from steerable.entrypoints.cli.common import (
    CliError,
    add_control_vector_args,
    add_engine_args,
    add_model_arg,
    control_vector,
    engine_kwargs,
    run_checked,
)

DEFAULT_PROMPT = "What is the capital of France?"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("generate", help="generate text for one or more prompts",
                            description="Generate text for one or more prompts.")
    add_model_arg(parser)
    parser.add_argument("--prompt", action="append", help="prompt text; repeat for several (default: a demo question)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens whose probability reaches P (default: 1, all)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables it (default)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than P times the most likely one (default: 0, none)")
    parser.add_argument("--stop", action="append", default=None, help="stop string; repeat for several")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--logprobs", type=int, default=None, help="print the top-N logprobs of each token")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    add_control_vector_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=lambda args: run_checked(generate, args))


def generate(args: argparse.Namespace) -> int:
    from steerable import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, stop=args.stop, n=args.n,
                                logprobs=args.logprobs, seed=args.sampling_seed)
    except ValueError as err:
        raise CliError(str(err)) from None
    kwargs = engine_kwargs(args)
    steering = control_vector(args)
    prompts = args.prompt or [DEFAULT_PROMPT]
    with LLM(**kwargs) as llm:
        if steering is not None:
            cfg = llm.llm_engine.model_config
            steering.check_model(cfg.hidden_size, cfg.num_layers, "--control-vector")
            llm.set_steering_vectors(steering)
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
            print(f">>> {prompt}")
            for completion in out.outputs:
                num_tokens += len(completion.token_ids)
                label = f"[{completion.index}] " if len(out.outputs) > 1 else ""
                print(f"{label}{completion.text.strip()}")
                if completion.logprobs:
                    _print_logprobs(tokenizer, completion)
            print()
        print(f"[{num_tokens} tokens in {elapsed:.2f}s, {num_tokens / elapsed:.1f} tok/s on "
              f"{llm.llm_engine.device.type}, {str(llm.llm_engine.dtype).removeprefix('torch.')}]", file=sys.stderr)
    return 0


def _print_logprobs(tokenizer, completion) -> None:
    for token, entries in zip(completion.token_ids, completion.logprobs):
        top = sorted(entries.items(), key=lambda kv: kv[1].rank)
        shown = ", ".join(f"{lp.decoded_token!r}: {lp.logprob:.3f}" for _, lp in top)
        print(f"    {tokenizer.decode([token])!r} -> {shown}")
