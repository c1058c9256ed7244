"""A dashboards directory. Finished, it holds ``dashboards.json`` (the settings, ``complete``),
``state.safetensors`` (statistics, example lists and logit tables), ``vocab.json`` (each token id's
text) and the Neuronpedia export ``batch-N.json``. While a resumable run is going it holds the
settings, the shards finished and the state after them (``state-NNNNN.safetensors``, written
before the index names it, so a run killed at any moment resumes from a consistent pair).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file

from steerable.errors import InvalidRequestError
from steerable.files import create_part, write_safetensors
from steerable.sae.dashboards.export import neuronpedia_batches
from steerable.sae.dashboards.logits import LogitTables
from steerable.sae.dashboards.settings import DashboardSettings
from steerable.sae.dashboards.state import DashboardState
from steerable.sae.files import _read_config

if TYPE_CHECKING:  # the result module reads and writes through this one
    from steerable.sae.dashboards.result import FeatureDashboards

INDEX = "dashboards.json"
STATE = "state.safetensors"
VOCAB = "vocab.json"


def _write_atomic(path: Path, write: Any) -> None:
    """``write(tmp_path)`` then rename over ``path``: readers see the old file or the new one."""
    tmp = create_part(path.parent, f".{path.name}-")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_json(path: Path, data: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, ensure_ascii=False)
    _write_atomic(path, write)


def read_index(out: Path) -> dict[str, Any] | None:
    path = out / INDEX
    return _read_config(path) if path.exists() else None


# ---------------------------------------------------------------- resumable runs

def open_run(out: Path, settings: DashboardSettings, shard_size: int, resume: bool
             ) -> tuple[bool, DashboardState | None, list[int]]:
    """``(finished, state, shards done)`` of the run in ``out``: a new one, an interrupted one
    (with ``resume``) or a finished one (with ``resume``; nothing left to do)."""
    index = read_index(out)
    if index is None:
        out.mkdir(parents=True, exist_ok=True)
        return False, None, []
    if not resume:
        raise InvalidRequestError(f"out: {out} already holds dashboards; resume them (resume=True, --resume) or "
                                  "choose another directory")
    DashboardSettings.from_json(index.get("settings"), str(out / INDEX)).check_same(settings, "resume")
    if index.get("complete"):
        return True, None, []
    if index.get("shard_size") != shard_size:
        raise InvalidRequestError(f"resume: shard_size differs ({index.get('shard_size')!r} there, {shard_size!r} now)")
    return False, DashboardState.load(str(out / index["state"])), list(index["shards_done"])


def checkpoint(out: Path, settings: DashboardSettings, shard_size: int, done: list[int],
               state: DashboardState) -> None:
    """Record ``state`` as the result of shards ``done``; the previous checkpoint's file goes after."""
    previous = (read_index(out) or {}).get("state")
    name = f"state-{len(done):05d}.safetensors"
    _write_atomic(out / name, state.save)
    _write_json(out / INDEX, {"settings": settings.to_json(), "shard_size": shard_size, "shards_done": done,
                              "state": name, "complete": False})
    if previous and previous != name:
        (out / previous).unlink(missing_ok=True)


# ---------------------------------------------------------------- finished dashboards

def save(dash: "FeatureDashboards", out: str | os.PathLike, batch_features: int = 128, model_id: str = "",
         sae_set: str = "", dataset: str = "") -> list[str]:
    """Write ``dash`` as a finished directory; returns the export's file names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if batch_features < 1:
        raise InvalidRequestError(f"batch_features: must be >= 1, got {batch_features!r}")
    previous = read_index(out) or {}
    tensors = {**dash.state.tensors(), **dash.logits.state_dict()}
    _write_atomic(out / STATE, lambda tmp: write_safetensors({k: t.contiguous() for k, t in tensors.items()}, tmp))
    _write_json(out / VOCAB, [dash.token_str(t) for t in range(dash.vocab_size)])
    batches = []
    for k, batch in enumerate(neuronpedia_batches(dash, batch_features, model_id, sae_set, dataset)):
        batches.append(f"batch-{k}.json")
        _write_json(out / batches[-1], batch)
    _write_json(out / INDEX, {"settings": dash.settings.to_json(), "complete": True, "state": STATE,
                              "vocab": VOCAB, "batches": batches})
    stale = previous.get("state")
    if stale and stale != STATE:
        (out / stale).unlink(missing_ok=True)
    return batches


def load(out: str | os.PathLike) -> tuple[DashboardSettings, DashboardState, LogitTables, list[str]]:
    """A finished directory's settings, state, logit tables and vocabulary."""
    out = Path(out)
    index = read_index(out)
    if index is None:
        raise InvalidRequestError(f"dashboards: {out} holds no {INDEX}")
    if not index.get("complete"):
        raise InvalidRequestError(f"dashboards: {out} holds an unfinished run; resume it first")
    settings = DashboardSettings.from_json(index.get("settings"), str(out / INDEX))
    path = out / index["state"]
    state = DashboardState.load(str(path))
    try:
        logits = LogitTables.from_state_dict(load_file(str(path)))
        vocab = json.loads((out / index["vocab"]).read_text())
    except (OSError, KeyError, ValueError) as err:
        raise InvalidRequestError(f"dashboards: {out} is incomplete ({type(err).__name__}: {err})") from None
    return settings, state, logits, vocab
