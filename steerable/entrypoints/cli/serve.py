"""``steerable serve MODEL``: the OpenAI-compatible server (see docs/server.md)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from steerable.entrypoints.cli.common import (
    CliError,
    add_control_vector_args,
    add_engine_args,
    add_model_arg,
    control_vector,
    engine_kwargs,
    load_sae,
    named_sae_file,
    run_checked,
)

if TYPE_CHECKING:
    from steerable.entrypoints.openai.state import ServerSettings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                            description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                                        "tokenize, models, metrics) with steering and capture in the request body "
                                        "and admin routes for global steering, modules and capture streams.")
    add_model_arg(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    group.add_argument("--api-key", action="append", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize, /detokenize; repeat for "
                            "several keys (default: $STEERABLE_API_KEY, else open)")
    group.add_argument("--admin-api-key", default=os.environ.get("STEERABLE_ADMIN_API_KEY"),
                       help="key of the admin routes (global steering, modules, capture streams); also a user key. "
                            "Without it those routes answer 403 (default: $STEERABLE_ADMIN_API_KEY)")
    group.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL as "
                       "given)")
    group.add_argument("--max-body-bytes", type=int, default=32 * 2**20,
                       help="larger request bodies get 413 (default: 32 MiB)")
    group.add_argument("--max-capture-bytes", type=int, default=64 * 2**20,
                       help="a request whose captures could exceed this many bytes per response gets 400 up front "
                            "(default: 64 MiB); larger captures belong in a capture stream")
    group.add_argument("--max-n", type=int, default=128,
                       help="completions per request at most (n); above it a request gets 400 (default: 128, "
                            "OpenAI's limit)")
    group.add_argument("--max-fanout-seqs", type=int, default=None,
                       help="batch slots the completions of one n-request hold at once, so requests behind it keep "
                            "the rest (default: --max-num-seqs, no limit; on a CPU, where a step's time grows with "
                            "the batch, a few)")
    group.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one, "
                       "used instead of the tokenizer's")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="read tool calls out of the model's output when a request lets it choose (tool_choice "
                            "'auto', the default with tools); needs --tool-call-parser")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="the model's tool-call format: hermes (Qwen2.5, Qwen3, Hermes, SmolLM), llama3_json "
                            "(Llama 3.1-3.3), mistral, qwen3_coder (Qwen3-Coder, Qwen3.5)")
    group.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="move the model's <think> reasoning into reasoning_content: qwen3, deepseek_r1")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default: info)")
    group.add_argument("--sae", action="append", type=named_sae_file, default=[], metavar="NAME=PATH[:LAYER[:HOOK]]",
                       help="register an SAE (SAELens or sparsify directory, Gemma Scope params.npz) as NAME at "
                            "start, for feature steering and capture; repeat for several (see docs/sae.md)")
    group.add_argument("--dashboards", action="append", default=[], metavar="DIR",
                       help="feature dashboards (steerable dashboards --out DIR) of an SAE given with --sae, served at "
                            "GET /v1/saes/NAME/features/I; repeat for several (see docs/dashboards.md)")
    group.add_argument("--neuronpedia", action="store_true",
                       help="also serve the Neuronpedia inference API under /neuronpedia/v1, for a self-hosted "
                            "Neuronpedia or neuronpedia-inference-client scripts (see docs/neuronpedia.md)")
    group.add_argument("--neuronpedia-source-set", action="append", type=source_set, default=[],
                       metavar="NAME=SAE1,SAE2,...",
                       help="a Neuronpedia source set (what /activation/all ranks over): registered SAE names; "
                            "repeat for several")
    add_control_vector_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=lambda args: run_checked(serve, args))


def source_set(text: str) -> tuple[str, list[str]]:
    """``NAME=SAE1,SAE2,...`` -> (name, [SAE names])."""
    name, sep, rest = text.partition("=")
    saes = [sae.strip() for sae in rest.split(",") if sae.strip()]
    if not sep or not name or not saes:
        raise argparse.ArgumentTypeError(f"expected NAME=SAE1,SAE2,..., got {text!r}")
    return name, saes


def serve(args: argparse.Namespace) -> int:
    check_flags(args)
    listener = listen(args.host, args.port)  # a taken port fails now, not after the model has loaded
    try:
        return _serve(args, listener)
    finally:
        listener.close()


def _serve(args: argparse.Namespace, listener: socket.socket) -> int:
    settings = server_settings(args)
    kwargs = {**engine_kwargs(args), "max_n": args.max_n, "max_fanout_seqs": args.max_fanout_seqs}
    steering = control_vector(args)
    saes = {name: load_sae(spec, "--sae") for name, spec in args.sae}  # every file read before the model loads
    dashboards = [(folder, load_dashboards(folder)) for folder in args.dashboards]
    from steerable.entrypoints.engine_process import ProcessAsyncLLM
    from steerable.entrypoints.openai import build_app, run_server

    llm = ProcessAsyncLLM(**kwargs)  # the engine in its own process: HTTP work must not slow its steps
    try:
        if steering is not None:  # llama.cpp's global control vectors: the default every request gets
            cfg = llm.model_config
            steering.check_model(cfg.hidden_size, cfg.num_layers, "--control-vector")
            asyncio.run(llm.set_steering_vectors(steering))
        for name, sae in saes.items():
            try:
                asyncio.run(llm.register_sae(name, sae))
            except ValueError as err:  # an SAE of another model: say which flag
                raise CliError(f"--sae {name}: {err}") from None
        settings.dashboards = attach_dashboards(saes, dashboards, llm.dtype)
        app = build_app(llm, settings)
        print(f"steerable: serving {args.model} as {settings.served_model_name!r} at http://{args.host}:{args.port} "
              "(Ctrl-C stops it)", file=sys.stderr, flush=True)
        run_server(app, listener, args.log_level)
    finally:
        llm.shutdown()
    print("steerable: stopped", file=sys.stderr, flush=True)
    return 0


def load_dashboards(folder: str) -> Any:
    from steerable.sae.dashboards import FeatureDashboards

    try:
        return FeatureDashboards.load(folder)
    except ValueError as err:
        raise CliError(f"--dashboards {folder}: {err}") from None


def attach_dashboards(saes: dict[str, Any], dashboards: list[tuple[str, Any]], dtype: Any) -> dict[str, Any]:
    """Each ``--dashboards`` directory under the name of the ``--sae`` it was computed for: the SAE
    whose weights, as the engine keeps them (in its dtype), hash to the directory's ``sae_sha256``."""
    hashes = {sae.to("cpu", dtype).content_hash.hex(): name for name, sae in saes.items()}
    out: dict[str, Any] = {}
    for folder, dash in dashboards:
        name = hashes.get(dash.settings.sae_sha256)
        if name is None:
            raise CliError(f"--dashboards {folder}: sae_sha256 {dash.settings.sae_sha256} (SAE "
                           f"{dash.settings.sae!r}) matches no SAE given with --sae "
                           f"({', '.join(sorted(saes)) or 'none'}, in the engine's dtype)")
        if name in out:
            raise CliError(f"--dashboards {folder}: SAE {name!r} already has dashboards")
        out[name] = dash
    return out


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening (connections wait there until the server
    starts, as vLLM's do); CliError when the address is taken or cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise CliError(f"--host: cannot resolve {host!r} ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to take
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise CliError(f"--port: {host}:{port} is already in use (another server?); stop it or choose "
                           "another --port") from None
        raise CliError(f"--host/--port: cannot listen on {host}:{port} ({err.strerror})") from None
    return sock


def check_flags(args: argparse.Namespace) -> None:
    """The flags' own checks (CliError), before anything is imported, bound or loaded."""
    if not 0 < args.port < 65536:
        raise CliError(f"--port: {args.port} is not a TCP port")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CliError("--enable-auto-tool-choice needs --tool-call-parser NAME (the model's tool-call format)")
    for flag in ("max_body_bytes", "max_capture_bytes", "max_n", "max_fanout_seqs"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise CliError(f"--{flag.replace('_', '-')} must be positive")
    if any(not key for key in _api_keys(args)) or args.admin_api_key == "":
        raise CliError("--api-key / --admin-api-key must not be empty")
    check_source_sets(args)


def check_source_sets(args: argparse.Namespace) -> None:
    """``--neuronpedia-source-set``: only with ``--neuronpedia``, each name once, of SAEs given with ``--sae``."""
    if args.neuronpedia_source_set and not args.neuronpedia:
        raise CliError("--neuronpedia-source-set: only with --neuronpedia")
    sets = dict(args.neuronpedia_source_set)
    if len(sets) != len(args.neuronpedia_source_set):
        raise CliError("--neuronpedia-source-set: a set name is given twice")
    registered = {name for name, _ in args.sae}
    for name, members in sets.items():
        unknown = [sae for sae in members if sae not in registered]
        if unknown:
            raise CliError(f"--neuronpedia-source-set {name}: {unknown} are not registered at start (--sae NAME=PATH)")


def _api_keys(args: argparse.Namespace) -> list[str]:
    return args.api_key or ([os.environ["STEERABLE_API_KEY"]] if os.environ.get("STEERABLE_API_KEY") else [])


def server_settings(args: argparse.Namespace) -> "ServerSettings":
    """The server's settings from the flags (CliError), before the model loads. The web stack is
    imported here, not at ``steerable --help``."""
    from steerable.entrypoints.openai.reasoning import REASONING_PARSERS
    from steerable.entrypoints.openai.state import ServerSettings
    from steerable.entrypoints.openai.tool_parsers import TOOL_PARSERS

    for flag, name, known in (("--tool-call-parser", args.tool_call_parser, TOOL_PARSERS),
                              ("--reasoning-parser", args.reasoning_parser, REASONING_PARSERS)):
        if name is not None and name not in known:
            raise CliError(f"{flag}: unknown parser {name!r}; one of {sorted(known)}")
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    return ServerSettings(served_model_name=args.served_model_name or args.model, api_keys=_api_keys(args),
                          admin_api_key=args.admin_api_key, max_body_bytes=args.max_body_bytes,
                          max_capture_bytes=args.max_capture_bytes, chat_template=template,
                          tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                          reasoning_parser=args.reasoning_parser,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                          neuronpedia=args.neuronpedia, neuronpedia_source_sets=dict(args.neuronpedia_source_set))
