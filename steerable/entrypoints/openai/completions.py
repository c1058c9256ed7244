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
from steerable.outputs import CompletionOutput, RequestOutput

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
        self.texts = [p if isinstance(p, str) else None for p in prompts]
        return out

    def prompt_text(self, i: int) -> str:
        """What ``echo`` prepends: the prompt as given, or its tokens decoded (token ids, truncated)."""
        text = self.texts[i]
        if text is None or self.body.truncate_prompt_tokens is not None:
            text = self.state.llm.tokenizer.decode(self.prompts[i], skip_special_tokens=False)
        return text

    def default_max_tokens(self, prompt_len: int) -> int:
        return min(DEFAULT_MAX_TOKENS, self.state.llm.max_model_len - prompt_len)

    def logprobs(self) -> int | None:
        return self.body.logprobs

    def prompt_logprobs(self) -> int | None:
        return self.body.logprobs if self.body.echo else None  # echo scores the prompt's tokens too

    def choice(self, index: int, completion: CompletionOutput, out: RequestOutput) -> dict[str, Any]:
        echo = self.body.echo
        text = self.prompt_text(index // self.body.n) + completion.text if echo else completion.text
        return {"index": index, "text": text, "logprobs": self._logprobs(completion, 0, out if echo else None)}

    def delta(self, index: int, text: str, completion: CompletionOutput, start: int, out: RequestOutput,
              may_skip: bool) -> dict[str, Any]:
        echo = self.body.echo and start == 0  # the prompt rides on a choice's first chunk
        if echo:
            text = self.prompt_text(index // self.body.n) + text
        return {"index": index, "text": text, "logprobs": self._logprobs(completion, start, out if echo else None),
                "finish_reason": None}

    def _logprobs(self, completion: CompletionOutput, start: int, echo: RequestOutput | None) -> dict[str, Any] | None:
        """OpenAI's completions format for tokens from ``start``, after the prompt's tokens when
        echoing (the first has no logprob); offsets count from the start of the choice's text."""
        if completion.logprobs is None:
            return None
        top = self.body.logprobs or 0
        entries = token_logprobs(completion.token_ids[start:], completion.logprobs[start:], top)
        if echo is None and not entries:
            return None
        name = self.token_name
        offset = sum(len(name(t, lps[t])) for t, lps in zip(completion.token_ids[:start], completion.logprobs))
        tokens, values, tops, offsets = [], [], [], []
        if echo is not None:
            offset = 0
            first = echo.prompt_token_ids[0]
            tokens.append(self.state.llm.tokenizer.token_text(first) if not self.body.return_tokens_as_token_ids
                          else f"token_id:{first}")
            values.append(None)
            tops.append(None)
            offsets.append(0)
            offset += len(tokens[0])
            entries = token_logprobs(echo.prompt_token_ids[1:], echo.prompt_logprobs[1:], top) + entries
        for token, sampled, ranked in entries:
            tokens.append(name(token, sampled))
            values.append(sampled.logprob)
            tops.append({name(t, lp): lp.logprob for t, lp in ranked})
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
