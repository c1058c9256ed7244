"""Prompt activations from the engine for the activation endpoints: each prompt runs as one
request that generates a single token and captures every prompt row, the prompts of a call
together (they batch), and SAE features are encoded on the device (the ``sae_features`` capture).

``exact_features`` returns every active feature of every row, not only the top ``k``: a row whose
``k``-th kept value is 0 has no other active feature (activations are ReLU'd, so >= 0), and a row
whose ``k``-th value is positive may have more, so those SAEs are captured again with ``k`` four
times larger, up to ``d_sae``. Most prompts need one pass (SAE L0 is tens to hundreds)."""

from __future__ import annotations

from typing import Any

import torch

from steerable.capture.session import CaptureSpec
from steerable.capture.sparse import SparseFeatures
from steerable.entrypoints.neuronpedia.context import Context
from steerable.entrypoints.neuronpedia.requests import finished, submit
from steerable.outputs import RequestOutput
from steerable.sampling_params import SamplingParams

FIRST_TOP_K = 256  # features kept per row in the first pass of exact_features


async def run_prompts(ctx: Context, prompts: list[list[int]], capture: list[CaptureSpec]) -> list[RequestOutput]:
    """One single-token request per prompt, every prompt row captured, the prompts in one batch."""
    params = SamplingParams(max_tokens=1, temperature=0.0, capture=capture)
    return await finished(ctx, await submit(ctx, [(str(i), ids, params) for i, ids in enumerate(prompts)]))


async def hidden_states(ctx: Context, prompts: list[list[int]], point: str, layer: int) -> list[torch.Tensor]:
    """float32 [P, H] per prompt: the residual at ``point`` of ``layer`` on every prompt row."""
    spec = CaptureSpec(layers=[layer], hook=point, select="all", dtype="float32")
    outs = await run_prompts(ctx, prompts, [spec])
    return [out.captures["hidden_states"][layer][:len(ids)].float() for out, ids in zip(outs, prompts)]


async def top_features(ctx: Context, prompts: list[list[int]], sae: str, top_k: int) -> list[SparseFeatures]:
    """Each prompt's rows' ``top_k`` highest features of ``sae`` (index -1, value 0 where fewer are active)."""
    spec = CaptureSpec(stream="sae_features", saes=[sae], top_k=top_k, select="all")
    outs = await run_prompts(ctx, prompts, [spec])
    return [_rows(out, sae, len(ids)) for out, ids in zip(outs, prompts)]


async def exact_features(ctx: Context, prompts: list[list[int]], saes: dict[str, dict[str, Any]]
                         ) -> list[dict[str, SparseFeatures]]:
    """Per prompt, per SAE (name -> its ``list_saes`` entry): every active feature of every row."""
    found: list[dict[str, SparseFeatures]] = [{} for _ in prompts]
    wanted = {name: FIRST_TOP_K for name in saes}
    while wanted:
        top_k = min(min(wanted.values()), *(saes[name]["d_sae"] for name in wanted))
        spec = CaptureSpec(stream="sae_features", saes=list(wanted), top_k=top_k, select="all")
        outs = await run_prompts(ctx, prompts, [spec])
        for name in list(wanted):
            rows = [_rows(out, name, len(ids)) for out, ids in zip(outs, prompts)]
            if top_k >= saes[name]["d_sae"] or all(not (r.values[:, -1] > 0).any() for r in rows):
                for per_prompt, r in zip(found, rows):
                    per_prompt[name] = r
                del wanted[name]
            else:
                wanted[name] = top_k * 4
    return found


def _rows(out: RequestOutput, sae: str, prompt_len: int) -> SparseFeatures:
    rows = out.captures["sae_features"][sae]
    return SparseFeatures(rows.indices[:prompt_len], rows.values[:prompt_len])


def feature_values(rows: SparseFeatures, index: int) -> torch.Tensor:
    """float32 [P]: feature ``index``'s activation on each row (0 where it is not among the kept)."""
    hit = rows.indices == index
    return torch.where(hit, rows.values, torch.zeros_like(rows.values)).sum(-1)
