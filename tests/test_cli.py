"""The ``steerable`` command's shape, the same in every verb: every option says what it does, MODEL
is positional or ``--model``, ``--dtype`` is the model's dtype (``capture`` stores with
``--capture-dtype``; its old ``--model-dtype`` still works, with a warning). Parsing only: no model
is loaded, except in the one end-to-end capture."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import PROMPTS
from safetensors.torch import load_file

from steerable.entrypoints.cli import build_parser, main
from steerable.entrypoints.cli.common import engine_kwargs
from steerable.models.demo import DEFAULT_MODEL

MODEL_VERBS = [["generate"], ["serve"], ["capture", "--input", "t.jsonl", "--out", "o"],
               ["vectors", "train", "--pairs", "p.jsonl", "--out", "v.gguf"],
               ["vectors", "eval", "--vector", "v.gguf", "--items", "i.jsonl"], ["demo"]]


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("steerable",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_option_of_every_verb_has_help():
    seen = 0
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            seen += 1
            assert action.help and action.help.strip(), f"{' '.join(path)} {action.option_strings or action.dest}"
    assert seen > 100  # the walk reached every verb's options


@pytest.mark.parametrize("verb", MODEL_VERBS, ids=lambda v: " ".join(v[:2]))
def test_model_is_positional_or_an_option_in_every_verb(verb):
    head, rest = verb[:2] if verb[0] == "vectors" else verb[:1], verb[2:] if verb[0] == "vectors" else verb[1:]
    parse = build_parser().parse_args
    assert parse([*head, "org/tiny", *rest]).model == "org/tiny"
    assert parse([*head, *rest, "--model", "org/tiny"]).model == "org/tiny"
    assert parse([*head, "org/tiny", *rest, "--model", "org/tiny"]).model == "org/tiny"  # the same twice is fine
    assert parse([*head, *rest]).model == DEFAULT_MODEL


def test_two_different_models_are_an_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "org/a", "--model", "org/b"])
    assert exit_.value.code == 2 and "given twice: 'org/a' and 'org/b'" in capsys.readouterr().err


@pytest.mark.parametrize("verb", MODEL_VERBS, ids=lambda v: " ".join(v[:2]))
def test_dtype_is_the_models_in_every_verb(verb):
    args = build_parser().parse_args([*verb, "--dtype", "bfloat16"])
    assert engine_kwargs(args)["dtype"] == "bfloat16"


def test_capture_stores_with_capture_dtype_and_keeps_the_old_model_dtype_spelling(capsys):
    parse = build_parser().parse_args
    args = parse(["capture", "org/tiny", "--input", "t", "--out", "o", "--dtype", "float32", "--capture-dtype",
                  "bfloat16"])
    assert (args.dtype, args.capture_dtype) == ("float32", "bfloat16")
    assert capsys.readouterr().err == ""
    old = parse(["capture", "org/tiny", "--input", "t", "--out", "o", "--model-dtype", "float16"])
    assert old.dtype == "float16" and old.capture_dtype is None
    assert "--model-dtype is deprecated; use --dtype" in capsys.readouterr().err


def test_capture_with_a_positional_model_end_to_end(capture_dirs, tmp_path, capsys):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS[:3]))
    assert main(["capture", capture_dirs["llama"], "--input", str(texts), "--layers", "1", "--device", "cpu",
                 "--kv-cache-tokens", "1024", "--dtype", "float32", "--capture-dtype", "bfloat16",
                 "--out", str(tmp_path / "acts")]) == 0
    index = json.loads((tmp_path / "acts" / "index.json").read_text())
    assert index["model"] == capture_dirs["llama"] and index["dtype"] == "bfloat16"
    shard = load_file(str(tmp_path / "acts" / "shard-00000.safetensors"))
    assert shard["layer.1"].dtype.is_floating_point and str(shard["layer.1"].dtype) == "torch.bfloat16"
    assert main(["capture", capture_dirs["llama"], "--input", str(texts), "--capture-dtype", "int8",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "--capture-dtype" in capsys.readouterr().err
