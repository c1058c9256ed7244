"""The activation endpoints: per-token top features of one SAE (``/activation/topk-by-token``), the
most active features of a source set (``/activation/all``), one feature's or one vector's values
(``/activation/single``), every active feature (``/activation/source``), and their ``-batch``
variants, whose prompts run as one batch. Every prompt gets BOS prepended when it lacks it (the
custom-vector path of ``/activation/single`` tokenizes as the tokenizer does by default), as the
reference does; features are encoded in the engine, on the device, from the residual at each SAE's
own point."""

from __future__ import annotations

from typing import Any

import torch
from fastapi import APIRouter, Request

from steerable.capture.sparse import SparseFeatures
from steerable.entrypoints.neuronpedia.captures import (
    exact_features,
    feature_values,
    hidden_states,
    top_features,
)
from steerable.entrypoints.neuronpedia.context import Context
from steerable.entrypoints.neuronpedia.protocol import (
    ActivationAllBatchRequest,
    ActivationAllRequest,
    ActivationSingleBatchRequest,
    ActivationSingleRequest,
    ActivationSourceRequest,
    ActivationTopkByTokenBatchRequest,
    ActivationTopkByTokenRequest,
    AllFields,
    SingleFields,
)
from steerable.entrypoints.neuronpedia.ranking import rank_features
from steerable.entrypoints.neuronpedia.route import NeuronpediaError, NeuronpediaRoute

router = APIRouter(route_class=NeuronpediaRoute)

DEFAULT_TOP_K = 5
MAX_PROMPTS = 64  # prompts of one -batch call (the reference takes 4)
SOURCE_DECIMALS = 3  # /activation/source rounds its values, as the reference does
NO_DFA = {"dfa_values": None, "dfa_target_index": None, "dfa_max_value": None}  # not computed


def _prompts(ctx: Context, texts: list[str], bos: bool = True) -> list[list[int]]:
    if not texts:
        raise NeuronpediaError(400, "prompts: at least one prompt is required")
    if len(texts) > MAX_PROMPTS:
        raise NeuronpediaError(400, f"prompts: batch size {len(texts)} exceeds the maximum of {MAX_PROMPTS}")
    tokenize = ctx.bos_prompt if bos else ctx.plain_prompt
    return [tokenize(text, f"prompts[{i}]") for i, text in enumerate(texts)]


# ---------------------------------------------------------------- topk-by-token

@router.post("/activation/topk-by-token")
async def topk_by_token(body: ActivationTopkByTokenRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    ids = ctx.bos_prompt(body.prompt)
    return (await _topk(ctx, [ids], body.source, body.top_k, body.ignore_bos))[0]


@router.post("/activation/topk-by-token-batch")
async def topk_by_token_batch(body: ActivationTopkByTokenBatchRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    return {"results": await _topk(ctx, _prompts(ctx, body.prompts), body.source, body.top_k, body.ignore_bos)}


async def _topk(ctx: Context, prompts: list[list[int]], source: str, top_k: int | None,
                ignore_bos: bool) -> list[dict[str, Any]]:
    info = await ctx.source(source, "source")
    k = DEFAULT_TOP_K if top_k is None else top_k
    if k < 1:
        raise NeuronpediaError(400, f"top_k: must be at least 1, got {k}")
    k = min(k, info["d_sae"])
    answers = []
    for ids, rows in zip(prompts, await top_features(ctx, prompts, source, k)):
        strings, special = ctx.token_strings(ids), ctx.special(ids)
        offset = 1 if ignore_bos else 0  # the reference drops position 0, where its BOS is
        results = [{"token_position": t, "token": strings[t], "is_special": special[t],
                    "top_features": _padded_top(rows, t, k)} for t in range(offset, len(ids))]
        answers.append({"results": results, "tokens": strings[offset:]})
    return answers


def _padded_top(rows: SparseFeatures, t: int, k: int) -> list[dict[str, Any]]:
    """Row ``t``'s active features, highest first, then inactive ones (value 0, lowest index
    first) up to ``k`` entries, as a top-k over every feature lists them."""
    kept = [(int(i), float(v)) for i, v in zip(rows.indices[t].tolist(), rows.values[t].tolist()) if i >= 0]
    listed = {i for i, _ in kept}
    filler = (i for i in range(k + len(listed)) if i not in listed)
    kept += [(next(filler), 0.0) for _ in range(k - len(kept))]
    return [{"feature_index": i, "activation_value": v} for i, v in kept]


# ---------------------------------------------------------------- all

@router.post("/activation/all")
async def activation_all(body: ActivationAllRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    ids = ctx.bos_prompt(body.prompt)
    return (await _all(ctx, [ids], body))[0]


@router.post("/activation/all-batch")
async def activation_all_batch(body: ActivationAllBatchRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    return {"results": await _all(ctx, _prompts(ctx, body.prompts), body)}


async def _all(ctx: Context, prompts: list[list[int]], body: AllFields
               ) -> list[dict[str, Any]]:
    names = body.selected_sources or ctx.source_set(body.source_set)  # an empty selection: the whole set
    if body.selected_sources:
        ctx.source_set(body.source_set)  # the set must exist either way
    infos = {name: await ctx.source(name, f"selected_sources[{i}]") for i, name in enumerate(names)}
    num_results = 25 if body.num_results is None else body.num_results
    if num_results < 0:
        raise NeuronpediaError(400, f"num_results: must be >= 0, got {num_results}")
    for ids in prompts:
        for t in body.sort_by_token_indexes:
            if not 0 <= t < len(ids):
                raise NeuronpediaError(400, f"sort_by_token_indexes: token index {t} is out of range for a prompt "
                                            f"of {len(ids)} tokens (BOS included)")
    answers = []
    for ids, by_source in zip(prompts, await exact_features(ctx, prompts, infos)):
        zero_first = body.ignore_bos and bool(ctx.bos_positions(ids[:1]))
        ranked = rank_features([(name, by_source[name], infos[name]["d_sae"]) for name in names], len(ids),
                               body.sort_by_token_indexes, num_results, zero_first)
        answers.append({"activations": [{**row, **NO_DFA} for row in ranked], "tokens": ctx.token_strings(ids),
                        "counts": None})
    return answers


# ---------------------------------------------------------------- single

@router.post("/activation/single")
async def activation_single(body: ActivationSingleRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    return (await _single(ctx, [body.prompt], body, "prompt"))[0]


@router.post("/activation/single-batch")
async def activation_single_batch(body: ActivationSingleBatchRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    _prompts(ctx, body.prompts)  # their count, before anything runs
    return {"results": await _single(ctx, body.prompts, body, None)}


async def _single(ctx: Context, texts: list[str], body: SingleFields,
                  where: str | None) -> list[dict[str, Any]]:
    by_feature = body.source is not None and body.index is not None
    if by_feature == (body.vector is not None and body.hook is not None):
        raise NeuronpediaError(400, "source, index, vector, hook: invalid request data: exactly one of "
                                    "source/index or vector/hook must be provided")
    places = [where or f"prompts[{i}]" for i in range(len(texts))]
    answers = []
    if by_feature:
        info = await ctx.source(body.source, "source")
        index = int(body.index) if body.index.strip().isdigit() else -1
        if not 0 <= index < info["d_sae"]:
            raise NeuronpediaError(400, f"index: {body.index!r} is not a feature of {body.source!r}, which has "
                                        f"{info['d_sae']}")
        prompts = [ctx.bos_prompt(text, place) for text, place in zip(texts, places)]
        for ids, found in zip(prompts, await exact_features(ctx, prompts, {body.source: info})):
            values = feature_values(found[body.source], index).tolist()
            bos = ctx.bos_positions(ids)
            for t in bos:  # the reference zeroes BOS positions and drops the first one
                values[t] = 0.0
            answers.append(_single_answer(ctx, ids, values[1:] if bos else values))
    else:
        point, layer = ctx.site(body.hook, "hook")
        if len(body.vector) != ctx.hidden_size:
            raise NeuronpediaError(400, f"vector: expected {ctx.hidden_size} values (the hidden size), got "
                                        f"{len(body.vector)}")
        vector = torch.tensor(body.vector, dtype=torch.float32)
        prompts = [ctx.plain_prompt(text, place) for text, place in zip(texts, places)]
        for ids, states in zip(prompts, await hidden_states(ctx, prompts, point, layer)):
            answers.append(_single_answer(ctx, ids, (states @ vector).tolist()))
    return answers


def _single_answer(ctx: Context, ids: list[int], values: list[float]) -> dict[str, Any]:
    strings, special = ctx.token_strings(ids), ctx.special(ids)
    drop = len(strings) - len(values)  # the BOS whose value was dropped
    top = max(values)
    return {"activation": {"values": values, "max_value": top, "max_value_index": values.index(top), **NO_DFA},
            "tokens": strings[drop:], "tokens_is_special": special[drop:]}


# ---------------------------------------------------------------- source

@router.post("/activation/source")
async def activation_source(body: ActivationSourceRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    prompts = _prompts(ctx, body.prompts)
    info = await ctx.source(body.source, "source")
    results = []
    for ids, found in zip(prompts, await exact_features(ctx, prompts, {body.source: info})):
        rows = found[body.source]
        active: dict[str, list[list[float]]] = {}
        for t in range(1, len(ids)):  # position 0 (the BOS) is left out, as the reference does
            kept = sorted((i, v) for i, v in zip(rows.indices[t].tolist(), rows.values[t].tolist()) if i >= 0)
            for i, v in kept:
                active.setdefault(str(i), []).append([t, round(v, SOURCE_DECIMALS)])
        results.append({"tokens": ctx.token_strings(ids), "activeFeatures": active})
    return {"results": results}
