"""Steering and capture control over HTTP. Routes that change what other users get (global
steering, named modules, capture streams, which record every request) need the admin key; the
read-only status routes are user routes. Each change applies to requests admitted after it
answers: a request keeps the snapshot it was admitted with, as offline."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fastapi import APIRouter, Depends, Request

from steerable.capture.features import SAE_FEATURES
from steerable.capture.serialization import serialize_captured
from steerable.checks import finite_number
from steerable.entrypoints.async_llm import AsyncLLM
from steerable.entrypoints.openai.auth import require_admin, require_user
from steerable.entrypoints.openai.errors import APIError
from steerable.entrypoints.openai.protocol import GlobalSteeringRequest, StreamStartRequest
from steerable.entrypoints.openai.state import server_state
from steerable.errors import InvalidRequestError
from steerable.hook_points import COMPONENTS
from steerable.steering.wire import steering_from_json
from steerable.vectors.files import load_bytes

admin = APIRouter(dependencies=[Depends(require_admin)])
user = APIRouter(dependencies=[Depends(require_user)])


# ---------------------------------------------------------------- steering

@admin.post("/v1/steering/global")
async def set_global(body: GlobalSteeringRequest, request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    await llm.set_steering_vectors(steering_from_json(body.spec, "spec"), body.replace)
    return await llm.get_steering_status()


@admin.delete("/v1/steering/global")
async def clear_global(request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    await llm.clear_steering_vectors()
    return await llm.get_steering_status()


@admin.post("/v1/steering/modules")
async def register_modules(body: dict[str, Any], request: Request) -> dict[str, Any]:
    """``{"name": spec, ...}``: each spec in any JSON form ``steering_vectors`` takes, or a control
    vector file's contents, ``{"control_vector": base64 of a .gguf or .safetensors, "scale": s}``."""
    llm = server_state(request).llm
    await llm.register_steering_modules({name: _module_spec(spec, f"modules[{name!r}]")
                                         for name, spec in body.items()})
    return {"modules": (await llm.get_steering_status())["modules"]}


def _module_spec(spec: Any, where: str) -> Any:
    if not (isinstance(spec, dict) and "control_vector" in spec):
        return steering_from_json(spec, where)
    unknown = sorted(set(spec) - {"control_vector", "scale"})
    if unknown:
        raise InvalidRequestError(f"{where}: unknown key(s) {unknown}; a control-vector module takes "
                                  "'control_vector' (base64 file contents) and 'scale'")
    data = spec["control_vector"]
    if not isinstance(data, str):
        raise InvalidRequestError(f"{where}.control_vector: expected the file's contents as a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error:
        raise InvalidRequestError(f"{where}.control_vector: not valid base64") from None
    cv = load_bytes(raw, f"{where}.control_vector")
    return cv.to_spec(finite_number(spec.get("scale", 1.0), f"{where}.scale"))


@admin.delete("/v1/steering/modules/{name}")
async def unregister_module(name: str, request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    await require_module(llm, name, "name")
    await llm.unregister_steering_modules([name])
    return {"modules": (await llm.get_steering_status())["modules"]}


@user.get("/v1/steering")
async def steering_status(request: Request) -> dict[str, Any]:
    return await server_state(request).llm.get_steering_status()


@user.get("/v1/steering/layers")
async def steerable_layers(request: Request) -> dict[str, list[int]]:
    return await server_state(request).llm.list_steerable_layers()


@user.get("/v1/steering/modules")
async def list_modules(request: Request) -> dict[str, Any]:
    return {"modules": (await server_state(request).llm.get_steering_status())["modules"]}


@user.get("/v1/steering/modules/{name}")
async def get_module(name: str, request: Request) -> dict[str, Any]:
    """What a module adds and clamps, as a ``SteeringSpec`` dict with base64 vectors. A user route:
    a key that may steer with a module can read the vector from captures anyway."""
    llm = server_state(request).llm
    await require_module(llm, name, "name")
    return {"name": name, "spec": (await llm.get_steering_module(name)).to_dict(encoding="base64")}


async def require_module(llm: AsyncLLM, name: str, field: str) -> None:
    """A 404 naming ``field`` unless a module ``name`` is registered: the routes that address a
    module by name treat an unknown one as a missing resource."""
    if name not in (await llm.get_steering_status())["modules"]:
        raise APIError(404, f"{field}: no steering module {name!r} is registered", field)


# ---------------------------------------------------------------- capture streams

@admin.post("/v1/capture/streams/{stream}")
async def start_stream(stream: str, body: StreamStartRequest, request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    await llm.start_capture(_stream(stream), body.layers, body.dtype, body.reduce, body.select, body.budget_rows,
                            body.hook, saes=body.saes, top_k=body.top_k)
    return await llm.capture_status(stream)


@admin.delete("/v1/capture/streams/{stream}")
async def stop_stream(stream: str, request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    await llm.stop_capture(_stream(stream))
    return await llm.capture_status(stream)


@admin.get("/v1/capture/streams/{stream}")
async def fetch_stream(stream: str, request: Request, clear: bool = False, layers: str | None = None
                       ) -> dict[str, Any]:
    """``{"<layer>": wire}`` (base64 data) of the rows stored so far; ``clear=true`` drains them.
    For ``sae_features`` the keys are SAE names (``layers`` then lists names)."""
    state = server_state(request)
    wanted = _layer_list(layers) if stream != SAE_FEATURES else _name_list(layers)
    tensors, metas = await state.llm.fetch_captured(_stream(stream), clear, wanted)
    return serialize_captured(tensors, metas, state.capture.layouts.get(stream), text=True)


@admin.delete("/v1/capture/streams/{stream}/rows")
async def clear_stream(stream: str, request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    await llm.clear_captured(_stream(stream))
    return await llm.capture_status(stream)


@user.get("/v1/capture/streams/{stream}/status")
async def stream_status(stream: str, request: Request) -> dict[str, Any]:
    return await server_state(request).llm.capture_status(_stream(stream))


def _stream(stream: str) -> str:
    if stream not in (*COMPONENTS, SAE_FEATURES):
        raise APIError(404, f"stream: no capture stream {stream!r}; the streams are {[*COMPONENTS, SAE_FEATURES]}",
                       "stream")
    return stream


def _name_list(names: str | None) -> list[str] | None:
    return None if names is None else [part.strip() for part in names.split(",") if part.strip()]


def _layer_list(layers: str | None) -> list[int] | None:
    if layers is None:
        return None
    try:
        return [int(part) for part in layers.split(",") if part.strip()]
    except ValueError:
        raise InvalidRequestError(f"layers: expected comma-separated layer numbers, got {layers!r}") from None
