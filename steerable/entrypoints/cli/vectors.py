"""``steerable vectors train|eval``: contrast pairs -> a control vector file; a file -> a scale sweep."""

from __future__ import annotations

import argparse
import re

from steerable.entrypoints.cli.common import (
    CliError,
    add_engine_args,
    add_model_arg,
    engine_kwargs,
    layer_list,
    number_list,
    run_checked,
)
from steerable.hook_points import POST_MLP, RESIDUAL_POINTS

# "--scales -2,-1,0,1,2": argparse takes a value starting with "-" for an option unless it looks
# like a negative number; a comma-separated list of numbers should count as one too.
_NUMBER_LIST = re.compile(r"^-\d+$|^-\d*\.\d+$|^-?[\d.]+(,-?[\d.]+)+$")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("vectors", help="train and evaluate steering vectors",
                            description="Train a control vector from contrast pairs, or evaluate one on A/B items.")
    verbs = parser.add_subparsers(dest="action", required=True, metavar="ACTION",
                                  help="train or eval; 'steerable vectors ACTION --help' lists its options")

    train = verbs.add_parser("train", help="contrast pairs -> a control vector (.gguf or .safetensors)")
    add_model_arg(train)
    train.add_argument("--pairs", required=True, help='JSON lines: {"positive": ..., "negative": ...}')
    train.add_argument("--layers", type=layer_list, default=None, help="e.g. 8-20 or 4,8,12 (default: 1 to L-1)")
    train.add_argument("--method", default="mean_diff", choices=["mean_diff", "pca_diff", "pca_center", "logistic"],
                       help="how the direction is found from the pairs' activations (default: mean_diff; "
                            "docs/vectors.md)")
    train.add_argument("--token", default="last", choices=["last", "mean"], help="last prompt token or prompt mean")
    train.add_argument("--hook", default=POST_MLP, choices=RESIDUAL_POINTS,
                       help=f"the residual point read and steered (default: {POST_MLP})")
    train.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                       help="unit vectors (default: the method's own, see docs/vectors.md)")
    train.add_argument("--batch-size", type=int, default=64, help="pairs per engine call (default: 64)")
    train.add_argument("--out", required=True, help="output file: .gguf (llama.cpp) or .safetensors")
    add_engine_args(train)
    train.set_defaults(func=lambda args: run_checked(run_train, args))

    ev = verbs.add_parser("eval", help="sweep a control vector's scale over A/B items and print the table")
    ev._negative_number_matcher = _NUMBER_LIST
    add_model_arg(ev)
    ev.add_argument("--vector", required=True, help="control vector file (.gguf or .safetensors)")
    ev.add_argument("--items", required=True, help='JSON lines: {"question": ..., "matching": "A" | "B"} (CAA) '
                                                   'or {"prompt": ..., "matching": ..., "other": ...}')
    ev.add_argument("--scales", type=number_list, default=[-2.0, -1.0, 0.0, 1.0, 2.0],
                    help="comma-separated (default: -2,-1,0,1,2)")
    ev.add_argument("--relative", action="store_true", help="scales are fractions of the mean residual norm")
    ev.add_argument("--positions", default="all", choices=["all", "answer"],
                    help="steer every token (default, as --control-vector does) or from the answer on (CAA)")
    ev.add_argument("--plot", default=None, help="also save the sweep as a PNG")
    add_engine_args(ev)
    ev.set_defaults(func=lambda args: run_checked(run_eval, args))


def run_train(args: argparse.Namespace) -> int:
    from steerable import LLM
    from steerable.vectors import read_pairs, train

    if not args.out.endswith((".gguf", ".safetensors")):
        raise CliError(f"--out: {args.out!r} must end in .gguf or .safetensors")
    if args.batch_size < 1:
        raise CliError("--batch-size must be >= 1")
    positives, negatives = read_pairs(args.pairs)
    with LLM(**engine_kwargs(args)) as llm:
        cv = train(llm, positives, negatives, layers=args.layers, method=args.method, token=args.token,
                   hook=args.hook, batch_size=args.batch_size, normalize=args.normalize, use_tqdm=True)
    cv.save(args.out)
    print(f"{cv!r} from {len(positives)} pairs -> {args.out}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from steerable import LLM
    from steerable.vectors import ControlVector, evaluate, read_items

    cv = ControlVector.load(args.vector)
    items = read_items(args.items)
    if args.relative:
        cv.normalized(relative=True)  # fails now, not after loading the model, when the file has no norms
    with LLM(**engine_kwargs(args)) as llm:
        cfg = llm.llm_engine.model_config
        cv.check_model(cfg.hidden_size, cfg.num_layers, args.vector)
        report = evaluate(llm, cv, items, scales=args.scales, relative=args.relative, positions=args.positions)
    print(report.to_markdown())
    if args.plot:
        report.plot(args.plot)
        print(f"plot -> {args.plot}")
    return 0
