"""``steerable dashboards``: a JSON-lines corpus -> every feature's dashboard of an SAE in one pass,
as a resumable dashboards directory with the Neuronpedia export (docs/dashboards.md)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from steerable.entrypoints.cli.common import (
    CliError,
    add_engine_args,
    add_model_arg,
    engine_kwargs,
    index_list,
    load_sae,
    read_texts,
    run_checked,
    sae_file,
)


def _context(text: str) -> tuple[int, int]:
    try:
        before, after = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BEFORE,AFTER token counts such as 24,8, got {text!r}") from None
    return before, after


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("dashboards", help="compute every SAE feature's dashboard over a corpus in one pass",
                            description="Top and quantile examples, activation statistics and logit effects of an "
                                        "SAE's features over a JSON-lines corpus, in one pass; written to OUT with the "
                                        "Neuronpedia export (batch-N.json). Resumable (docs/dashboards.md).")
    add_model_arg(parser)
    parser.add_argument("--sae", type=sae_file, required=True, metavar="PATH[:LAYER[:HOOK]]",
                        help="the SAE: a SAELens or sparsify directory or a Gemma Scope params.npz")
    parser.add_argument("--sae-name", default=None, help="its name in OUT and the export (default: the file's folder)")
    parser.add_argument("--input", required=True, help="JSON-lines file, one object per text")
    parser.add_argument("--field", default="text", help="the key holding the text (default: text)")
    parser.add_argument("--out", required=True, help="the dashboards directory")
    parser.add_argument("--features", type=lambda text: index_list(text, "features"), default=None,
                        help="e.g. 0-4095 or 3,17,40 (default: all)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run in OUT")
    parser.add_argument("--shard-size", type=int, default=20000,
                        help="texts between checkpoints of OUT (default: 20000)")
    parser.add_argument("--batch-size", type=int, default=256, help="texts in the engine at a time (default: 256)")
    parser.add_argument("--ray", type=int, default=None, metavar="REPLICAS",
                        help="run the shards on this many Ray replicas (an engine each, a GPU each where the cluster "
                             "has GPUs; $RAY_ADDRESS names a cluster, else a local one starts); pip install "
                             "'steerable[ray]'")
    group = parser.add_argument_group("dashboards")
    group.add_argument("--n-top", type=int, default=20, help="top examples per feature (default: 20)")
    group.add_argument("--context", type=_context, default=(24, 8), metavar="BEFORE,AFTER",
                       help="tokens shown around each example (default: 24,8)")
    group.add_argument("--quantiles", type=int, default=10, help="quantile bins per feature (default: 10)")
    group.add_argument("--n-quantile", type=int, default=5, help="examples drawn per quantile bin (default: 5)")
    group.add_argument("--n-logits", type=int, default=10, help="top and bottom logits per feature (default: 10)")
    group.add_argument("--bins", type=int, default=40, help="activation histogram bins (default: 40)")
    group.add_argument("--sample-seed", type=int, default=0, help="seed of the quantile samples (default: 0)")
    group.add_argument("--exclude-positions", type=lambda text: index_list(text, "positions"), default=[],
                       help="positions whose activations count as 0, e.g. 0 (a first-token attention sink)")
    group.add_argument("--exclude-tokens", type=lambda text: index_list(text, "token ids"), default=[],
                       help="token ids whose activations count as 0, e.g. BOS, as sae-dashboard ignores them")
    group.add_argument("--batch-features", type=int, default=128, help="features per batch-N.json (default: 128)")
    group.add_argument("--model-id", default="", help="Neuronpedia model id in the export (default: MODEL)")
    group.add_argument("--dataset", default="", help="the corpus's name in the export")
    add_engine_args(parser)
    parser.set_defaults(func=lambda args: run_checked(dashboards, args))


def _on_ray(args: argparse.Namespace, texts: list[str], name: str, engine: dict[str, Any], options: dict[str, Any]
            ) -> Any:
    try:
        from steerable.ray.dashboards import feature_dashboards_on_ray
    except ImportError as err:  # RayNotInstalled
        raise CliError(f"--ray: {err}") from None
    model = engine.pop("model")
    return feature_dashboards_on_ray(model, texts, args.sae, replicas=args.ray, engine_kwargs=engine, sae_name=name,
                                     **options)


def dashboards(args: argparse.Namespace) -> int:
    from steerable import LLM
    from steerable.sae.dashboards import feature_dashboards

    for flag, value in (("--shard-size", args.shard_size), ("--batch-size", args.batch_size),
                        ("--batch-features", args.batch_features), ("--ray", args.ray or 1)):
        if value < 1:
            raise CliError(f"{flag} must be >= 1")
    sae = load_sae(args.sae, "--sae")
    name = args.sae_name or os.path.basename(os.path.normpath(os.path.dirname(args.sae[0])
                                                              if os.path.isfile(args.sae[0]) else args.sae[0]))
    texts = read_texts(args.input, args.field)
    options = dict(n_top=args.n_top, context=args.context, quantiles=args.quantiles, n_quantile=args.n_quantile,
                   n_logits=args.n_logits, bins=args.bins, seed=args.sample_seed, features=args.features,
                   exclude_positions=args.exclude_positions, exclude_tokens=args.exclude_tokens,
                   batch_size=args.batch_size, out=args.out, resume=args.resume, shard_size=args.shard_size,
                   use_tqdm=True, export=dict(batch_features=args.batch_features, model_id=args.model_id,
                                              dataset=args.dataset))
    engine = engine_kwargs(args)
    if args.ray is not None:
        dash = _on_ray(args, texts, name, engine, options)
    else:
        with LLM(**engine) as llm:
            llm.register_sae(name, sae)
            dash = feature_dashboards(llm, texts, name, model=args.model, **options)
    print(f"{len(texts)} texts, {dash.tokens} tokens -> dashboards of {len(dash)} features ({len(dash.dead)} dead) "
          f"in {args.out}")
    return 0
