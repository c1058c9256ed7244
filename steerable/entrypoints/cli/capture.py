"""``steerable capture``: a JSON-lines corpus -> activations in sharded safetensors (resumable)."""

from __future__ import annotations

import argparse
import os

from steerable.entrypoints.cli.common import (
    CliError,
    add_engine_args,
    add_model_arg,
    engine_kwargs,
    layer_list,
    load_sae,
    read_texts,
    run_checked,
    sae_file,
)
from steerable.hook_points import HOOK_POINTS, POST_MLP


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("capture", help="capture activations of a corpus into safetensors shards",
                            description="Capture hidden states (or an SAE's top features) of every text in a "
                                        "JSON-lines file into OUT/shard-NNNNN.safetensors plus OUT/index.json "
                                        "(see docs/vectors.md, docs/sae.md).")
    add_model_arg(parser)
    parser.add_argument("--input", required=True, help="JSON-lines file, one object per text")
    parser.add_argument("--field", default="text", help="the key holding the text (default: text)")
    parser.add_argument("--layers", type=layer_list, default=None, help="e.g. 4,8,12 or 8-20 (default: all)")
    parser.add_argument("--hook", choices=HOOK_POINTS, default=POST_MLP)
    parser.add_argument("--select", default="last_prompt",
                        help="all | all_prompt | last_prompt | all_generated, or a SelectSpec wire dict as JSON "
                             "(default: last_prompt)")
    parser.add_argument("--dtype", dest="capture_dtype", default=None,
                        help="stored dtype: float32 | bfloat16 | float16 (default: the model's)")
    parser.add_argument("--sae", type=sae_file, default=None, metavar="PATH[:LAYER[:HOOK]]",
                        help="store this SAE's (or transcoder's) top features of each row (shards of 'indices' and "
                             "'values') instead of hidden states; --layers, --hook and --dtype then do not apply")
    parser.add_argument("--top-k", type=int, default=64, help="features kept per row with --sae (default: 64)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run in OUT")
    parser.add_argument("--shard-size", type=int, default=1000, help="examples per shard (default: 1000)")
    parser.add_argument("--batch-size", type=int, default=64, help="texts in the engine at a time (default: 64)")
    add_engine_args(parser, dtype_flag="--model-dtype")
    parser.set_defaults(func=lambda args: run_checked(capture, args))


def capture(args: argparse.Namespace) -> int:
    import json

    from steerable import LLM
    from steerable.capture.corpus import INDEX, capture_corpus
    from steerable.capture.store import resolve_storage_dtype
    from steerable.selection import SelectSpec

    select = args.select
    if select.lstrip().startswith("{"):
        try:
            select = json.loads(select)
        except json.JSONDecodeError as err:
            raise CliError(f"--select: not JSON ({err})") from None
    SelectSpec.parse(select)
    if args.shard_size < 1 or args.batch_size < 1:
        raise CliError("--shard-size and --batch-size must be >= 1")
    sae = load_sae(args.sae, "--sae") if args.sae is not None else None
    resolve_storage_dtype(args.capture_dtype, "--dtype")
    if os.path.exists(os.path.join(args.out, INDEX)) and not args.resume:
        raise CliError(f"--out: {args.out} already holds a corpus capture; pass --resume or choose another directory")
    texts = read_texts(args.input, args.field)
    kwargs = engine_kwargs(args)
    with LLM(**kwargs) as llm:
        if sae is not None:
            llm.register_sae("sae", sae)
        index = capture_corpus(llm, texts, args.out, layers=args.layers, hook=args.hook, select=select,
                               dtype=args.capture_dtype, shard_size=args.shard_size, batch_size=args.batch_size,
                               resume=args.resume, model=args.model, use_tqdm=True,
                               sae="sae" if sae is not None else None, top_k=args.top_k)
    rows = sum(entry["rows"] for entry in index["shards"])
    what = f"top-{args.top_k} SAE features" if sae is not None else f"{len(index['layers'])} layers"
    print(f"{len(texts)} texts -> {rows} rows x {what} in {len(index['shards'])} shards under {args.out}")
    return 0
