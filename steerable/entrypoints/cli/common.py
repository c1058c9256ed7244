"""Arguments shared by the verbs that load a model, checked before the model is loaded."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from steerable.models.demo import DEFAULT_MODEL


class CliError(Exception):
    """A bad command-line argument: printed as ``error: ...`` with exit status 2."""


class _Model(argparse.Action):
    """MODEL, positional or as ``--model`` (both spellings, as vLLM's ``serve`` takes them): the
    same model given both ways is fine, two different ones an error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = getattr(namespace, "model_given", None)
        if given is not None and given != values:
            parser.error(f"the model is given twice: {given!r} and {values!r}")
        namespace.model_given = values
        namespace.model = values


class DeprecatedFlag(argparse.Action):
    """An old spelling of another flag: stores into its ``dest`` and says which flag to use."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str = "", **kwargs: Any):
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"warning: {option_string} is deprecated; use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    help_text = f"HF directory, .gguf file, demo name or hub id org/name (default: {DEFAULT_MODEL})"
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, action=_Model, metavar="MODEL", help=help_text)
    parser.add_argument("--model", dest="model", default=DEFAULT_MODEL, action=_Model, metavar="MODEL",
                        help="MODEL as an option")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default: main)")
    parser.add_argument("--gguf-file", default=None, help="the .gguf file to load from a hub repository or a directory")


def add_engine_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The knobs of ``LLM(...)`` (``--dtype`` is the model's in every verb); the group, for a
    verb's own deprecated spellings of them."""
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="auto",
                       help="model dtype: auto | float32 | bfloat16 | float16 (default: auto)")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt plus output, in tokens (default: the model's, capped by the KV cache)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch at most (default: 256)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens in one step at most; longer prefills are chunked (default: 8192 on a GPU; on a "
                            "CPU sized by the model so a step takes well under a second, 256 for SmolLM2-135M)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory for weights, activations and the KV cache (default: 0.9)")
    group.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens (default: sized "
                       "by a memory profile on GPU, 1 GiB on CPU)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="do not reuse the KV cache of shared prompt prefixes")
    group.add_argument("--activation-store-bytes", type=int, default=0,
                       help="host memory for captured prompt rows of whole KV blocks, served to later captures "
                            "on a prefix-cache hit instead of recomputed (default: 0, no store); docs/capture.md")
    group.add_argument("--enforce-eager", action="store_true", help="never replay CUDA graphs")
    group.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling (default: 0)")
    group.add_argument("--cpu-threads", type=int, default=None,
                       help="intra-op threads of a CPU engine (default: the cores free at start)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="ranks that split every layer's weights (default: 1); docs/parallel.md")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="pipeline stages, each holding a range of layers (default: 1)")
    return group


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments from the parsed flags, validated (CliError) without loading."""
    kwargs = dict(model=args.model, revision=args.revision, gguf_file=args.gguf_file, dtype=args.dtype,
                  device=args.device, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                  kv_cache_tokens=args.kv_cache_tokens, enable_prefix_caching=args.enable_prefix_caching,
                  enforce_eager=args.enforce_eager, seed=args.seed, cpu_threads=args.cpu_threads,
                  activation_store_bytes=args.activation_store_bytes,
                  tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size)
    from steerable.config import EngineConfig  # imports torch: only once the arguments are parsed

    try:
        EngineConfig(**kwargs).validate()
    except ValueError as err:
        raise CliError(str(err)) from None
    return kwargs


def run_checked(func: Any, args: argparse.Namespace) -> int:
    """Run a verb; ``CliError`` and a ``ValueError`` from the engine print one line, status 2."""
    try:
        return func(args)
    except (CliError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def index_list(text: str, what: str = "layers") -> list[int]:
    """``"4,8,12"``, ``"8-20"`` (inclusive) or a mix such as ``"2,4-6"`` -> sorted indices."""
    indices: set[int] = set()
    try:
        for part in text.split(","):
            start, sep, end = part.strip().partition("-")
            indices.update(range(int(start), int(end) + 1) if sep else [int(start)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} like 4,8,12 or 8-20, got {text!r}") from None
    if not indices:
        raise argparse.ArgumentTypeError(f"no {what} in {text!r}")
    return sorted(indices)


def layer_list(text: str) -> list[int]:
    return index_list(text, "layers")


def read_texts(path: str, field: str) -> list[str]:
    """The non-empty string ``field`` of every record of a JSON-lines file (CliError otherwise)."""
    from steerable.files import read_jsonl

    texts = []
    for i, record in enumerate(read_jsonl(path)):
        if not isinstance(record, dict) or not isinstance(record.get(field), str) or not record[field]:
            raise CliError(f"{path}: record {i} has no non-empty string field {field!r}")
        texts.append(record[field])
    if not texts:
        raise CliError(f"{path}: no texts")
    return texts


def number_list(text: str) -> list[float]:
    """``"-2,-1,0,1,2"`` -> floats."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_control_vector_args(parser: argparse.ArgumentParser) -> None:
    """llama.cpp's flags: control vectors summed per layer, applied to every request."""
    group = parser.add_argument_group("control vectors")
    group.add_argument("--control-vector", action="append", metavar="FILE[:SCALE]",
                       help="a control vector (.gguf or .safetensors) times SCALE (default 1) added to every token; "
                            "repeat to sum several per layer, as llama.cpp does")
    group.add_argument("--control-vector-layer-range", nargs=2, type=int, metavar=("START", "END"),
                       help="steer only layers START..END (inclusive) of the summed vector")


def control_vector(args: argparse.Namespace) -> Any:
    """The summed ControlVector of ``--control-vector`` flags (None without any), read and checked
    before the model loads; ``check_model`` against the loaded model follows."""
    if not args.control_vector:
        if args.control_vector_layer_range:
            raise CliError("--control-vector-layer-range needs at least one --control-vector")
        return None
    from steerable.vectors import combine_control_vectors
    return combine_control_vectors(args.control_vector, args.control_vector_layer_range)


def sae_file(text: str) -> tuple[str, int | None, str | None]:
    """``PATH[:LAYER[:HOOK]]`` -> (path, layer, hook): the arguments of ``SAE.load``."""
    from steerable.hook_points import HOOK_POINTS

    parts = text.split(":")
    hook = parts.pop() if len(parts) > 1 and parts[-1] in HOOK_POINTS else None
    layer = int(parts.pop()) if len(parts) > 1 and parts[-1].isdecimal() else None
    if hook is not None and layer is None:
        raise argparse.ArgumentTypeError(f"expected PATH[:LAYER[:HOOK]], got {text!r} (a hook needs its layer)")
    path = ":".join(parts)
    if not path:
        raise argparse.ArgumentTypeError(f"expected PATH[:LAYER[:HOOK]], got {text!r}")
    return path, layer, hook


def named_sae_file(text: str) -> tuple[str, tuple[str, int | None, str | None]]:
    """``NAME=PATH[:LAYER[:HOOK]]`` -> (name, (path, layer, hook))."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH[:LAYER[:HOOK]], got {text!r}")
    return name, sae_file(rest)


def load_sae(spec: tuple[str, int | None, str | None], flag: str) -> Any:
    """The SAE or transcoder of a parsed ``sae_file``; a bad file is a ``CliError`` naming ``flag``."""
    from steerable.sae.transcoder_files import load_dictionary

    try:
        return load_dictionary(*spec)
    except (ValueError, OSError) as err:
        raise CliError(f"{flag}: {err}") from None
