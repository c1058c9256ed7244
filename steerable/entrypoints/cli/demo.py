"""``steerable demo``: train a sentiment vector on the packaged SmolLM2, show its measured effect
on held-out items and three steered generations (offline, CPU, about a minute)."""

from __future__ import annotations

import argparse

from steerable.entrypoints.cli.common import CliError, add_engine_args, add_model_arg, engine_kwargs, run_checked


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="train, evaluate and try a sentiment steering vector",
                            description="Train a sentiment control vector from the pairs shipped with steerable, "
                                        "sweep it over scales on held-out items and generate at -s, 0, +s.")
    add_model_arg(parser)
    parser.add_argument("--scale", type=float, default=3.0, help="s for the generations (default: 3)")
    parser.add_argument("--max-tokens", type=int, default=40, help="tokens per generation (default: 40)")
    parser.add_argument("--out", default=None, help="also save the vector (one unit of scale): .gguf or .safetensors")
    parser.add_argument("--plot", default=None, help="also save the sweep as a PNG")
    add_engine_args(parser)
    parser.set_defaults(func=lambda args: run_checked(demo, args))


def demo(args: argparse.Namespace) -> int:
    from steerable import LLM
    from steerable.vectors.demo import PROMPT, UNIT, demo_layers, run_demo

    if args.out is not None and not args.out.endswith((".gguf", ".safetensors")):
        raise CliError(f"--out: {args.out!r} must end in .gguf or .safetensors")
    if args.max_tokens < 1:
        raise CliError("--max-tokens must be >= 1")
    with LLM(**engine_kwargs(args)) as llm:
        layers = demo_layers(llm.llm_engine.model_config.num_layers)
        print(f"Training a sentiment vector on {args.model} (mean_diff at the last token, layers "
              f"{layers.start}-{layers.stop - 1}) ...", flush=True)
        result = run_demo(llm, generation_scale=args.scale, max_tokens=args.max_tokens, use_tqdm=True)
    print(f"\n{result.pairs} contrast pairs; one unit of scale = {UNIT * 100:g} % of the mean residual norm at each "
          "steered layer.\nHeld-out items: p(positive completion) against the scale.\n")
    print(result.report.to_markdown())
    print(f"\nGreedy generations for {PROMPT!r}:")
    for scale, text in result.generations.items():
        print(f"  [{scale:+g}] {' '.join(text.split())}")  # one line each
    if args.out:
        result.vector.save(args.out)
        print(f"\nvector -> {args.out}")
    if args.plot:
        result.report.plot(args.plot)
        print(f"plot -> {args.plot}")
    return 0
