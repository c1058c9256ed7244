"""``steerable capture``: a corpus -> activations on disk (steerable's shards, SAELens' activation
cache or delphi's latent cache), resumable, on one engine, R replicas or a Ray cluster."""

from __future__ import annotations

import argparse
import os

from steerable.entrypoints.cli.common import (
    CliError,
    DeprecatedFlag,
    add_engine_args,
    add_model_arg,
    engine_kwargs,
    layer_list,
    load_sae,
    run_checked,
    sae_file,
)
from steerable.hook_points import HOOK_POINTS, POST_MLP

FORMATS = ("steerable", "saelens", "delphi")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("capture", help="capture activations of a corpus (safetensors shards, SAELens' or "
                                            "delphi's cache)",
                            description="Capture hidden states (or an SAE's features) of every text of a corpus "
                                        "into OUT: steerable's shards (OUT/shard-NNNNN.safetensors + index.json), "
                                        "SAELens' activation cache (--format saelens) or delphi's latent cache "
                                        "(--format delphi); see docs/capture.md and docs/scale.md.")
    add_model_arg(parser)
    parser.add_argument("--input", required=True,
                        help="JSON lines of texts (or of pre-tokenized 'token_ids' windows), or a Hugging Face "
                             "dataset directory (save_to_disk)")
    parser.add_argument("--field", default="text", help="the key holding the text (default: text)")
    parser.add_argument("--format", choices=FORMATS, default="steerable",
                        help="steerable (default) | saelens (SAELens' activation cache) | delphi (delphi's latent "
                             "cache, with --sae)")
    parser.add_argument("--context-size", type=int, default=None,
                        help="tokens per window for --format saelens / delphi (texts packed as SAELens packs them)")
    parser.add_argument("--layers", type=layer_list, default=None, help="e.g. 4,8,12 or 8-20 (default: all)")
    parser.add_argument("--hook", choices=HOOK_POINTS, default=POST_MLP,
                        help=f"where hidden states are read (default: {POST_MLP}; docs/capture.md)")
    parser.add_argument("--select", default=None,
                        help="all | all_prompt | last_prompt | all_generated, or a SelectSpec wire dict as JSON "
                             "(default: last_prompt; the window formats capture all)")
    parser.add_argument("--capture-dtype", default=None,
                        help="stored dtype: float32 | bfloat16 | float16 (default: the model's; saelens: float32 "
                             "or float16; --dtype, as in every verb, is the model's own)")
    parser.add_argument("--sae", type=sae_file, default=None, metavar="PATH[:LAYER[:HOOK]]",
                        help="store this SAE's (or transcoder's) top features of each row instead of hidden states; "
                             "--layers, --hook and --capture-dtype then do not apply")
    parser.add_argument("--top-k", type=int, default=None,
                        help="features kept per row with --sae (default: 64; delphi with a top-k SAE: its k)")
    parser.add_argument("--hookpoint", default=None,
                        help="delphi: the hookpoint directory's name (default: the SAE's TransformerLens hook name)")
    parser.add_argument("--n-splits", type=int, default=5, help="delphi: latent ranges, one file each (default: 5)")
    parser.add_argument("--out", required=True, help="output directory (or an fsspec URL)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run in OUT")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="examples (windows) per shard (default: 1000; saelens: windows of 500 MB)")
    parser.add_argument("--batch-size", type=int, default=256, help="examples in an engine at a time (default: 256)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="engine processes on this machine, one per GPU (on CPU each with its share of the "
                             "cores), each taking whole shards (default: 1)")
    parser.add_argument("--ray", default=None, metavar="ADDRESS",
                        help="run on a Ray cluster: local (start one here), auto (the running one) or host:port; "
                             "pip install 'steerable[ray]'")
    add_engine_args(parser).add_argument(
        "--model-dtype", dest="dtype", action=DeprecatedFlag, replacement="--dtype (the model's dtype, as in every verb)",
        help="deprecated spelling of --dtype")
    parser.set_defaults(func=lambda args: run_checked(capture, args))


def capture(args: argparse.Namespace) -> int:
    import json

    from steerable import LLM
    from steerable.capture.corpus import INDEX, capture_corpus
    from steerable.capture.corpus_input import read_corpus
    from steerable.capture.store import resolve_storage_dtype
    from steerable.selection import SelectSpec

    select = args.select
    if select is not None and select.lstrip().startswith("{"):
        try:
            select = json.loads(select)
        except json.JSONDecodeError as err:
            raise CliError(f"--select: not JSON ({err})") from None
    if select is not None:
        SelectSpec.parse(select)
    for flag, value in (("--shard-size", args.shard_size), ("--batch-size", args.batch_size),
                        ("--replicas", args.replicas)):
        if value is not None and value < 1:
            raise CliError(f"{flag} must be >= 1")
    sae = load_sae(args.sae, "--sae") if args.sae is not None else None
    resolve_storage_dtype(args.capture_dtype, "--capture-dtype")
    if args.format != "delphi" and os.path.exists(os.path.join(args.out, INDEX)) and not args.resume:
        raise CliError(f"--out: {args.out} already holds a corpus capture; pass --resume or choose another directory")
    corpus = read_corpus(args.input, args.field)
    kwargs = engine_kwargs(args)
    options = dict(layers=args.layers, hook=args.hook, select=select, dtype=args.capture_dtype,
                   shard_size=args.shard_size, batch_size=args.batch_size, resume=args.resume, model=args.model,
                   use_tqdm=True, sae=sae, top_k=args.top_k, format=args.format, context_size=args.context_size,
                   replicas=args.replicas, ray=args.ray, hookpoint=args.hookpoint, n_splits=args.n_splits,
                   source=args.input)
    if args.replicas > 1 or args.ray is not None:
        index = capture_corpus(kwargs, corpus, args.out, **options)  # the engines live in the replicas
    else:
        with LLM(**kwargs) as llm:
            index = capture_corpus(llm, corpus, args.out, **options)
    rows = sum(entry["rows"] for entry in index["shards"])
    what = f"top-{index['top_k']} SAE features" if sae is not None else f"{len(index['layers'])} layers"
    print(f"{index['num_examples']} {'texts' if args.format == 'steerable' else 'windows'} -> {rows} rows x {what} "
          f"in {len(index['shards'])} shards under {args.out}")
    return 0
