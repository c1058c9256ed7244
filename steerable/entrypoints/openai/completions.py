"""``POST /v1/completions``: a prompt as text, token ids, or a list of either (one choice per
prompt and completion, indexed ``prompt * n + completion``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from steerable.entrypoints.openai.auth import require_user
from steerable.entrypoints.openai.protocol import CompletionRequest
from steerable.entrypoints.openai.serving import Generation, token_logprobs
from steerable.entrypoints.openai.state import server_state
from steerable.errors import InvalidRequestError
from steerable.outputs import CompletionOutput

router = APIRouter(dependencies=[Depends(require_user)])

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await Completion(server_state(request), body, request).respond()


class Completion(Generation):
    body: CompletionRequest

    def tokenized_prompts(self) -> list[list[int]]:
        prompt = self.body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise InvalidRequestError("prompt: at least one prompt is required")
        tokenizer = self.state.llm.tokenizer
        out = []
        for p in prompts:
            if isinstance(p, str) and not p:
                raise InvalidRequestError("prompt: must not be empty")
            ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise InvalidRequestError("prompt: must contain at least one token")
            out.append(ids)
        return out

    def default_max_tokens(self, prompt_len: int) -> int:
        return min(DEFAULT_MAX_TOKENS, self.state.llm.max_model_len - prompt_len)

    def logprobs(self) -> int | None:
        return self.body.logprobs

    def choice(self, index: int, completion: CompletionOutput) -> dict[str, Any]:
        return {"index": index, "text": completion.text,
                "logprobs": _logprobs(completion, 0, len(completion.token_ids))}

    def delta(self, index: int, text: str, completion: CompletionOutput, start: int) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": _logprobs(completion, start, len(completion.token_ids)),
                "finish_reason": None}


def _logprobs(completion: CompletionOutput, start: int, end: int) -> dict[str, Any] | None:
    """OpenAI's completions format for tokens ``start:end``; offsets count from the completion's start."""
    if completion.logprobs is None or start >= end:
        return None
    offset = sum(len(completion.logprobs[j][t].decoded_token or "")
                 for j, t in enumerate(completion.token_ids[:start]))
    tokens, values, tops, offsets = [], [], [], []
    for sampled, ranked in token_logprobs(completion, start, end):
        tokens.append(sampled.decoded_token)
        values.append(sampled.logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in ranked})
        offsets.append(offset)
        offset += len(sampled.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
