"""Corpus capture: a corpus -> activations on disk, resumable, on one engine, on R replica processes
(``replicas=R``) or on a Ray cluster (``ray=ADDRESS``), in one of three formats:

- ``steerable`` (default): ``OUT/shard-00000.safetensors`` holds examples ``[0, shard_size)``,
  the next shard the next ``shard_size`` and so on; in each, ``layer.L`` is ``Tensor[rows, width]``
  at layer L and the label tensors ``example`` (index into the corpus), ``position`` and
  ``token_id`` (int64) say what each row is. With an SAE (``sae=``) a shard holds its features
  instead: ``indices`` (int32) and ``values`` (float32), both ``[rows, top_k]``, and the same labels.
- ``saelens``: texts packed into windows of ``context_size`` tokens as SAELens packs them
  (``windows.py``), every position captured, written as SAELens' activation cache, a Hugging Face
  ``datasets`` directory (``formats/saelens.py``).
- ``delphi``: an SAE's latents on such windows as delphi's latent cache (``formats/delphi.py``).

``index.json`` (for delphi inside ``OUT/<hookpoint>/.steerable``) records the settings (model,
layers, hook, select, dtype, shard size, corpus hash) and every finished shard with its example
range and row count. A shard is filled under a temporary name and renamed, then listed in the index
(itself replaced atomically), so a run killed at any point resumes (``resume=True``) by
recomputing only the shards the index does not list; the result is the same as an uninterrupted
run, and the same whether one engine or many wrote it (each shard is whole work of one engine).

Speed: the rows go through one capture stream whose sink places them in their shard's storage
(``corpus_run.py``) on the capture session's sink thread while the engine runs the next steps: the
pages of steerable's shard files themselves, or a SAELens shard's buffer, which a background thread
then writes as an Arrow file. The engine gets the examples without a pause between shards.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from steerable.capture.corpus_plan import (
    INDEX,
    ModelInfo,
    Plan,
    RunIndex,
    make_plan,
    model_info,
)
from steerable.capture.corpus_run import DELPHI, SAELENS, SHARDS_FORMAT, capture_shards
from steerable.capture.formats import delphi, saelens
from steerable.errors import InvalidRequestError
from steerable.hook_points import POST_MLP, transformer_lens_name

__all__ = ["capture_corpus", "INDEX", "FORMAT"]

FORMAT = SHARDS_FORMAT


def capture_corpus(llm: Any, texts: Sequence[str | list[int]], out: str | os.PathLike,
                   layers: Sequence[int] | None = None, hook: str = POST_MLP, select: Any = None,
                   dtype: str | None = None, shard_size: int | None = None, batch_size: int = 256,
                   resume: bool = False, model: str | None = None, use_tqdm: bool = False, sae: Any = None,
                   top_k: int | None = None, format: str = "steerable", context_size: int | None = None,
                   replicas: int = 1, ray: str | None = None, hookpoint: str | None = None,
                   n_splits: int = delphi.DEFAULT_SPLITS, source: str = "") -> dict[str, Any]:
    """Capture ``hook`` at ``layers`` (default: all) on the rows ``select`` picks (default:
    ``last_prompt``; ``all`` for the window formats), for every text, into shards under ``out`` (a
    path, or an fsspec URL); returns the index. ``llm``: an ``LLM``, or the keyword arguments of
    ``LLM(...)`` as a dict (then no engine is built here unless it runs the shards itself).

    ``resume=True`` continues a run with the same settings (anything else differing fails naming
    it); without it, ``out`` must hold no capture. ``batch_size`` examples are in an engine at a
    time (on a GPU at least twice a step's, so the next step is built while the device runs one);
    records through the ``hidden_states`` stream (``sae_features`` with an SAE), which must not be
    running. ``sae``: a registered SAE's name (or an ``SAE``): store its ``top_k`` highest
    features per row at its own point (``layers``, ``hook`` and ``dtype`` do not apply).

    ``format="saelens"`` / ``"delphi"`` with ``context_size=N``: see the module docstring;
    ``hookpoint`` names delphi's directory (default: the SAE's TransformerLens hook name),
    ``n_splits`` its latent ranges, ``source`` the corpus recorded in its config. ``replicas=R``:
    R engine processes (one per GPU; on CPU each with its share of the cores), each taking whole
    shards; ``ray``: ``"local"``, ``"auto"`` or a cluster address, one engine actor per GPU."""
    from steerable.entrypoints.llm import LLM

    info = model_info(llm, model)
    sae_pair = _sae(info, sae)
    plan = make_plan(info, texts, out, format, layers, hook, select, dtype, shard_size, batch_size, context_size,
                     sae_pair, top_k, hookpoint, n_splits, source)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise InvalidRequestError(f"replicas: must be an integer >= 1, got {replicas!r}")
    in_process = replicas == 1 and ray is None
    if ray is not None:
        from steerable.ray.corpus import check_ray

        ray = check_ray(ray)  # installed, reachable: answered before any file is written
    if in_process and info.engine is not None and info.engine.capture_status(plan.spec.stream)["enabled"]:
        raise InvalidRequestError(f"capture_corpus: the {plan.spec.stream} capture stream is running; stop it first "
                                  "(corpus capture records through that stream)")
    with tqdm(total=len(plan.examples), desc="Capturing", unit="window" if format != "steerable" else "example",
              disable=not use_tqdm) as bar:
        index = RunIndex(plan, resume, on_commit=None if in_process else
                         lambda entry: bar.update(entry["stop"] - entry["start"]))
        bar.update(sum(e["stop"] - e["start"] for e in index.index["shards"]))
        todo = index.todo()
        stats: dict[str, Any] = {}
        if todo and in_process:
            owned = info.engine is None
            llm_obj = LLM(**info.engine_config) if owned else llm
            ours = sae_pair is not None and not isinstance(sae, str)  # an SAE object: registered for the run
            try:
                if ours:
                    llm_obj.register_sae(*sae_pair)
                tasks = (plan.task(k) for k in todo)
                stats = vars(capture_shards(llm_obj.llm_engine, plan.spec, tasks, index.commit,
                                            on_example=lambda: bar.update(1)))
            finally:
                if owned:
                    llm_obj.shutdown()
                elif ours:
                    llm_obj.unregister_sae(sae_pair[0])
        elif todo and ray is not None:
            from steerable.ray.corpus import capture_on_ray

            stats = capture_on_ray(ray, plan, todo, info.engine_config, sae_pair, replicas, index.commit)
        elif todo:
            from steerable.capture.replicas import capture_on_replicas

            stats = capture_on_replicas(plan, todo, info.engine_config, sae_pair, replicas, index.commit)
    if not index.index["complete"]:
        _finish(plan, index, info, sae_pair)
    return {**index.index, "stats": stats}


def _sae(info: ModelInfo, sae: Any) -> tuple[str, Any] | None:
    """(name, SAE) of the ``sae`` argument: a registered name, or an SAE object."""
    if sae is None:
        return None
    if isinstance(sae, str):
        if info.engine is None:
            raise InvalidRequestError("sae: name an SAE registered on an LLM, or pass the SAE itself")
        return sae, info.engine.saes.get(sae, "sae")
    from steerable.sae import SAE, Transcoder

    if not isinstance(sae, (SAE, Transcoder)):
        raise InvalidRequestError(f"sae: expected a registered SAE's name, an SAE or a transcoder, got "
                                  f"{type(sae).__name__}")
    return "corpus-sae", sae


def _finish(plan: Plan, index: RunIndex, info: ModelInfo, sae: tuple[str, Any] | None) -> None:
    """Whatever the format writes once every shard is in, then the index marked complete."""
    spec, settings = plan.spec, plan.settings
    files = [entry["file"] for entry in index.index["shards"]]
    if len(files) != plan.num_shards:
        raise RuntimeError(f"capture_corpus: {plan.num_shards - len(files)} shard(s) missing after the run")
    if spec.format == SAELENS:
        columns = [transformer_lens_name(layer, spec.hook) for layer in spec.layers]
        description = (f"Activations of {info.name} at {', '.join(columns)}, windows of {spec.context_size} "
                       f"tokens, captured by steerable.")
        saelens.finish_dataset(plan.target, files, columns, spec.context_size, info.hidden_size, spec.dtype,
                               {k: v for k, v in settings.items() if k != "shard_size"}, description)
    elif spec.format == DELPHI:
        _, model = sae
        config = delphi.cache_config(info.name, spec.context_size, len(plan.examples), settings["n_splits"],
                                     spec.batch_size, settings["source"], "text")
        delphi.finish_cache(plan.run_dir, plan.target, index.index["shards"], model.d_sae, settings["n_splits"],
                            config, spec.top_k, model.k)
        for name in files:
            plan.run_dir.remove(name)
    index.complete()

