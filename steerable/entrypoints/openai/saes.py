"""SAEs over HTTP: ``POST /v1/saes`` (admin) loads SAEs and transcoders from files on the server
and registers them, ``GET /v1/saes`` lists them, ``DELETE /v1/saes/{name}`` (admin) unregisters one. Loading
reads server-side paths, so only the admin key may ask for it; a user steers and captures with
the registered names. ``GET /v1/saes/{name}/features/{i}`` returns feature ``i``'s dashboard where
the server was started with dashboards of that SAE (``--dashboards``), and
``GET /v1/saes/{name}/features`` what they cover."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from steerable.entrypoints.openai.auth import require_admin, require_user
from steerable.entrypoints.openai.errors import APIError
from steerable.entrypoints.openai.state import server_state
from steerable.errors import InvalidRequestError

admin = APIRouter(dependencies=[Depends(require_admin)])
user = APIRouter(dependencies=[Depends(require_user)])

SAE_KEYS = ("path", "layer", "hook")


def parse_sae_entries(body: Any) -> dict[str, dict[str, Any]]:
    """``{"name": {"path", "layer"?, "hook"?}}`` checked (errors name the entry and key)."""
    if not isinstance(body, dict) or not body:
        raise InvalidRequestError('body: expected {"name": {"path": ..., "layer"?: ..., "hook"?: ...}}')
    for name, entry in body.items():
        where = f"saes[{name!r}]"
        if not isinstance(entry, dict):
            raise InvalidRequestError(f"{where}: expected an object with 'path' (and 'layer', 'hook')")
        unknown = sorted(set(entry) - set(SAE_KEYS))
        if unknown:
            raise InvalidRequestError(f"{where}.{unknown[0]}: unknown key; expected one of {list(SAE_KEYS)}")
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            raise InvalidRequestError(f"{where}.path: expected the path of the SAE's files on the server")
    return body


def load_saes(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every SAE (or transcoder) loaded before any is registered, so a bad file registers nothing."""
    from steerable.sae.transcoder_files import load_dictionary

    saes = {}
    for name, entry in entries.items():
        with _naming(name):
            saes[name] = load_dictionary(entry["path"], entry.get("layer"), entry.get("hook"))
    return saes


@contextlib.contextmanager
def _naming(name: str) -> Iterator[None]:
    """A refused entry's error names it first (the body may hold several)."""
    try:
        yield
    except ValueError as err:
        raise InvalidRequestError(f"saes[{name!r}]: {err}") from None


@admin.post("/v1/saes")
async def register_saes(body: dict[str, Any], request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    saes = await asyncio.to_thread(load_saes, parse_sae_entries(body))
    registered = []
    try:
        for name, sae in saes.items():
            with _naming(name):
                await llm.register_sae(name, sae)
            registered.append(name)
    except BaseException:
        for name in registered:  # all or nothing
            await llm.unregister_sae(name)
        raise
    return {"saes": await llm.list_saes()}


@user.get("/v1/saes")
async def list_saes(request: Request) -> dict[str, Any]:
    return {"saes": await server_state(request).llm.list_saes()}


@admin.delete("/v1/saes/{name}")
async def unregister_sae(name: str, request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    await llm.unregister_sae(name)
    return {"saes": await llm.list_saes()}


def _dashboards(request: Request, name: str) -> Any:
    dash = server_state(request).settings.dashboards.get(name)
    if dash is None:
        raise APIError(404, f"name: no dashboards were computed for SAE {name!r} (start the server with "
                            "--dashboards DIR)", "name")
    return dash


@user.get("/v1/saes/{name}/features")
async def dashboards_summary(name: str, request: Request) -> dict[str, Any]:
    dash = _dashboards(request, name)
    s = dash.settings
    return {"sae": name, "features": dash.features if s.features is not None else None, "d_sae": s.d_sae,
            "tokens": dash.tokens, "texts": s.num_texts, "dead": dash.dead, "model": s.model, "layer": s.layer,
            "hook": s.hook, "n_top": s.n_top, "context": [s.before, s.after], "quantiles": s.quantiles,
            "n_quantile": s.n_quantile, "bins": s.bins, "seed": s.seed}


@user.get("/v1/saes/{name}/features/{index}")
async def feature_dashboard(name: str, index: int, request: Request) -> dict[str, Any]:
    dash = _dashboards(request, name)
    if index not in dash:
        raise APIError(404, f"index: no dashboard was computed for feature {index} of SAE {name!r}", "index")
    return {"sae": name, **(await asyncio.to_thread(lambda: dash[index].to_dict()))}
