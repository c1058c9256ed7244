"""The vector toolkit over HTTP: train a control vector from contrast pairs, and sweep a registered
module's effect over scales.

- ``POST /v1/vectors/train`` (admin): ``steerable.vectors.train``; answers the vector as a
  safetensors file in base64 (what ``POST /v1/steering/modules`` takes as ``control_vector``) and,
  with ``module``, registers it under that name, which changes what every user can reference.
- ``POST /v1/vectors/evaluate`` (user): ``steerable.vectors.evaluate`` of a module. It changes
  nothing for other users, and its bounded size (``MAX_EVAL_ITEMS`` items times
  ``MAX_EVAL_SCALES`` scales, one-token prefills) is of the order of a completions request with a
  list of prompts, which a user key may already send.

Both run the toolkit in a worker thread on the server's engine (``blocking_llm``), so other
requests keep being served, and both stop when the client disconnects.
"""

from __future__ import annotations

import base64
import os
import tempfile
from typing import Any

from fastapi import APIRouter, Depends, Request

from steerable.entrypoints.openai.admin import require_module
from steerable.entrypoints.openai.auth import require_admin, require_user
from steerable.entrypoints.openai.blocking_llm import run_blocking
from steerable.entrypoints.openai.protocol import EvaluateVectorRequest, TrainVectorRequest
from steerable.entrypoints.openai.state import server_state
from steerable.errors import InvalidRequestError
from steerable.steering.spec import Add, SteeringSpec
from steerable.vectors import ControlVector, EvalReport, evaluate, train

admin = APIRouter(dependencies=[Depends(require_admin)])
user = APIRouter(dependencies=[Depends(require_user)])


@admin.post("/v1/vectors/train")
async def train_vector(body: TrainVectorRequest, request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    cv = await run_blocking(request, llm, lambda view: train(
        view, body.positives, body.negatives, layers=body.layers, method=body.method, token=body.token,
        hook=body.hook, normalize=body.normalize))
    if body.module is not None:
        await llm.register_steering_modules({body.module: cv})
    return {"module": body.module, "hook": cv.hook, "layers": cv.layers, "width": cv.width,
            "metadata": {key: cv.metadata[key] for key in ("method", "pairs", "token", "model_hint")},
            "residual_norm": {str(layer): norm for layer, norm in cv.metadata["residual_norm"].items()},
            "control_vector": _safetensors_base64(cv)}


@user.post("/v1/vectors/evaluate")
async def evaluate_vector(body: EvaluateVectorRequest, request: Request) -> dict[str, Any]:
    llm = server_state(request).llm
    await require_module(llm, body.module, "module")
    cv = module_vector(await llm.get_steering_module(body.module), body.module)
    report = await run_blocking(request, llm, lambda view: evaluate(view, cv, body.items, body.scales,
                                                                    positions=body.positions))
    return report_json(report)


def module_vector(spec: SteeringSpec, name: str) -> ControlVector:
    """A module that adds one vector per layer at one hook on every token (what an uploaded or a
    trained vector registers) as the ``ControlVector`` that ``evaluate`` scales."""
    items = spec.interventions
    hooks = {item.hook for item in items}
    if not all(isinstance(item, Add) and item.select is None for item in items) or len(hooks) != 1:
        raise InvalidRequestError(f"module: {name!r} is not a plain control vector (additions at one hook on every "
                                  "token, no clamps or selections), which a sweep over scales needs")
    directions: dict[int, Any] = {}
    for item in items:
        directions[item.layer] = directions[item.layer] + item.vector if item.layer in directions else item.vector
    return ControlVector(directions, hooks.pop())


def report_json(report: EvalReport) -> dict[str, Any]:
    return {"rows": [{"scale": r.scale, "p_match": r.p_match, "logit_diff": r.logit_diff, "wrong_way": r.wrong_way,
                      "kl": r.kl} for r in report.rows],
            "items": len(report.logit_diffs), "steerability": report.steerability,
            "anti_steerable": report.anti_steerable, "markdown": report.to_markdown()}


def _safetensors_base64(cv: ControlVector) -> str:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "vector.safetensors")
        cv.save(path)
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode("ascii")
