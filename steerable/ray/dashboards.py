"""Feature dashboards on Ray: the corpus's shards run on replicas (an actor each, one engine per
actor, on a GPU of its own where the cluster has GPUs), and each shard's ``DashboardState`` comes
back and merges into the run's as it arrives. The merge is exact (``steerable.sae.dashboards``), so
the result equals one process's whatever the number of replicas or the order shards finish in;
with ``out`` every merged shard is checkpointed, and ``resume=True`` continues a killed run.
States travel as safetensors bytes (nothing is pickled but the plan and the corpus).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from tqdm.auto import tqdm

from steerable.entrypoints.llm import LLM
from steerable.errors import InvalidRequestError
from steerable.sae import SAE
from steerable.sae.dashboards import files
from steerable.sae.dashboards.driver import DashboardRun, empty_state, logits, plan, run_shards
from steerable.sae.dashboards.logits import LogitTables
from steerable.sae.dashboards.result import FeatureDashboards
from steerable.sae.dashboards.state import DashboardState


class _Replica:
    """One engine with the SAE registered, the corpus, and the shards it is handed."""

    def __init__(self, model: str, engine_kwargs: Mapping[str, Any], sae: str, sae_file: tuple[str, Any, Any]):
        self.llm = LLM(model, **dict(engine_kwargs))
        self.llm.register_sae(sae, SAE.load(*sae_file))
        self.texts: Sequence[Any] = ()

    def plan(self, texts: Sequence[Any], sae: str, options: Mapping[str, Any]) -> DashboardRun:
        self.texts = texts
        return plan(self.llm, texts, sae, **options)

    def shard(self, run: DashboardRun, k: int) -> bytes:
        return run_shards(self.llm, self.texts, run, empty_state(run), [k]).to_bytes()

    def finish(self, run: DashboardRun) -> tuple[bytes, list[str]]:
        """The logit tables, and every token id's text (the driver has no tokenizer)."""
        tables, vocab_size = logits(self.llm, run)
        tokenizer = self.llm.get_tokenizer()
        vocab = [tokenizer.decode([t]) if tokenizer is not None else f"<{t}>" for t in range(vocab_size)]
        return tables.to_bytes(), vocab


def feature_dashboards_on_ray(model: str, texts: Sequence[str | Sequence[int]], sae: str | tuple[str, Any, Any], *,
                              replicas: int = 1, engine_kwargs: Mapping[str, Any] | None = None,
                              sae_name: str = "sae", num_gpus: float | None = None,
                              out: str | os.PathLike | None = None, resume: bool = False, use_tqdm: bool = False,
                              export: dict[str, Any] | None = None, **options: Any) -> FeatureDashboards:
    """``feature_dashboards`` of the SAE at ``sae`` (a path, or ``(path, layer, hook)`` as
    ``SAE.load`` takes them) over ``texts``, its shards on ``replicas`` actors, each building
    ``LLM(model, **engine_kwargs)``; ``num_gpus`` per replica (default: 1 where the cluster has
    GPUs, else 0). ``options``: ``feature_dashboards``' parameters (``shard_size`` sets the shard:
    the unit of work handed out and checkpointed). Without a Ray session this starts one
    (``ray.init()``: a local cluster, or the one ``$RAY_ADDRESS`` names)."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise InvalidRequestError(f"replicas: must be an integer >= 1, got {replicas!r}")
    sae_file = (sae, None, None) if isinstance(sae, str) else tuple(sae)
    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    if num_gpus is None:
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    actor = ray.remote(num_gpus=num_gpus)(_Replica)
    actors = [actor.remote(model, dict(engine_kwargs or {}), sae_name, sae_file) for _ in range(replicas)]
    try:
        corpus = ray.put(list(texts))
        runs = _get([a.plan.remote(corpus, sae_name, {**options, "model": model}) for a in actors])
        run = runs[0]
        state, done = None, []
        if out is not None:
            finished, state, done = files.open_run(Path(out), run.settings, run.shard_size, resume)
            if finished:
                return FeatureDashboards.load(out)
        state = state if state is not None else empty_state(run)
        todo = [k for k in range(run.num_shards) if k not in set(done)]
        _run_shards(actors, run, state, todo, done, out, use_tqdm)
        table_bytes, vocab = _get([actors[0].finish.remote(run)])[0]
    finally:
        for a in actors:
            ray.kill(a)
    result = FeatureDashboards(run.settings, state, LogitTables.from_bytes(table_bytes), vocab.__getitem__, len(vocab))
    if out is not None:
        result.save(out, **(export or {}))
    return result


def _run_shards(actors: list[Any], run: DashboardRun, state: DashboardState, todo: list[int], done: list[int],
                out: str | os.PathLike | None, use_tqdm: bool) -> None:
    """Hand shards to idle replicas and merge what comes back, checkpointing after each."""
    waiting = list(reversed(todo))
    busy: dict[Any, tuple[Any, int]] = {}
    with tqdm(desc="Dashboards", unit="tok", unit_scale=True, disable=not use_tqdm) as bar:
        for a in actors[:len(waiting)]:
            k = waiting.pop()
            busy[a.shard.remote(run, k)] = (a, k)
        while busy:
            (ready,), _ = ray.wait(list(busy), num_returns=1)
            a, k = busy.pop(ready)
            partial = DashboardState.from_bytes(_get([ready])[0])
            state.merge(partial)
            done.append(k)
            bar.update(partial.dense.tokens)
            bar.total = round(bar.n / len(done) * (len(done) + len(waiting) + len(busy)))
            if out is not None:
                files.checkpoint(Path(out), run.settings, run.shard_size, sorted(done), state)
            if waiting:
                k = waiting.pop()
                busy[a.shard.remote(run, k)] = (a, k)


def _get(refs: list[Any]) -> list[Any]:
    """``ray.get``, a replica's bad-input error raised as itself (naming its field)."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, InvalidRequestError):
            raise InvalidRequestError(str(err.cause)) from None
        raise
