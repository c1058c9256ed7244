"""A steer request's ``features`` or ``vectors`` as steerable interventions at residual points.

With ``u`` the steering vector (unit-normalised when ``normalize_steering``; a feature's given
``steering_vector``, else its SAE's decoder row) and ``c = strength_multiplier * strength``:

- ``SIMPLE_ADDITIVE``: ``h += c * u`` -- ``Add(layer, c * u, hook)``;
- ``ORTHOGONAL_DECOMP``: ``h + (c - 1)(h·û) û`` -- ``Clamp(layer, u, hook, factor=c)``;
- ``PROJECTION_CAP``: ``h + (min(h·û, c) - h·û) û`` -- ``Clamp(layer, u, hook, max=c)``;

``û`` the unit direction of ``u``. Features and vectors apply in the order given (clamps at one
point in that order, after the point's summed adds). TransformerLens hooks map onto the points:
``blocks.L.hook_resid_pre`` = ``pre_attn`` L, ``hook_resid_mid`` = ``post_attn`` L,
``hook_resid_post`` = ``post_mlp`` L."""

from __future__ import annotations

import math
from typing import Any

import torch

from steerable.entrypoints.neuronpedia.context import Context
from steerable.entrypoints.neuronpedia.protocol import (
    SteerFeature,
    SteerMethod,
    SteerRequest,
    SteerVector,
)
from steerable.entrypoints.neuronpedia.route import NeuronpediaError
from steerable.selection import SelectSpec
from steerable.steering.spec import Add, Clamp, SteeringSpec


async def steering_spec(ctx: Context, body: SteerRequest, select: SelectSpec | None = None) -> SteeringSpec:
    """The interventions of ``body`` (features or vectors, exactly one), checked with errors that
    name the Neuronpedia field; ``select``: the rows they act on (None: every row)."""
    if (body.features is None) == (body.vectors is None):
        raise NeuronpediaError(400, "features, vectors: invalid request data: exactly one of features or vectors "
                                    "must be provided")
    if body.features is not None:
        sites = [await _feature(ctx, f, f"features[{i}]") for i, f in enumerate(body.features)]
        given = body.features
    else:
        sites = [_vector_site(ctx, v, f"vectors[{i}]") for i, v in enumerate(body.vectors)]
        given = body.vectors
    multiplier = _finite(body.strength_multiplier, "strength_multiplier")
    items = []
    for i, (item, (point, layer, vector)) in enumerate(zip(given, sites)):
        where = f"{'features' if body.features is not None else 'vectors'}[{i}]"
        c = multiplier * _finite(item.strength, f"{where}.strength")
        items.append(_intervention(body.steer_method, body.normalize_steering, point, layer, vector, c, select, where))
    return SteeringSpec(interventions=items)


def _intervention(method: SteerMethod, normalize: bool, point: str, layer: int, vector: torch.Tensor, c: float,
                  select: SelectSpec | None, where: str) -> Add | Clamp:
    norm = float(vector.norm())
    if method is SteerMethod.SIMPLE_ADDITIVE:
        if normalize:
            if norm == 0.0:
                raise NeuronpediaError(400, f"{where}.steering_vector: zero norm steering vector "
                                            "(normalize_steering divides by it)")
            vector = vector / norm
        return Add(layer, vector * c, hook=point, select=select)
    if norm == 0.0:
        raise NeuronpediaError(400, f"{where}.steering_vector: zero norm steering vector ({method.value} "
                                    "steers along its direction)")
    if method is SteerMethod.ORTHOGONAL_DECOMP:
        return Clamp(layer, vector, hook=point, factor=c, select=select)
    return Clamp(layer, vector, hook=point, max=c, select=select)


async def _feature(ctx: Context, feature: SteerFeature, where: str) -> tuple[str, int, torch.Tensor]:
    ctx.check_model(feature.model, f"{where}.model")
    sae = await ctx.sae_weights(feature.source, f"{where}.source")
    if not 0 <= feature.index < sae.d_sae:
        raise NeuronpediaError(400, f"{where}.index: {feature.index} is not a feature of {feature.source!r}, which "
                                    f"has {sae.d_sae}")
    if feature.steering_vector is not None:
        vector = _checked(ctx, feature.steering_vector, f"{where}.steering_vector")
    else:
        vector = sae.decoder_row(feature.index)
    return sae.hook, sae.layer, vector


def _vector_site(ctx: Context, vector: SteerVector, where: str) -> tuple[str, int, torch.Tensor]:
    point, layer = ctx.site(vector.hook, f"{where}.hook")
    return point, layer, _checked(ctx, vector.steering_vector, f"{where}.steering_vector")


def _checked(ctx: Context, values: list[Any], where: str) -> torch.Tensor:
    if len(values) != ctx.hidden_size:
        raise NeuronpediaError(400, f"{where}: expected {ctx.hidden_size} values (the hidden size), got {len(values)}")
    vector = torch.tensor(values, dtype=torch.float32)
    if not bool(torch.isfinite(vector).all()):
        raise NeuronpediaError(400, f"{where}: steering vector contains inf or nan values")
    return vector


def _finite(value: float, where: str) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise NeuronpediaError(400, f"{where}: must be a finite number, got {value}")
    return value
