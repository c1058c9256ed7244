"""Corpus capture: a list of texts -> labelled activations in sharded safetensors, resumable.

``OUT/shard-00000.safetensors`` holds examples ``[0, shard_size)``, the next shard the next
``shard_size`` and so on; in each, ``layer.L`` is ``Tensor[rows, width]`` at layer L and the label
tensors ``example`` (index into the corpus), ``position`` and ``token_id`` (int64) say what each row
is. ``OUT/index.json`` records the settings (model, layers, hook, select, dtype, shard size, corpus
hash) and every finished shard with its example range and row count. A shard is written to a temp
file and renamed, then listed in the index (itself replaced atomically), so a run killed at any
point resumes (``resume=True``) by recomputing only the shards the index does not list; the result
is the same as an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from steerable.capture.api import capture
from steerable.capture.session import HIDDEN_STATES
from steerable.capture.store import resolve_storage_dtype
from steerable.errors import InvalidRequestError
from steerable.hook_points import POST_MLP, RESIDUAL_POINTS
from steerable.selection import SelectSpec

FORMAT = "steerable-corpus-v1"
INDEX = "index.json"
LABELS = ("example", "position", "token_id")


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def capture_corpus(llm: Any, texts: Sequence[str | list[int]], out: str | os.PathLike,
                   layers: Sequence[int] | None = None, hook: str = POST_MLP, select: Any = "last_prompt",
                   dtype: str | None = None, shard_size: int = 1000, batch_size: int = 64, resume: bool = False,
                   model: str | None = None, use_tqdm: bool = False) -> dict[str, Any]:
    """Capture ``hook`` at ``layers`` (default: all) on the rows ``select`` picks, for every text,
    into shards under ``out``; returns the index. ``resume=True`` continues a run with the same
    settings (anything else differing fails naming it); without it, ``out`` must hold no capture."""
    cfg = llm.llm_engine.model_config
    settings = _settings(texts, cfg.num_layers, layers, hook, select, dtype, shard_size, batch_size,
                         model or llm.llm_engine.config.model)
    out = Path(out)
    index = _open_index(out, settings, resume)
    done = {entry["shard"] for entry in index["shards"] if (out / entry["file"]).exists()}
    index["shards"] = [entry for entry in index["shards"] if entry["shard"] in done]
    num_shards = -(-len(texts) // shard_size)
    finished = sum(entry["stop"] - entry["start"] for entry in index["shards"])
    start_time, rows_written = time.perf_counter(), 0
    with tqdm(total=len(texts), initial=finished, desc="Capturing", unit="example", disable=not use_tqdm) as bar:
        for k in range(num_shards):
            if k in done:
                continue
            lo, hi = k * shard_size, min((k + 1) * shard_size, len(texts))
            tensors = _capture_shard(llm, texts, lo, hi, settings, batch_size, bar)
            rows = int(tensors["example"].numel())
            _write_atomic(out / shard_name(k), lambda path: save_file(tensors, path, metadata={"format": FORMAT}))
            index["shards"].append({"shard": k, "file": shard_name(k), "start": lo, "stop": hi, "rows": rows})
            index["shards"].sort(key=lambda entry: entry["shard"])
            _write_index(out, index)
            rows_written += rows
            bar.set_postfix(rows_per_s=f"{rows_written / (time.perf_counter() - start_time):.0f}")
    index["complete"] = True
    _write_index(out, index)
    return index


def _settings(texts: Sequence[Any], num_layers: int, layers: Sequence[int] | None, hook: str, select: Any,
              dtype: str | None, shard_size: int, batch_size: int, model: str) -> dict[str, Any]:
    """Every argument checked before any work; the settings a resumed run must match."""
    if isinstance(texts, str) or not texts:
        raise InvalidRequestError("texts: expected a non-empty list of prompts")
    layer_list = list(range(num_layers)) if layers is None else sorted(set(layers))
    bad = [layer for layer in layer_list if not isinstance(layer, int) or not 0 <= layer < num_layers]
    if bad or not layer_list:
        raise InvalidRequestError(f"layers: {bad or 'none'} not layer indices in [0, {num_layers})")
    if hook not in RESIDUAL_POINTS:
        raise InvalidRequestError(f"hook: unknown hook {hook!r}; expected one of {list(RESIDUAL_POINTS)}")
    resolve_storage_dtype(dtype, "dtype")
    for name, value in (("shard_size", shard_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name}: must be an integer >= 1, got {value!r}")
    digest = hashlib.sha256(json.dumps(list(texts), ensure_ascii=False).encode()).hexdigest()
    return {"format": FORMAT, "model": model, "layers": layer_list, "hook": hook,
            "select": SelectSpec.parse(select).to_wire(), "dtype": dtype, "shard_size": shard_size,
            "num_examples": len(texts), "corpus_sha256": digest}


def _open_index(out: Path, settings: dict[str, Any], resume: bool) -> dict[str, Any]:
    path = out / INDEX
    if path.exists():
        if not resume:
            raise InvalidRequestError(f"out: {out} already holds a corpus capture; resume it (--resume) or choose "
                                      "another directory")
        index = json.loads(path.read_text())
        for key, value in settings.items():
            if index.get(key) != value:
                raise InvalidRequestError(f"resume: {key} differs from the interrupted run ({index.get(key)!r} there, "
                                          f"{value!r} now)")
        for stale in out.glob(".shard-*.part"):  # a shard being written when the run was killed
            stale.unlink()
        return index
    out.mkdir(parents=True, exist_ok=True)
    index = {**settings, "complete": False, "shards": []}
    _write_index(out, index)
    return index


def _capture_shard(llm: Any, texts: Sequence[Any], lo: int, hi: int, settings: dict[str, Any], batch_size: int,
                   bar: tqdm) -> dict[str, torch.Tensor]:
    """One shard's tensors: rows of every example in [lo, hi), in example then position order."""
    per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in settings["layers"]}
    labels: dict[str, list[torch.Tensor]] = {name: [] for name in LABELS}
    first = settings["layers"][0]
    for start in range(lo, hi, batch_size):
        batch = list(texts[start:min(start + batch_size, hi)])
        result = capture(llm, batch, layers=settings["layers"], stream=HIDDEN_STATES,
                         select=SelectSpec.from_wire(settings["select"]), hook=settings["hook"],
                         dtype=settings["dtype"])
        for i in range(len(result)):
            sample = result.sample(i)
            for layer in settings["layers"]:
                per_layer[layer].append(sample[layer])
            meta = result.outputs[i].capture_meta[HIDDEN_STATES][first]
            labels["example"].append(torch.full((len(meta),), start + i, dtype=torch.int64))
            labels["position"].append(meta.positions.to(torch.int64))
            labels["token_id"].append(meta.token_ids.to(torch.int64))
        bar.update(len(batch))
    tensors = {f"layer.{layer}": torch.cat(rows).contiguous() for layer, rows in per_layer.items()}
    tensors.update({name: torch.cat(parts) for name, parts in labels.items()})
    return tensors


def _write_index(out: Path, index: dict[str, Any]) -> None:
    _write_atomic(out / INDEX, lambda path: Path(path).write_text(json.dumps(index, indent=1)))


def _write_atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename over ``path``: a reader (or a resumed run) never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=".shard-", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
