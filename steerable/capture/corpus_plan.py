"""What a corpus capture will do, checked before any work: the model it runs on, the examples
(texts, or token windows for the ``saelens`` / ``delphi`` formats), the settings a resumed run must
match, and the run's index (``index.json``: settings plus every committed shard).

The index is the run's only record of progress and has one writer (``RunIndex.commit``, in the
process that drives the run): a shard is renamed into place first and listed after, and the index is
replaced whole, so a reader or a resumed run never sees half a shard or half an index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steerable.capture.corpus_run import (
    DELPHI,
    FORMATS,
    SAELENS,
    SHARDS_FORMAT,
    STEERABLE,
    ShardSpec,
)
from steerable.capture.formats import delphi, saelens
from steerable.capture.output_dir import OutputDir
from steerable.capture.shard_stores import ShardTask
from steerable.capture.store import resolve_storage_dtype
from steerable.capture.windows import corpus_windows
from steerable.checks import is_int
from steerable.errors import InvalidRequestError
from steerable.hook_points import check_hook_point, transformer_lens_name
from steerable.selection import SelectSpec

INDEX = "index.json"
DEFAULT_SHARD_EXAMPLES = 1000  # steerable's shards: texts per shard


@dataclass
class ModelInfo:
    """What the driver needs of the model; ``engine`` is None where only replicas run it."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_len: int
    dtype: torch.dtype
    tokenizer: Any
    engine_config: dict[str, Any]
    engine: Any = None


def model_info(llm: Any, model: str | None) -> ModelInfo:
    """From an ``LLM``, or from ``LLM(...)`` keyword arguments (a dict) without loading weights."""
    if isinstance(llm, dict):
        from steerable.config import EngineConfig
        from steerable.models.loader import (
            load_hf_config,
            load_tokenizer,
            resolve_model,
        )
        from steerable.models.registry import resolve_model_config

        config = EngineConfig(**llm)
        config.validate()
        source = resolve_model(config.model, config.revision, config.gguf_file)
        hf_config = load_hf_config(source)
        _, cfg = resolve_model_config(hf_config)
        max_len = min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings)
        return ModelInfo(model or config.model, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, max_len,
                         config.resolve_dtype(hf_config, config.resolve_device()), load_tokenizer(source),
                         dataclasses.asdict(config))
    engine = llm.llm_engine
    cfg = engine.model_config
    return ModelInfo(model or engine.config.model, cfg.num_layers, cfg.hidden_size, cfg.vocab_size,
                     engine.max_model_len, engine.dtype, engine.tokenizer.hf, dataclasses.asdict(engine.config), engine)


@dataclass
class Plan:
    spec: ShardSpec
    settings: dict[str, Any]
    examples: Sequence[Any]  # texts or token-id prompts (steerable), or windows [W, N]
    shard_size: int
    run_dir: OutputDir  # index and shards
    target: OutputDir  # where the finished format lives (delphi: the hookpoint directory)

    @property
    def num_shards(self) -> int:
        return -(-len(self.examples) // self.shard_size)

    def task(self, k: int) -> ShardTask:
        lo = k * self.shard_size
        return ShardTask(k, lo, self.examples[lo:lo + self.shard_size])


def _positive(name: str, value: Any, least: int = 1) -> None:
    if not is_int(value) or value < least:
        raise InvalidRequestError(f"{name}: must be an integer >= {least}, got {value!r}")


def make_plan(info: ModelInfo, texts: Sequence[Any], out: Any, fmt: str, layers: Sequence[int] | None, hook: str,
              select: Any, dtype: str | None, shard_size: int | None, batch_size: int, context_size: int | None,
              sae: tuple[str, Any] | None, top_k: int | None, hookpoint: str | None, n_splits: int,
              source: str) -> Plan:
    """Every argument checked (``InvalidRequestError`` naming it) and the corpus turned into examples."""
    if fmt not in FORMATS:
        raise InvalidRequestError(f"format: expected one of {list(FORMATS)}, got {fmt!r}")
    if isinstance(texts, str) or not len(texts):
        raise InvalidRequestError("texts: expected a non-empty list of prompts")
    _positive("batch_size", batch_size)
    if shard_size is not None:
        _positive("shard_size", shard_size)
    everything = SelectSpec.parse("all").to_wire()
    if fmt == STEERABLE:
        if context_size is not None:
            raise InvalidRequestError("context_size: only the saelens and delphi formats pack texts into windows")
        select = SelectSpec.parse("last_prompt" if select is None else select).to_wire()
    else:
        if select is not None and SelectSpec.parse(select).to_wire() != everything:
            raise InvalidRequestError(f"select: the {fmt} format captures every position of every window "
                                      f"(select 'all'), got {select!r}")
        select = everything
        if not is_int(context_size) or context_size < 2:
            raise InvalidRequestError(f"context_size: the {fmt} format needs an integer >= 2 (a window is BOS and at "
                                      f"least one token), got {context_size!r}")
        if context_size >= info.max_len:
            raise InvalidRequestError(f"context_size: {context_size} does not fit the model's context (max_model_len "
                                      f"{info.max_len} leaves room for windows of at most {info.max_len - 1} tokens)")
    if fmt == SAELENS and sae is not None:
        raise InvalidRequestError("sae: the saelens format stores hidden states; SAE features go to format 'delphi'")
    if fmt == DELPHI and sae is None:
        raise InvalidRequestError("sae: the delphi format stores an SAE's latents; pass --sae")
    settings: dict[str, Any] = {"format": SHARDS_FORMAT if fmt == STEERABLE else fmt, "model": info.name}
    if sae is not None:
        name, model = sae
        top_k = (model.k if model.architecture == "topk" and fmt == DELPHI else 64) if top_k is None else top_k
        if not is_int(top_k) or not 1 <= top_k <= model.d_sae:
            raise InvalidRequestError(f"top_k: must be an integer in [1, {model.d_sae}] (the SAE's d_sae), got {top_k!r}")
        layer_list, hook, dtype = list(getattr(model, "layers", [model.layer])), model.hook, None  # a transcoder: several
        settings.update(sae=name, sae_sha256=model.content_hash.hex(), top_k=top_k)
    else:
        layer_list = _layers(layers, info.num_layers, hook)
        resolve_storage_dtype(dtype, "dtype")
        if fmt == SAELENS:
            dtype = saelens.stored_dtype(dtype, info.dtype)
    if fmt == STEERABLE:
        examples: Sequence[Any] = texts
        digest = hashlib.sha256(json.dumps(list(texts), ensure_ascii=False).encode()).hexdigest()
        shard_size = shard_size or DEFAULT_SHARD_EXAMPLES
        settings.update(layers=layer_list, hook=hook, select=select, dtype=dtype, shard_size=shard_size)
    else:
        examples = corpus_windows(texts, context_size, info.tokenizer, info.vocab_size)
        digest = hashlib.sha256(examples.tobytes()).hexdigest()
        if fmt == SAELENS:
            per_window = saelens.window_bytes(len(layer_list), context_size, info.hidden_size, dtype)
        else:
            per_window = context_size * (8 * top_k + 24)
        most = max(1, saelens.MAX_FILE_BYTES // per_window)
        if shard_size is not None and shard_size > most:
            raise InvalidRequestError(f"shard_size: {shard_size} windows of {per_window} bytes exceed the 2 GB bound "
                                      f"of a file; at most {most}")
        shard_size = shard_size or max(1, min(most, saelens.DEFAULT_FILE_BYTES // per_window))
        settings.update(layers=layer_list, hook=hook, dtype=dtype, context_size=context_size, shard_size=shard_size)
    settings.update(num_examples=len(examples), corpus_sha256=digest)
    out_dir = OutputDir(out)
    run_dir = target = out_dir
    if fmt == DELPHI:
        _positive("n_splits", n_splits)
        hookpoint = hookpoint or transformer_lens_name(layer_list[0], hook)
        if not isinstance(hookpoint, str) or not hookpoint or "/" in hookpoint or hookpoint.startswith("."):
            raise InvalidRequestError(f"hookpoint: expected a directory name, got {hookpoint!r}")
        target = out_dir / hookpoint
        run_dir = target / delphi.RUN_DIR
        settings.update(hookpoint=hookpoint, n_splits=n_splits, source=source)
    num_shards = -(-len(examples) // shard_size)
    spec = ShardSpec(fmt, str(run_dir), tuple(layer_list), hook, select, dtype, batch_size, num_shards,
                     sae[0] if sae is not None else None, settings.get("top_k", 64), context_size)
    return Plan(spec, settings, examples, shard_size, run_dir, target)


def _layers(layers: Sequence[int] | None, num_layers: int, hook: str) -> list[int]:
    layer_list = list(range(num_layers)) if layers is None else sorted(set(layers))
    bad = [layer for layer in layer_list if not is_int(layer) or not 0 <= layer < num_layers]
    if bad or not layer_list:
        raise InvalidRequestError(f"layers: {bad or 'none'} not layer indices in [0, {num_layers})")
    check_hook_point(hook, "hook")
    return layer_list


class RunIndex:
    """The run's ``index.json``: opened (or resumed) before any work, then the one committer."""

    def __init__(self, plan: Plan, resume: bool, on_commit: Callable[[dict[str, Any]], None] | None = None):
        self.plan, self.on_commit = plan, on_commit
        self.lock = threading.Lock()
        run_dir, settings = plan.run_dir, plan.settings
        if run_dir.exists(INDEX):
            where = plan.target if plan.spec.format == DELPHI else run_dir
            if not resume:
                raise InvalidRequestError(f"out: {where} already holds a corpus capture; resume it (--resume) or choose "
                                          "another directory")
            index = run_dir.read_json(INDEX)
            if index.get("corpus_sha256") != settings["corpus_sha256"]:
                raise InvalidRequestError(f"resume: the corpus differs from the interrupted run's (sha256 "
                                          f"{str(index.get('corpus_sha256'))[:12]}... there, "
                                          f"{settings['corpus_sha256'][:12]}... now); resume with the same corpus "
                                          "or choose another directory")
            for key, value in settings.items():
                if index.get(key) != value:
                    raise InvalidRequestError(f"resume: {key} differs from the interrupted run ({index.get(key)!r} "
                                              f"there, {value!r} now)")
            run_dir.remove_parts()  # left by a killed run
            present = set(run_dir.listdir())
            index["shards"] = [entry for entry in index["shards"] if entry["file"] in present or index["complete"]]
        else:
            if plan.spec.format != STEERABLE and plan.target.listdir():
                raise InvalidRequestError(f"out: {plan.target} is not empty (it holds another run's or another tool's "
                                          "files); choose an empty or new directory")
            index = {**settings, "complete": False, "shards": []}
            run_dir.makedirs()
            self._write(index)
        self.index = index

    def todo(self) -> list[int]:
        done = {entry["shard"] for entry in self.index["shards"]}
        return [k for k in range(self.plan.num_shards) if k not in done]

    def commit(self, entry: dict[str, Any], part_name: str) -> None:
        """Rename a staged shard into place, then list it (thread-safe: writers commit from threads)."""
        with self.lock:
            self.plan.run_dir.commit(part_name, entry["file"])
            self.index["shards"].append(entry)
            self.index["shards"].sort(key=lambda e: e["shard"])
            self._write(self.index)
        if self.on_commit is not None:
            self.on_commit(entry)

    def complete(self) -> None:
        with self.lock:
            self.index["complete"] = True
            self._write(self.index)

    def _write(self, index: dict[str, Any]) -> None:
        self.plan.run_dir.write_json(INDEX, index, indent=1)
