"""``/tokenize``, ``/util/sae-vector`` (a feature's decoder row, the direction it writes; the
reference returns the encoder column here, see docs/neuronpedia.md) and
``/util/sae-topk-by-decoder-cossim`` (the features whose decoder rows are most similar to a
feature's or a vector). The SAE weights are the server process's copy of the registered SAE."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch
from fastapi import APIRouter, Request

from steerable.entrypoints.neuronpedia.context import Context
from steerable.entrypoints.neuronpedia.protocol import (
    DecoderCossimRequest,
    SaeVectorRequest,
    TokenizeRequest,
)
from steerable.entrypoints.neuronpedia.route import NeuronpediaError, NeuronpediaRoute
from steerable.hook_points import transformer_lens_name

router = APIRouter(route_class=NeuronpediaRoute)

MAX_COSSIM_RESULTS = 128  # as the reference caps num_results


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """``prepend_bos`` omitted: prepend, as the other endpoints assume (when the tokenizer has a BOS)."""
    ctx = Context(request)
    ctx.check_model(body.model)
    bos = ctx.bos()[1]
    prepend = (True if body.prepend_bos is None else body.prepend_bos) and bos is not None
    ids = ([bos] if prepend else []) + ctx.tokenizer.encode(body.text, add_special_tokens=False)
    ctx.check_length(ids, "text", room=0)
    return {"tokens": ids, "token_strings": ctx.token_strings(ids), "prepend_bos": prepend}


@router.post("/util/sae-vector")
async def sae_vector(body: SaeVectorRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    sae = await ctx.sae_weights(body.source, "source")
    _check_index(body.index, sae.d_sae, body.source, "index")
    return {"vector": sae.decoder_row(body.index).tolist(), "hookName": transformer_lens_name(sae.layer, sae.hook)}


@router.post("/util/sae-topk-by-decoder-cossim")
async def decoder_cossim(body: DecoderCossimRequest, request: Request) -> dict[str, Any]:
    ctx = Context(request)
    ctx.check_model(body.model)
    if (body.feature is None) == (body.vector is None):
        raise NeuronpediaError(400, "feature, vector: invalid request data: exactly one of feature or vector must "
                                    "be provided")
    sae = await ctx.sae_weights(body.source, "source")
    if body.feature is not None:
        ctx.check_model(body.feature.model, "feature.model")
        _check_index(body.feature.index, sae.d_sae, body.source, "feature.index")
        query = sae.W_dec[body.feature.index].float()
    else:
        if len(body.vector) != sae.d_in:
            raise NeuronpediaError(400, f"vector: expected {sae.d_in} values (the hidden size), got {len(body.vector)}")
        query = torch.tensor(body.vector, dtype=torch.float32)
        if not bool(torch.isfinite(query).all()):
            raise NeuronpediaError(400, "vector: contains inf or nan values")
    k = max(1, min(body.num_results, MAX_COSSIM_RESULTS, sae.d_sae))
    values, indices = await asyncio.to_thread(_top_cosine, sae.W_dec, query, k)  # a pass over the decoder
    similar = [{"feature": {"model": body.model, "source": body.source, "index": i},
                "cosine_similarity": v if math.isfinite(v) else 0.0} for v, i in zip(values, indices)]
    feature = None if body.feature is None else body.feature.model_dump()
    return {"feature": feature, "topk_decoder_cossim_features": similar}


def _top_cosine(W_dec: torch.Tensor, query: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    """The ``k`` highest cosine similarities of ``query`` with the decoder rows (float32
    accumulation, no copy of the decoder; a NaN row ranks last)."""
    dots = torch.mv(W_dec, query.to(W_dec.dtype)).float()
    norms = torch.linalg.vector_norm(W_dec, dim=1, dtype=torch.float32)
    cosine = dots / (norms * torch.linalg.vector_norm(query)).clamp_min(1e-8)
    values, indices = torch.topk(torch.nan_to_num(cosine, nan=-math.inf), k)
    return values.tolist(), indices.tolist()


def _check_index(index: int, d_sae: int, source: str, where: str) -> None:
    if not 0 <= index < d_sae:
        raise NeuronpediaError(400, f"{where}: {index} is not a feature of {source!r}, which has {d_sae}")
